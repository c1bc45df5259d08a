"""Local attention kernels: what each device runs after the collectives.

Every kernel takes explicit global positions (never ``arange``), optional
segment ids and window, in BSHd layout with grouped kv heads.
Letters: B batch, T queries, S keys, H query heads, K kv heads, G=H/K, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp._masks import Window, visible

__all__ = ["KERNELS", "dense_attention", "local_attention"]

KERNELS = ("auto", "blockwise", "xla", "splash", "cudnn")


def dense_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size: Window = None, scale=None,
):
    """Materialises the ``[T, S]`` scores (memory quadratic in S); float32 softmax."""
    B, T, H, d = q_BTHd.shape
    K = k_BSKd.shape[2]
    scale = d**-0.5 if scale is None else scale
    q_BTKGd = q_BTHd.reshape(B, T, K, H // K, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q_BTKGd, k_BSKd, preferred_element_type=jnp.float32) * scale
    mask = visible(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                   is_causal=is_causal, window=local_window_size)[:, None, None]
    s = jnp.where(mask, s, -1e30)
    p = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True))) * mask
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BSKd.dtype), v_BSKd, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, d).astype(q_BTHd.dtype)


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    return kernel


def local_attention(q_BTHd, k_BSKd, v_BSKd, *, kernel: str = "auto", **mask_and_scale):
    """Runs the selected kernel (see ``KERNELS``) on one device's share."""
    kernel = check_kernel(kernel)
    if kernel in ("auto", "xla"):
        return dense_attention(q_BTHd, k_BSKd, v_BSKd, **mask_and_scale)
    raise ValueError(f"kernel={kernel!r} is not available yet; use kernel='xla'.")
