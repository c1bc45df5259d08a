"""Softmax pieces every attention path shares: the accumulation dtype, the finite minus-infinity,
the soft-cap and sink checks, folding sinks into a softmax, merging two partial softmaxes by
log-sum-exp and the sink gradient. Used by the kernels, the exchanges (ring, Attended) and decode.
Letters: B batch, T queries, H query heads.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_cp._vma import vary_as

__all__ = ["NEG", "acc_dtype", "check_sinks", "check_soft_cap", "fold_sinks", "head_max", "merge_softmax", "sinks_grad",
           "varying_sinks"]

NEG = -1e30  # finite minus-infinity: masked scores, and the lse of rows that see no key


def acc_dtype(dtype):
    """Scores, softmax state and gradient accumulators for inputs of ``dtype``: float32 for float32 and
    narrower, float64 for float64 (``jax_enable_x64``), which float32 would silently round."""
    return jnp.promote_types(dtype, jnp.float32)


def check_soft_cap(value) -> float | None:
    """``logits_soft_cap``: a positive finite number, or ``None`` (no capping).

    Args:
        value: the ``logits_soft_cap`` given.

    Returns:
        ``value`` as a float, or ``None``.

    Raises:
        ValueError: ``value`` is not a positive finite number or ``None``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"logits_soft_cap={value!r} must be a positive number (e.g. 50.0, Gemma 2's) or None "
                         "(no capping).")
    return float(value)


def _sink_like(sinks_H, lse, head_axis: int):
    shape = [1] * lse.ndim
    shape[head_axis] = -1
    return sinks_H.astype(lse.dtype).reshape(shape)


def fold_sinks(o, lse, sinks_H, head_axis: int = -1):
    """The attention sinks join every row's softmax once, after all its keys: ``(o, lse)`` of the
    keys (``acc_dtype``; ``o`` has ``lse``'s axes plus the head dim) -> ``(o, lse)`` of the keys and the
    sink logit, which adds to the denominator and contributes no value. ``None`` sinks: unchanged."""
    if sinks_H is None:
        return o, lse
    new = jnp.logaddexp(lse, _sink_like(sinks_H, lse, head_axis))
    return o * jnp.exp(lse - new)[..., None], new


def merge_softmax(a, b):
    """Two partial softmaxes ``(o, lse)`` (``acc_dtype``) over disjoint keys -> the softmax over both (a
    ring step's merge of its chunk into what earlier chunks gave)."""
    (o0, lse0), (o1, lse1) = a, b
    new = jnp.logaddexp(lse0, lse1)
    return o0 * jnp.exp(lse0 - new)[..., None] + o1 * jnp.exp(lse1 - new)[..., None], new


def sinks_grad(sinks_H, lse, delta, head_axis: int = -1):
    """``d loss / d sinks``: ``-sum(p_sink * delta)`` over every axis but the heads, where ``p_sink =
    exp(sink - lse)`` is the sink's share of the (folded) softmax and ``delta = sum(do * o, -1)``."""
    if sinks_H is None:
        return None
    g = -jnp.exp(_sink_like(sinks_H, lse, head_axis) - lse) * delta
    return jnp.moveaxis(g, head_axis, -1).reshape(-1, sinks_H.shape[0]).sum(0).astype(sinks_H.dtype)


def head_max(max_BTH):
    """Rows' largest visible logits ``[B, T, H]`` -> per head ``[H]`` (their dtype), ``-inf`` where no
    row saw a key (the max-logit statistic, e.g. for QK-clip)."""
    m = lax.stop_gradient(max_BTH).max((0, 1))
    return jnp.where(m > 0.5 * NEG, m, -jnp.inf)


def check_sinks(sinks, num_heads: int):
    """``sinks``: a floating ``[num_heads]`` array (one logit per query head).

    Args:
        sinks: the sink logits given.
        num_heads: the number of query heads.

    Returns:
        ``sinks``.

    Raises:
        ValueError: ``sinks`` is not a floating array of shape ``(num_heads,)``.
    """
    shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
    if shape != (num_heads,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"sinks (shape={shape}, dtype={dtype}) must be a floating array of shape "
                         f"(num_heads,)=({num_heads},): one sink logit per query head.")
    return sinks


def varying_sinks(sinks, q_BTHd, *refs):
    """Checked ``sinks`` (``None`` passes), typed to vary over the manual axes ``q`` and ``refs``
    vary over: the sink gradient, summed from them, then has the primal's type."""
    return None if sinks is None else vary_as(check_sinks(sinks, q_BTHd.shape[2]), q_BTHd, *refs)

