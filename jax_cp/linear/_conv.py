"""The depthwise causal convolution before a linear-attention layer, with its halo across the mesh.

Per device (the sequence split over both CP axes, ``L = S/(c*u)`` tokens, channels over ``tp``): each
token reads the earlier tokens of its run directly; a run's first ``W - 1`` tokens also read the
inputs before the run: ``initial_state`` (zero by default) where a document starts, else the *halo*,
the last ``W - 1`` inputs of the document before the run, wherever they live. Every exported slot
(:mod:`jax_cp.linear._topology`) sends the inputs it knows (a run shorter than ``W - 1`` knows fewer);
one all-gather over ``(cp_colossal, cp_ulysses)`` and a scan in document order complete each halo.
Letters: B batch, S sequence, L tokens per device, C channels, W conv width, P slots per device.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cp._mesh import COLOSSAL, CP, DP, TP, ULYSSES
from jax_cp._vma import vary_as
from jax_cp.linear._args import check_conv, check_state, refuse_spans
from jax_cp.linear._cp import META, Layout, layout, pieces_for, placed_meta, run
from jax_cp.linear._products import channel_scaled
from jax_cp.linear._recurrent import activate, conv_step
from jax_cp.linear._topology import CONT, START, running, topology

__all__ = ["causal_conv1d", "conv_step"]

X_SPEC, STATE_SPEC = P(DP, CP, TP), P(DP, None, TP)


def causal_conv1d(x_BSC, w_WC, *, bias_C=None, mesh=None, positions=None, segment_ids=None, activation="silu",
                  initial_state=None, return_state=False, span_ids=None, max_pieces=None):
    """Depthwise causal convolution of width ``W`` within each document, on one device or a mesh.

    ``y_t = act(sum_i w[i] x_{t-W+1+i} + bias)`` (``Conv1d(padding=W-1)``), where ``x_{t-j}`` is the
    token of ``t``'s document at position - j (zero, or ``initial_state``, before the document's start).
    With a mesh, a run of tokens whose predecessors live elsewhere gets their last ``W - 1`` inputs
    (a halo) through one all-gather over the CP axes, found by segment id and position.

    Args:
        x_BSC: ``[B, S, C]`` inputs; with a mesh sharded ``P("dp", ("cp_colossal", "cp_ulysses"), "tp")``.
        w_WC: ``[W, C]`` the per-channel filters (``w[W-1]`` weighs the current token).
        bias_C: ``[C]`` (optional).
        mesh, positions, segment_ids, span_ids: as :func:`jax_cp.linear.gated_delta_rule`.
        activation: ``"silu"`` or ``None``.
        initial_state: ``[B, W-1, C]`` the inputs before each document's first token (default zero).
        return_state: also return the last document's last ``W - 1`` inputs ``[B, W-1, C]`` (``x``'s
            dtype; what :func:`conv_step` continues from).
        max_pieces: slots per CP device (default: sized from concrete metadata, else ``min(S/(c*u), 16)``), as
            :func:`jax_cp.linear.gated_delta_rule`'s; a slot moves ``(W - 1) * C / tp`` values.

    Returns:
        ``y [B, S, C]`` in ``x``'s dtype, and with ``return_state`` the state.

    Raises:
        ValueError: shapes, dtypes, an activation, a mesh the batch, channels or sequence do not
            divide, ``span_ids``.
    """
    refuse_spans(span_ids)
    activate(0.0, activation)
    B, S, C, W = check_conv(x_BSC, w_WC, bias_C)
    lay = layout(mesh, B, S, C, 1, max_pieces, head_what="channels", heads_over_ulysses=False)
    lay = Layout(mesh, lay.c * lay.u, 1, lay.t, S // (lay.c * lay.u), 1,
                 pieces_for(max_pieces, S // (lay.c * lay.u)))
    x0 = check_state("initial_state", initial_state, (B, W - 1, C), "[B, W-1, C]")
    x0 = jnp.zeros((B, W - 1, C), jnp.float32) if x0 is None else x0
    bias = jnp.zeros((C,), jnp.float32) if bias_C is None else bias_C.astype(jnp.float32)
    pos, seg, lay = placed_meta(positions, segment_ids, B, S, mesh, lay, sized=max_pieces is None)
    y, last = _conv(x_BSC, w_WC.astype(jnp.float32), bias, pos, seg, x0, lay=lay, activation=activation)
    return (y, last.astype(x_BSC.dtype)) if return_state else y


@partial(jax.jit, static_argnames=("lay", "activation"))
def _conv(x, w, bias, pos, seg, x0, *, lay, activation):
    body = partial(_conv_shard, lay=lay, activation=activation)
    specs = (X_SPEC, P(None, TP), P(TP), META, META, STATE_SPEC)
    return run(body, lay, (x, w, bias, pos, seg, x0), specs, (X_SPEC, STATE_SPEC))


def _rank(lay: Layout):
    """The device's index along the sequence (colossal-major over both CP axes)."""
    if lay.mesh is None:
        return 0
    return lax.axis_index(COLOSSAL) * lax.axis_size(ULYSSES) + lax.axis_index(ULYSSES)


def _local(x, w, d_BL):
    """``sum_j w[W-1-j] x_{t-j}`` over the ``j <= d_t`` earlier tokens of each token's run."""
    W, L = w.shape[0], x.shape[1]
    y = channel_scaled(x, w[W - 1])
    for j in range(1, W):
        prev = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :L]
        y = y + channel_scaled(jnp.where((d_BL >= j)[..., None], prev, 0.0), w[W - 1 - j])
    return y


