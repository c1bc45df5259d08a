"""The dense kernel (``"xla"``, jax.nn's name): the ``[T, S]`` scores materialised, plain XLA, every
mask; memory quadratic in the keys. Gradients by autodiff; no log-sum-exp for a ring step to merge.
Letters: B batch, T queries, S keys, H query heads, K kv heads, G=H/K, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp._masks import Window, normalize_window, visible
from jax_cp._softmax import acc_dtype, check_sinks, head_max
from jax_cp.kernels._base import REGISTRY, Kernel, register

__all__ = ["Dense", "dense_attention"]


def dense_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size: Window = None, scale=None, logits_soft_cap=None, sinks=None,
    return_max_logits: bool = False, return_residual: bool = False, q_span_ids=None, kv_span_ids=None,
):
    """Materialises the ``[T, S]`` scores (memory quadratic in S); float32 softmax (float64 for float64
    inputs).

    Gradients by autodiff.

    Args:
        q_BTHd, k_BSKd, v_BSKd: the local queries, keys and values.
        q_positions, kv_positions: global positions of the queries and keys.
        q_segment_ids, kv_segment_ids: document ids (or None).
        q_span_ids, kv_span_ids: bidirectional span ids (0: none), or None: causal masks let a query
            see the later keys of its own span.
        is_causal, local_window_size, scale, logits_soft_cap: the mask, scale and soft cap.
        sinks: ``[H]`` logits joining each row's denominator (no value), or None.
        return_max_logits, return_residual: as ``blockwise_attention``.

    Returns:
        ``o``; with ``return_max_logits=True`` ``(o, max_logits [H])``, and with
        ``return_residual=True`` the log-sum-exp too, as ``blockwise_attention``.
    """
    B, T, H, d = q_BTHd.shape
    K = k_BSKd.shape[2]
    scale = d**-0.5 if scale is None else scale
    q_BTKGd, acc = q_BTHd.reshape(B, T, K, H // K, d), acc_dtype(q_BTHd.dtype)
    s = jnp.einsum("btkgd,bskd->bkgts", q_BTKGd, k_BSKd, preferred_element_type=acc) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    mask = visible(q_positions, kv_positions, q_segment_ids, kv_segment_ids, is_causal=is_causal,
                   window=normalize_window(local_window_size), q_span_BT=q_span_ids,
                   kv_span_BS=kv_span_ids)[:, None, None]
    s = jnp.where(mask, s, -1e30)
    shift = s.max(-1, keepdims=True)
    if sinks is not None:
        sink = check_sinks(sinks, H).astype(acc).reshape(1, K, H // K, 1, 1)
        shift = jnp.maximum(shift, sink)
    shift = jax.lax.stop_gradient(shift)
    p = jnp.exp(s - shift) * mask
    denom = p.sum(-1, keepdims=True) + (0.0 if sinks is None else jnp.exp(sink - shift))
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_BSKd.dtype), v_BSKd, preferred_element_type=acc)
    o = o.reshape(B, T, H, v_BSKd.shape[-1]).astype(q_BTHd.dtype)
    rows = lambda x: jnp.moveaxis(x[..., 0] if x.ndim == 5 else x, 3, 1).reshape(B, T, H)  # [B, K, G, T(, 1)]
    extra = (head_max(rows(s.max(-1))),) if return_max_logits else ()
    if return_residual:  # log of the softmax's denominator, sinks included
        extra += (jnp.where(rows(denom) > 0, rows(shift + jnp.log(jnp.where(denom > 0, denom, 1.0))), -jnp.inf),)
    return (o, *extra) if extra else o


@register
class Dense(Kernel):
    """``xla``: serves every call; a ring step runs blockwise in its place."""

    name = "xla"
    takes_spans = True

    def ring_step(self) -> Kernel:
        return REGISTRY["blockwise"]

    def attend(self, q_BTHd, k_BSKd, v_BSKd, *, block_q=None, block_kv=None, natural_positions=False, **kw):
        return dense_attention(q_BTHd, k_BSKd, v_BSKd, **kw)
