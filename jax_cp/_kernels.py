"""Local attention kernels: what each device runs after the collectives.

Every kernel takes explicit global positions (never ``arange``), optional
segment ids and window, in BSHd layout with grouped kv heads.
Letters: B batch, T queries, S keys, H query heads, K kv heads, G=H/K, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp._blockwise import (auto_blocks, blockwise_attention, check_block, check_sinks, check_soft_cap, head_max,
                               varying_sinks)
from jax_cp._cudnn import cudnn_attention, cudnn_unsupported_reason
from jax_cp._masks import Window, normalize_window, visible
from jax_cp._pallas_gpu import unsupported_reason as pallas_gpu_unsupported_reason
from jax_cp._platform import target_platform
from jax_cp._splash import splash_attention, splash_unsupported_reason

__all__ = [
    "KERNELS", "auto_blocks", "blockwise_attention", "check_block", "check_kernel", "check_sinks", "check_soft_cap",
    "cudnn_attention", "cudnn_unsupported_reason", "dense_attention", "local_attention",
    "pallas_gpu_unsupported_reason", "select_kernel", "splash_attention", "splash_unsupported_reason",
    "target_platform",
]

KERNELS = ("auto", "blockwise", "xla", "splash", "cudnn", "pallas_gpu")


def dense_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size: Window = None, scale=None, logits_soft_cap=None, sinks=None,
    return_max_logits: bool = False, return_residual: bool = False,
):
    """Materialises the ``[T, S]`` scores (memory quadratic in S); float32 softmax. ``sinks [H]``
    join each row's denominator (no value); gradients by autodiff. ``return_max_logits=True``:
    ``(o, max_logits [H])`` and ``return_residual=True`` the log-sum-exp, as ``blockwise_attention``."""
    B, T, H, d = q_BTHd.shape
    K = k_BSKd.shape[2]
    scale = d**-0.5 if scale is None else scale
    q_BTKGd = q_BTHd.reshape(B, T, K, H // K, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q_BTKGd, k_BSKd, preferred_element_type=jnp.float32) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    mask = visible(q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                   is_causal=is_causal, window=normalize_window(local_window_size))[:, None, None]
    s = jnp.where(mask, s, -1e30)
    shift = s.max(-1, keepdims=True)
    if sinks is not None:
        sink = check_sinks(sinks, H).astype(jnp.float32).reshape(1, K, H // K, 1, 1)
        shift = jnp.maximum(shift, sink)
    shift = jax.lax.stop_gradient(shift)
    p = jnp.exp(s - shift) * mask
    denom = p.sum(-1, keepdims=True) + (0.0 if sinks is None else jnp.exp(sink - shift))
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BSKd.dtype), v_BSKd, preferred_element_type=jnp.float32)
    o = o.reshape(B, T, H, v_BSKd.shape[-1]).astype(q_BTHd.dtype)
    rows = lambda x: jnp.moveaxis(x[..., 0] if x.ndim == 5 else x, 3, 1).reshape(B, T, H)  # [B, K, G, T(, 1)]
    extra = (head_max(rows(s.max(-1))),) if return_max_logits else ()
    if return_residual:  # log of the softmax's denominator, sinks included
        extra += (jnp.where(rows(denom) > 0, rows(shift + jnp.log(jnp.where(denom > 0, denom, 1.0))), -jnp.inf),)
    return (o, *extra) if extra else o


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}.")
    return kernel


def select_kernel(kernel: str, *, platform: str, is_causal: bool, window: Window, has_segments: bool,
                  dtype, head_dim: int, soft_cap: bool = False, sinks: bool = False,
                  max_logits: bool = False, residual: bool = False, v_head_dim: int | None = None,
                  kv_len: int | None = None) -> str:
    """Resolves ``"auto"`` and checks that an explicit choice can serve the mask.

    ``"auto"``: splash on TPU; on GPU cuDNN when the mask is expressible there, else the fused
    Pallas GPU kernel (positions, segments, windows as data); blockwise otherwise. Explicit splash
    off TPU and pallas_gpu off GPU run Pallas interpret mode (slow, for tests); explicit cuDNN needs
    a GPU. ``kv_len``: keys per kernel call (splash takes windows over at most
    ``_splash.MAX_WINDOW_KEYS``; ``None``: not known, assumed to fit).
    """
    check_kernel(kernel)
    splash_why = splash_unsupported_reason(window=window, kv_len=kv_len, max_logits=max_logits, residual=residual)
    cudnn_why = cudnn_unsupported_reason(is_causal=is_causal, window=window, has_segments=has_segments,
                                         dtype=dtype, head_dim=head_dim, soft_cap=soft_cap, sinks=sinks,
                                         max_logits=max_logits, residual=residual, v_head_dim=v_head_dim)
    gpu_why = pallas_gpu_unsupported_reason(head_dim=head_dim, v_head_dim=v_head_dim)
    if kernel == "auto":
        if platform == "tpu" and splash_why is None:
            return "splash"
        if platform == "gpu" and cudnn_why is None:
            return "cudnn"
        if platform == "gpu" and gpu_why is None:
            return "pallas_gpu"
        return "blockwise"
    if kernel == "pallas_gpu" and gpu_why:
        raise ValueError(f"kernel='pallas_gpu' cannot serve this call: {gpu_why}; use kernel='blockwise' or 'auto'.")
    if kernel == "splash" and splash_why:
        raise ValueError(f"kernel='splash' cannot serve this call: {splash_why}; use kernel='blockwise' or 'auto'.")
    if kernel == "cudnn":
        if platform != "gpu":
            raise ValueError(f"kernel='cudnn' needs a CUDA GPU, but the target platform is {platform!r}; "
                             "use kernel='auto' or 'blockwise'.")
        if cudnn_why:
            raise ValueError(f"kernel='cudnn' cannot serve this call: {cudnn_why}; use kernel='blockwise' or 'auto'.")
    return kernel


def local_attention(
    q_BTHd, k_BSKd, v_BSKd, *, kernel: str = "auto", q_positions, kv_positions, q_segment_ids=None,
    kv_segment_ids=None, is_causal=False, local_window_size=None, scale=None, block_q=None, block_kv=None,
    logits_soft_cap=None, sinks=None, return_max_logits: bool = False, return_residual: bool = False,
    natural_positions: bool = False,
):
    """Runs the selected kernel (see ``KERNELS``, ``select_kernel``) on one device's share.

    ``block_q``/``block_kv`` size the blockwise kernel's tiles (``None``: ``auto_blocks``); the
    platform kernels choose their own. ``sinks [H]``: per-query-head sink logits (or None).
    ``return_max_logits``/``return_residual``: ``o`` then ``max_logits [H]`` and/or the log-sum-exp
    ``[B, T, H]`` (blockwise, pallas_gpu and ``"xla"`` only). ``natural_positions=True`` states that
    both sides' positions are ``arange(S)`` (self-attention, no segment ids): splash then builds its
    mask when traced instead of sorting keys at run time; the other kernels read the positions."""
    window = normalize_window(local_window_size)
    chosen = select_kernel(kernel, platform=target_platform(), is_causal=is_causal, window=window,
                           has_segments=q_segment_ids is not None, dtype=q_BTHd.dtype, head_dim=q_BTHd.shape[-1],
                           soft_cap=logits_soft_cap is not None, sinks=sinks is not None,
                           max_logits=return_max_logits, residual=return_residual, v_head_dim=v_BSKd.shape[-1],
                           kv_len=k_BSKd.shape[1])
    sinks = varying_sinks(sinks, q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions)
    kw = dict(q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
              kv_segment_ids=kv_segment_ids, is_causal=is_causal, local_window_size=window, scale=scale,
              logits_soft_cap=logits_soft_cap, sinks=sinks)
    if chosen == "xla":
        return dense_attention(q_BTHd, k_BSKd, v_BSKd, **kw, return_max_logits=return_max_logits,
                               return_residual=return_residual)
    if chosen in ("blockwise", "pallas_gpu"):  # one algorithm; pallas_gpu runs it as fused Pallas GPU kernels
        return blockwise_attention(q_BTHd, k_BSKd, v_BSKd, **kw, block_q=block_q, block_kv=block_kv,
                                   return_max_logits=return_max_logits, return_residual=return_residual,
                                   kernel=chosen)
    if chosen == "splash":
        return splash_attention(q_BTHd, k_BSKd, v_BSKd, interpret=target_platform() != "tpu",
                                natural_positions=natural_positions, **kw)
    return cudnn_attention(q_BTHd, k_BSKd, v_BSKd, scale=scale)
