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

__all__ = ["seq_to_heads", "heads_to_seq", "gather_seq", "gather_ints"]


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

    Backward: reduce-scatter of the cotangent, accumulated in float32.
    """
    if _axis_size(axis_name) == 1:
        return x_BSHd
    return lax.all_gather(x_BSHd, axis_name, axis=1, tiled=True)


def _gather_fwd(x, axis_name):
    return gather_seq(x, axis_name), jnp.zeros((0,), x.dtype)


def _gather_bwd(axis_name, dtype_carrier, g):
    if _axis_size(axis_name) == 1:
        return (g,)
    acc = jnp.promote_types(g.dtype, jnp.float32)
    out = lax.psum_scatter(g.astype(acc), axis_name, scatter_dimension=1, tiled=True)
    return (out.astype(dtype_carrier.dtype),)


gather_seq.defvjp(_gather_fwd, _gather_bwd)


def gather_ints(x_BS: jax.Array, axis_name: str) -> jax.Array:
    """All-gather of integer metadata (positions, segment ids) along axis 1."""
    if _axis_size(axis_name) == 1:
        return x_BS
    return lax.all_gather(x_BS, axis_name, axis=1, tiled=True)
