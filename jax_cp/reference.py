"""Single-device ground truth: plain softmax attention, computed in float32.

Every fast path in jax_cp is tested against this module.
Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp._masks import normalize_window, visible

__all__ = ["dot_product_attention", "attend"]


def attend(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None,
):
    """Dense masked attention in BSHD layout with explicit positions, float32 math.

    Rows with no visible key return zeros (and get zero gradients).
    """
    H, K = q_BTHd.shape[2], k_BSKd.shape[2]
    scale = q_BTHd.shape[-1] ** -0.5 if scale is None else scale
    q = q_BTHd.astype(jnp.float32)
    k = jnp.repeat(k_BSKd.astype(jnp.float32), H // K, axis=2)
    v = jnp.repeat(v_BSKd.astype(jnp.float32), H // K, axis=2)
    s_BHTS = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    mask_BTS = visible(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                       is_causal=is_causal, window=normalize_window(local_window_size))
    mask = mask_BTS[:, None]
    s_BHTS = jnp.where(mask, s_BHTS, -1e30)
    p = jnp.exp(s_BHTS - jax.lax.stop_gradient(s_BHTS.max(-1, keepdims=True))) * mask
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("bhts,bshd->bthd", p, v).astype(q_BTHd.dtype)


def dot_product_attention(
    query, key, value, *, is_causal=False, scale=None, layout="BSHD",
    positions=None, segment_ids=None, local_window_size=None,
):
    """The single-device twin of :func:`jax_cp.dot_product_attention`.

    Same arguments (without ``mesh``); ``positions``/``segment_ids`` are
    ``[B, S]`` or ``[S]``; ``None`` positions mean ``arange(S)``.
    """
    if layout == "BNSD":
        query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query, key, value))
    elif layout != "BSHD":
        raise ValueError(f"layout={layout!r} must be 'BSHD' or 'BNSD'.")
    B, S = query.shape[:2]
    if positions is None:
        positions = jnp.arange(S, dtype=jnp.int32)
    positions = jnp.broadcast_to(positions, (B, S))
    if segment_ids is not None:
        segment_ids = jnp.broadcast_to(segment_ids, (B, S))
    out = attend(query, key, value, q_positions=positions, kv_positions=positions,
                 q_segment_ids=segment_ids, kv_segment_ids=segment_ids, is_causal=is_causal,
                 local_window_size=local_window_size, scale=scale)
    return jnp.swapaxes(out, 1, 2) if layout == "BNSD" else out
