"""Per-shard collectives, each with its mirrored backward stated explicitly.

One small pure function per pattern, called inside ``jax.shard_map`` with the
axis name as an argument. Letters: B batch, S local sequence, H heads, d head dim.
Axis 1 is the sequence, axis 2 the heads (BSHd layout).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["seq_to_heads", "heads_to_seq", "gather_seq", "spread_kv"]


def _axis_size(axis_name: str) -> int:
    return lax.axis_size(axis_name)


def _a2a(x, axis_name, split_axis, concat_axis):
    if _axis_size(axis_name) == 1:
        return x
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def seq_to_heads(x_BSHd: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S/u, H, d] -> [B, S, H/u, d]``: all-to-all splitting heads, joining sequence."""
    return _a2a(x_BSHd, axis_name, 2, 1)


def _s2h_fwd(x, axis_name):
    return seq_to_heads(x, axis_name), None


def _s2h_bwd(axis_name, _, g):
    return (heads_to_seq(g, axis_name),)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def heads_to_seq(x_BSHd: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S, H/u, d] -> [B, S/u, H, d]``: the inverse all-to-all."""
    return _a2a(x_BSHd, axis_name, 1, 2)


def _h2s_fwd(x, axis_name):
    return heads_to_seq(x, axis_name), None


def _h2s_bwd(axis_name, _, g):
    return (seq_to_heads(g, axis_name),)


seq_to_heads.defvjp(_s2h_fwd, _s2h_bwd)
heads_to_seq.defvjp(_h2s_fwd, _h2s_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_seq(x_BSHd: jax.Array, axis_name: str) -> jax.Array:
    """``[B, S/c, ...] -> [B, S, ...]``: all-gather along the sequence.

    Backward: the cotangent in float32, cut into ``c`` sequence blocks, an
    all-to-all sends block ``i`` of every device to device ``i``, which sums
    them. The same bytes as a reduce-scatter, but asynchronous on TPU, where
    reduce-scatter is scheduled synchronously.
    """
    if _axis_size(axis_name) == 1:
        return x_BSHd
    return lax.all_gather(x_BSHd, axis_name, axis=1, tiled=True)


def _gather_fwd(x, axis_name):
    return gather_seq(x, axis_name), jnp.zeros((0,), x.dtype)


def _gather_bwd(axis_name, dtype_carrier, g):
    c = _axis_size(axis_name)
    if c == 1:
        return (g,)
    B, S = g.shape[:2]
    acc = jnp.promote_types(g.dtype, jnp.float32)
    blocks = g.astype(acc).reshape(B, c, S // c, *g.shape[2:])
    blocks = lax.all_to_all(blocks, axis_name, 1, 1, tiled=True)  # block i of every device -> device i
    return (blocks.sum(1).astype(dtype_carrier.dtype),)


gather_seq.defvjp(_gather_fwd, _gather_bwd)


def _spread_axes(colossal: str, ulysses: str | None):
    axes = (colossal,) if ulysses is None else (colossal, ulysses)
    return axes, _axis_size(colossal), 1 if ulysses is None else _axis_size(ulysses)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def spread_kv(x_BTPHd: jax.Array, colossal: str, ulysses: str | None = None) -> jax.Array:
    """``[B, S/(c*u), P, H, d] -> [B, S, P, H/u, d]`` in one all-to-all over both CP axes.

    What the Ulysses all-to-all followed by the colossal all-gather deliver
    (every token, this device's ``cp_ulysses`` head group), in one collective:
    each device sends its tokens' head group ``j`` to every device whose
    ``cp_ulysses`` rank is ``j``. The bytes on the wire equal those of the two
    steps; TPUs run one all-to-all at a time, so one exchange instead of two
    leaves more compute to hide each under. ``P`` stacks K and V.
    ``ulysses=None``: heads already split, the gather over ``colossal`` alone
    as an all-to-all of ``c`` copies (asynchronous on TPU, unlike all-gather
    off v5e).

    Backward: the cotangent in float32 goes back by the inverse all-to-all and
    the ``c`` copies of each block are summed.
    """
    axes, c, u = _spread_axes(colossal, ulysses)
    if c * u == 1:
        return x_BTPHd
    B, T, Pp, H, d = x_BTPHd.shape
    y = x_BTPHd.reshape(B, T, Pp, u, H // u, d).transpose(0, 1, 3, 2, 4, 5)  # [B, T, u, P, H/u, d]
    y = jnp.broadcast_to(y[:, :, None], (B, T, c, u, Pp, H // u, d)).reshape(B, T, c * u, Pp, H // u, d)
    y = lax.all_to_all(y, axes, 2, 1, tiled=True)  # [B, S, 1, P, H/u, d]: sources in mesh order
    return y.reshape(B, c * u * T, Pp, H // u, d)


def _spread_fwd(x, colossal, ulysses):
    return spread_kv(x, colossal, ulysses), jnp.zeros((0,), x.dtype)


def _spread_bwd(colossal, ulysses, dtype_carrier, g_BSPhd):
    axes, c, u = _spread_axes(colossal, ulysses)
    if c * u == 1:
        return (g_BSPhd,)
    B, S, Pp, h, d = g_BSPhd.shape
    acc = jnp.promote_types(g_BSPhd.dtype, jnp.float32)
    g = g_BSPhd.astype(acc).reshape(B, S, 1, Pp, h, d)
    g = lax.all_to_all(g, axes, 1, 2, tiled=True)  # [B, T, c*u, P, h, d]: block of every device
    g = g.reshape(B, S // (c * u), c, u, Pp, h, d).sum(2)  # the c copies of each head group
    g = g.transpose(0, 1, 3, 2, 4, 5).reshape(B, S // (c * u), Pp, u * h, d)
    return (g.astype(dtype_carrier.dtype),)


spread_kv.defvjp(_spread_fwd, _spread_bwd)