def _weighed_halos(halo_BRWC, w):
    """``K[r, d] = sum_{j>d} w[W-1-j] halo_r[W-1-(j-d)]``: a halo's part in a token ``d`` into its run."""
    W = w.shape[0]
    rows = []
    for d in range(W - 1):
        rows.append(sum(channel_scaled(halo_BRWC[:, :, W - 1 - (j - d)], w[W - 1 - j]) for j in range(d + 1, W)))
    return jnp.stack(rows, axis=2)  # [B, R, W-1, C]


def _known(x, d_BL, kind_BL, x0, tail_tok, W: int):
    """Each exported slot's last ``W - 1`` inputs as far as this device knows them: ``(vals [B, P, W-1,
    C], keep [B, P])``, ``keep`` the entries (from the oldest) that the run's incoming halo supplies."""
    L = x.shape[1]
    d = jnp.take_along_axis(d_BL, tail_tok, axis=1)  # [B, P]
    head_kind = jnp.take_along_axis(kind_BL, tail_tok - d, axis=1)
    m = jnp.arange(W - 1)
    back = (W - 2 - m)[None, None]  # tokens before the tail for entry m
    idx = tail_tok[..., None] - back
    own = back <= d[..., None]
    vals = jnp.take_along_axis(x, jnp.clip(idx, 0, L - 1).reshape(x.shape[0], -1)[..., None], axis=1)
    vals = jnp.where(own[..., None], vals.reshape(idx.shape + x.shape[-1:]), 0.0)
    from_x0 = jnp.take_along_axis(jnp.broadcast_to(x0[:, None], vals.shape), jnp.clip(
        m[None, None] + d[..., None] + 1, 0, W - 2)[..., None], axis=2)  # entry m comes from x0[m + d + 1]
    start = (head_kind == START)[..., None, None]
    vals = vals + jnp.where(start & ~own[..., None], from_x0, 0.0)
    keep = jnp.where(head_kind == START, 0, jnp.maximum(W - 2 - d, 0))
    return vals, keep


def _halos(vals, keep, topo, W: int):
    """The last ``W - 1`` inputs after every global slot, composed in document order."""
    order = topo.order
    v, k = (jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1) for a in (vals, keep))

    def body(prev, xs):
        linked, v, k = xs
        m = jnp.arange(W - 1)
        src = jnp.clip(m[None] + (W - 1 - k)[:, None], 0, W - 2)  # entry m of the shifted predecessor
        shifted = jnp.take_along_axis(prev, src[..., None], axis=1)
        use = ((m[None] < k[:, None]) & linked[:, None])[..., None]
        h = v + jnp.where(use, shifted, 0.0)
        return h, h

    xs = (topo.linked.T, jnp.moveaxis(v, 1, 0), k.T)
    _, h = lax.scan(body, vary_as(jnp.zeros_like(v[:, 0]), v), xs)
    return jnp.take_along_axis(jnp.moveaxis(h, 0, 1), jnp.argsort(order, axis=-1)[..., None, None], axis=1)


def _conv_shard(x, w, bias, pos, seg, x0, *, lay, activation):
    """One device: local taps, the halos of exported slots gathered, composed, and added."""
    B, L, C = x.shape
    W = w.shape[0]
    xf = x.astype(jnp.float32)
    topo = topology(pos, seg, _rank(lay), lay.c, lay.pieces)
    t = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    d = t - running(jnp.maximum, jnp.where(topo.kind != CONT, t, 0), axis=1)
    y = _local(xf, w, d)
    if W > 1:
        vals, keep = _known(xf, d, topo.kind, vary_as(x0, xf), topo.tail_tok, W)
        vals = jnp.where(topo.tail_ok[..., None, None], vals, 0.0)
        if lay.mesh is not None:
            vals, keep = (lax.all_gather(a, CP, axis=1, tiled=True) for a in (vals, keep))
        halo = _halos(vals, keep, topo, W)
        feed = topo.cut_feed
        X = jnp.take_along_axis(halo, jnp.maximum(feed, 0)[..., None, None], axis=1)
        X = jnp.where((feed >= 0)[..., None, None], X, 0.0)
        table = _weighed_halos(jnp.concatenate([X, vary_as(x0, xf)[:, None]], axis=1), w)  # rows: slots, x0
        head_kind = jnp.take_along_axis(topo.kind, t - d, axis=1)
        row = jnp.where(head_kind == START, lay.pieces, topo.gov)
        table = table.reshape(B, -1, C)  # a one-hot matmul, not a gather: its gradient is no scatter
        pick = ((row * (W - 1) + jnp.minimum(d, W - 2))[..., None] == jnp.arange(table.shape[1])[None, None]) & (
            d < W - 1)[..., None]
        y = y + jnp.einsum("blr,brc->blc", pick.astype(table.dtype), table)
        last = jnp.take_along_axis(halo, jnp.maximum(topo.final, 0)[:, None, None, None], axis=1)[:, 0]
        last = jnp.where((topo.final >= 0)[:, None, None], last, 0.0)
    else:
        last = jnp.zeros((B, 0, C), jnp.float32)
    ok = topo.ok[:, None, None]
    y = jnp.where(ok, activate(y + bias[None, None], activation), jnp.nan).astype(x.dtype)
    if lay.mesh is not None:
        last = lax.psum(jnp.where(_rank(lay) == 0, last, 0.0), CP)
    return y, jnp.where(ok, last, jnp.nan)
