"""Broadcast products whose gradients XLA:CPU runs fast.

The transpose of a broadcast product ``x * s`` for ``s`` (in every gradient) is a multiply and a
reduce, which XLA:CPU runs as a YNNPACK reduce fusion 10-30x slower than it needs: ``scaled`` (a factor
per row) is a contraction-free ``dot_general`` on CPU, whose transpose is a dot; ``channel_scaled`` (a
weight per channel) sums its weight's gradient itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._vma import vary_as

__all__ = ["channel_scaled", "scaled"]


def scaled(x, s):
    """``x [..., d]`` times ``s``: ``[..., 1]`` or ``[...]`` (broadcast over ``d``) or ``x``'s shape."""
    if s.shape == x.shape:
        return x * s
    s = s[..., 0] if s.ndim == x.ndim else s
    return lax.platform_dependent(
        x, s, cpu=lambda x, s: jnp.einsum("...d,...->...d", x, s, precision=lax.Precision.HIGHEST),
        default=lambda x, s: x * s[..., None])


def channel_scaled(x, w):
    """``x [..., C]`` times ``w [C]`` (one weight per channel, broadcast over the leading axes). Its own
    VJP sums ``g * x`` over the leading axes, which XLA:CPU runs fast, where the transpose of the
    broadcast is a slow YNNPACK reduce (35 against 0.4 ms for ``[1, 8192, 256]``); the same ops elsewhere."""
    return _channel_scaled(x, vary_as(w, x))


def _bcast(w, x):
    return w.reshape((1,) * (x.ndim - 1) + w.shape)


@jax.custom_vjp
def _channel_scaled(x, w):
    return x * _bcast(w, x)


def _channel_fwd(x, w):
    return _channel_scaled(x, w), (x, w)


def _channel_bwd(res, g):
    x, w = res
    return g * _bcast(w, x), jnp.sum(g * x, axis=tuple(range(x.ndim - 1)))


_channel_scaled.defvjp(_channel_fwd, _channel_bwd)
