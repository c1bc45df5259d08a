"""Single-device ground truth of the linear-attention layers: the recurrences, one token at a time.

Every chunked and context-parallel path of ``jax_cp.linear`` is tested against these. Tokens may come
in any order: each row is put in document order (by segment id, then position), a document starts
afresh (from ``initial_state``, zero by default) wherever the segment id changes or the position is not
the previous one plus one, and outputs go back to the tokens' own order. States are float32.
Negative segment ids (padding) are documents of their own; the returned state is that of the row's
last document (the greatest segment id >= 0) after its last position, zero if the row has none.
Letters: B batch, S sequence, H heads, G groups, k key dim, v value dim, p head dim, n state dim,
W conv width, C channels.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_cp.linear._args import check_conv, check_gdn, check_metadata, check_ssd, check_state, refuse_spans
from jax_cp.linear._recurrent import conv_step, default_scale, gated_delta_step, mamba2_step

__all__ = ["causal_conv1d", "document_order", "gated_delta_rule", "mamba2_ssd"]

F32 = jnp.float32


def document_order(positions, segment_ids, batch: int, seq_len: int):
    """Each row's tokens in document order: sorted by (segment id, position), never by index.

    Args:
        positions, segment_ids: ``[B, S]`` (or ``[S]``) ints, or None (``arange`` / one document).
        batch, seq_len: the shape ``[B, S]``.

    Returns:
        ``(order [B, S], start [B, S], last_is_doc [B])``: the sorting permutation, which sorted token
        starts a document (the segment changes or the position is not the previous + 1), and whether
        the row's last sorted token belongs to a document (segment id >= 0) rather than padding.
    """
    pos = check_metadata("positions", positions, batch, seq_len)
    seg = check_metadata("segment_ids", segment_ids, batch, seq_len)
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len)) if pos is None else pos
    seg = jnp.zeros((batch, seq_len), jnp.int32) if seg is None else seg
    order = jnp.lexsort((pos, seg), axis=-1)
    p, s = (jnp.take_along_axis(a, order, axis=1) for a in (pos, seg))
    same = (s[:, 1:] == s[:, :-1]) & (p[:, 1:] == p[:, :-1] + 1)
    start = jnp.concatenate([jnp.ones((batch, 1), bool), ~same], axis=1)
    last_is_doc = s[:, -1] >= 0
    return order, start, last_is_doc


def _take(a, order):
    return jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1)


def _scan_tokens(step, init, xs_BS, start_BS, order, last_is_doc):
    """``step(state, *token) -> (out, state)`` over each row's tokens in document order, the state
    reset to ``init`` at each document start; outputs back in the given order, and the last state
    (zero where the row's last document is padding)."""
    xs = tuple(jnp.moveaxis(_take(a, order), 1, 0) for a in xs_BS)

    def body(state, token):
        start, *x = token
        state = jnp.where(start.reshape((-1,) + (1,) * (state.ndim - 1)), init, state)
        out, state = step(state, *x)
        return state, out

    last, out = lax.scan(body, init, (jnp.moveaxis(start_BS, 1, 0),) + xs)
    out = _take(jnp.moveaxis(out, 0, 1), jnp.argsort(order, axis=-1))
    return out, jnp.where(last_is_doc.reshape((-1,) + (1,) * (last.ndim - 1)), last, 0)


def gated_delta_rule(q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH, *, positions=None, segment_ids=None,
                     initial_state=None, return_state=False, scale=None, span_ids=None):
    """The gated delta rule token by token (:func:`jax_cp.linear.gated_delta_rule` without a mesh).

    Args:
        q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH: as :func:`jax_cp.linear.gated_delta_rule`.
        positions, segment_ids, initial_state, return_state: as there.
        scale, span_ids: as there.

    Returns:
        ``o [B, S, H, dv]`` (``v``'s dtype), and with ``return_state`` the last document's final state
        ``[B, H, dv, dk]`` float32.
    """
    refuse_spans(span_ids)
    B, S, H, dk, dv = check_gdn(q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH, 1)
    init = check_state("initial_state", initial_state, (B, H, dv, dk), "[B, H, dv, dk]")
    init = jnp.zeros((B, H, dv, dk), F32) if init is None else init
    order, start, last_is_doc = document_order(positions, segment_ids, B, S)
    scale = default_scale(scale, dk)
    step = lambda s, q, k, v, g, b: gated_delta_step(s, q, k, v, g, b, scale=scale)  # noqa: E731
    o, last = _scan_tokens(step, init, (q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH), start, order, last_is_doc)
    return (o, last) if return_state else o


def mamba2_ssd(x_BSHp, dt_BSH, A_H, B_BSGn, C_BSGn, *, D_H=None, positions=None, segment_ids=None,
               initial_state=None, return_state=False, span_ids=None):
    """Mamba-2's SSD token by token (:func:`jax_cp.linear.mamba2_ssd` without a mesh).

    Args:
        x_BSHp, dt_BSH, A_H, B_BSGn, C_BSGn, D_H: as :func:`jax_cp.linear.mamba2_ssd`.
        positions, segment_ids, initial_state, return_state, span_ids: as there.

    Returns:
        ``y [B, S, H, p]`` (``x``'s dtype), and with ``return_state`` ``[B, H, p, n]`` float32.
    """
    refuse_spans(span_ids)
    B, S, H, p, n = check_ssd(x_BSHp, dt_BSH, A_H, B_BSGn, C_BSGn, D_H, 1)
    init = check_state("initial_state", initial_state, (B, H, p, n), "[B, H, p, n]")
    init = jnp.zeros((B, H, p, n), F32) if init is None else init
    order, start, last_is_doc = document_order(positions, segment_ids, B, S)
    step = lambda s, x, dt, b, c: mamba2_step(s, x, dt, A_H, b, c, D_H=D_H)  # noqa: E731
    y, last = _scan_tokens(step, init, (x_BSHp, dt_BSH, B_BSGn, C_BSGn), start, order, last_is_doc)
    return (y, last) if return_state else y


def causal_conv1d(x_BSC, w_WC, *, bias_C=None, positions=None, segment_ids=None, activation="silu",
                  initial_state=None, return_state=False, span_ids=None):
    """The depthwise causal convolution token by token (:func:`jax_cp.linear.causal_conv1d` without a mesh).

    Args:
        x_BSC, w_WC, bias_C, positions, segment_ids, activation, initial_state, return_state, span_ids:
            as :func:`jax_cp.linear.causal_conv1d`.

    Returns:
        ``y [B, S, C]`` (``x``'s dtype), and with ``return_state`` the last ``W - 1`` inputs of the last
        document ``[B, W-1, C]``.
    """
    refuse_spans(span_ids)
    B, S, C, W = check_conv(x_BSC, w_WC, bias_C)
    init = check_state("initial_state", initial_state, (B, W - 1, C), "[B, W-1, C]")
    init = jnp.zeros((B, W - 1, C), x_BSC.dtype) if init is None else init.astype(x_BSC.dtype)
    order, start, last_is_doc = document_order(positions, segment_ids, B, S)
    step = lambda s, x: conv_step(s, x, w_WC, bias_C=bias_C, activation=activation)  # noqa: E731
    y, last = _scan_tokens(step, init, (x_BSC,), start, order, last_is_doc)
    return (y, last) if return_state else y
