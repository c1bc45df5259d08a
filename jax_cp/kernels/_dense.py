"""Dense masked attention, written plainly: the single-device ground truth's core.

On the ground floor (it needs only the masks), so every floor may check itself against it:
``jax_cp.reference`` builds the layer's reference on it, and each K/V exchange's plain
``reference`` calls it. Letters: B batch, T queries, S keys, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp._masks import normalize_window, visible

__all__ = ["attend"]


def attend(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, logits_soft_cap=None, sinks=None,
    return_max_logits=False, return_residual=False, q_span_ids=None, kv_span_ids=None,
):
    """Dense masked attention in BSHD layout with explicit positions, float32 math (float64 for float64 inputs).

    Rows with no visible key return zeros (and get zero gradients).

    Args:
        q_BTHd, k_BSKd, v_BSKd: queries, keys and values.
        q_positions, kv_positions, q_segment_ids, kv_segment_ids: positions and document ids.
        is_causal, local_window_size, scale: the mask and the logit scale.
        logits_soft_cap: ``c``: the scaled logits become ``c * tanh(logits / c)`` before the mask.
        sinks: ``[H]``: one more logit per query head in every row's softmax, whose value is zero.
        return_max_logits: also return ``max_logits [H]``, the largest logit (after the cap) over
            visible pairs, ``-inf`` if none.
        return_residual: append each row's ``logsumexp`` of its visible logits and sink ``[B, T, H]``.
        q_span_ids, kv_span_ids: ``[B, T]``/``[B, S]``, 0: none: a causal mask also lets a query
            see the later keys of its own span.

    Returns:
        ``o``; ``(o, max_logits)`` with ``return_max_logits``; the residual appended with
        ``return_residual``.
    """
    H, K = q_BTHd.shape[2], k_BSKd.shape[2]
    scale = q_BTHd.shape[-1] ** -0.5 if scale is None else scale
    acc = jnp.promote_types(q_BTHd.dtype, jnp.float32)
    q = q_BTHd.astype(acc)
    k = jnp.repeat(k_BSKd.astype(acc), H // K, axis=2)
    v = jnp.repeat(v_BSKd.astype(acc), H // K, axis=2)
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if logits_soft_cap is not None:
        s_BHTS = logits_soft_cap * jnp.tanh(s_BHTS / logits_soft_cap)
    mask_BTS = visible(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                       is_causal=is_causal, window=normalize_window(local_window_size),
                       q_span_BT=q_span_ids, kv_span_BS=kv_span_ids)
    mask = mask_BTS[:, None]
    o = _softmax_values(jnp.where(mask, s_BHTS, -1e30), mask, v, sinks).astype(q_BTHd.dtype)
    extra = (jax.lax.stop_gradient(jnp.where(mask, s_BHTS, -jnp.inf).max((0, 2, 3))),) if return_max_logits else ()
    if return_residual:
        logits = jnp.where(mask, s_BHTS, -jnp.inf)
        if sinks is not None:
            sink = jnp.broadcast_to(sinks.astype(acc)[None, :, None, None], (*logits.shape[:3], 1))
            logits = jnp.concatenate([logits, sink], axis=-1)
        extra += (jnp.swapaxes(jax.nn.logsumexp(logits, axis=-1), 1, 2),)
    return (o, *extra) if extra else o


def _softmax_values(s_BHTS, mask, v, sinks):
    if sinks is not None:  # the sink as one more key column, dropped after the softmax
        B, H, T, S = s_BHTS.shape
        sink_BHT1 = jnp.broadcast_to(sinks.astype(s_BHTS.dtype)[None, :, None, None], (B, H, T, 1))
        p = jax.nn.softmax(jnp.concatenate([s_BHTS, sink_BHT1], axis=-1), axis=-1)[..., :S] * mask
        return jnp.einsum("bhts,bshd->bthd", p, v)
    p = jnp.exp(s_BHTS - jax.lax.stop_gradient(s_BHTS.max(-1, keepdims=True))) * mask
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("bhts,bshd->bthd", p, v)
