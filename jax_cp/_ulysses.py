"""The Ulysses exchange over ``cp_ulysses``: sequence-sharded <-> head-sharded, forward and inverse.

``seq_to_heads`` sends several tensors in one all-to-all (``[B, S/u, H_i, d] ->
[B, S, H_i/u, d]``), ``heads_to_seq`` is its inverse; each ``jax.custom_vjp``
backward is the other direction, one collective. ``a2a`` is the bare
all-to-all both are built from (a no-op on an axis of size 1).
Letters: B batch, S sequence, H heads, d head dim; axis 1 is the sequence, axis 2 the heads.
"""
from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["a2a", "seq_to_heads", "heads_to_seq"]


def a2a(x, axis_name, split_axis, concat_axis):
    """``lax.all_to_all(tiled=True)``, skipped on an axis of size 1."""
    if lax.axis_size(axis_name) == 1:
        return x
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def _pack(parts, u: int):
    """Parts ``[B, S, H_i, d]`` -> ``[B, S, u, sum_i H_i/u, d]``: head group j of every part in slot j.
    Parts of different head dims (MLA's values) travel flat: ``[B, S, u, sum_i H_i/u * d_i]``."""
    B, S = parts[0].shape[:2]
    if _one_head_dim(parts):
        return jnp.concatenate([p.reshape(B, S, u, p.shape[2] // u, p.shape[3]) for p in parts], axis=3)
    return jnp.concatenate([p.reshape(B, S, u, p.shape[2] // u * p.shape[3]) for p in parts], axis=3)


def _one_head_dim(parts) -> bool:
    return len({p.shape[3] for p in parts}) == 1


def _unflatten(flat, like, heads_of):
    """Flat pieces ``[..., h_i * d_i]`` back to ``[..., heads_of(like_i), d_i]``."""
    return tuple(f.reshape(*f.shape[:-1], heads_of(p), p.shape[3]) for f, p in zip(flat, like))


def _split(a, sizes, axis: int):
    """``a`` cut along ``axis`` into consecutive pieces of ``sizes``."""
    return tuple(jnp.split(a, list(itertools.accumulate(sizes))[:-1], axis=axis)) if len(sizes) > 1 else (a,)


def seq_to_heads(parts, axis_name):
    """One all-to-all for a tuple of tensors: each ``[B, S/u, H_i, d] -> [B, S, H_i/u, d]``.

    Head group j of every part travels to the device of ``axis_name`` rank j
    in the same collective (TPUs run one all-to-all at a time, so one larger
    exchange leaves more compute to hide it under than several small ones).
    Backward: the inverse all-to-all, also one collective.

    Args:
        parts: the tensors, each ``[B, S/u, H_i, d]`` (inside ``shard_map``); parts of different
            dtypes travel in the promoted one and come back in their own.
        axis_name: the mesh axis of size ``u`` to exchange over.

    Returns:
        A tuple of ``[B, S, H_i/u, d]`` tensors, each in its part's dtype.
    """
    return _seq_to_heads(tuple(parts), axis_name, tuple(jnp.dtype(p.dtype) for p in parts))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _seq_to_heads(parts, axis_name, dtypes):
    u = lax.axis_size(axis_name)
    if u == 1:
        return tuple(parts)
    y = a2a(_pack(parts, u), axis_name, 2, 1)  # [B, S, 1, sum H_i/u, d]
    if _one_head_dim(parts):
        out = _split(y[:, :, 0], [p.shape[2] // u for p in parts], 2)
    else:
        flat = _split(y[:, :, 0], [p.shape[2] // u * p.shape[3] for p in parts], 2)
        out = _unflatten(flat, parts, lambda p: p.shape[2] // u)
    return tuple(o.astype(d) for o, d in zip(out, dtypes))


def _s2h_fwd(parts, axis_name, dtypes):
    return _seq_to_heads(parts, axis_name, dtypes), None


def _s2h_bwd(axis_name, dtypes, _, gs):
    return (tuple(g.astype(d) for g, d in zip(_unpacked_bwd(axis_name, gs), dtypes)),)


def _unpacked_bwd(axis_name, gs):
    u = lax.axis_size(axis_name)
    if u == 1:
        return tuple(gs)
    B, S = gs[0].shape[:2]
    if not _one_head_dim(gs):  # MLA: flat, as forward
        g = a2a(jnp.concatenate([g_.reshape(B, S, 1, -1) for g_ in gs], axis=3), axis_name, 1, 2)
        flat = _split(g, [g_.shape[2] * g_.shape[3] for g_ in gs], 3)  # [B, S/u, u, h_i * d_i]
        return tuple(f.reshape(B, S // u, u * g_.shape[2], g_.shape[3]) for f, g_ in zip(flat, gs))
    g = jnp.concatenate([g_[:, :, None] for g_ in gs], axis=3)  # [B, S, 1, sum h_i, d]
    g = a2a(g, axis_name, 1, 2)  # [B, S/u, u, sum h_i, d]
    sizes = [g_.shape[2] for g_ in gs]
    chunks = _split(g, sizes, 3)
    return tuple(c.reshape(B, S // u, u * h, c.shape[-1]) for c, h in zip(chunks, sizes))


_seq_to_heads.defvjp(_s2h_fwd, _s2h_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def heads_to_seq(x_BSHd, axis_name):
    """The inverse: ``[B, S, H/u, d] -> [B, S/u, H, d]`` (split sequence, join heads).

    Args:
        x_BSHd: ``[B, S, H/u, d]`` (inside ``shard_map``).
        axis_name: the mesh axis of size ``u`` to exchange over.

    Returns:
        ``[B, S/u, H, d]``.
    """
    return a2a(x_BSHd, axis_name, 1, 2)


def _h2s_fwd(x, axis_name):
    return heads_to_seq(x, axis_name), None


def _h2s_bwd(axis_name, _, g):
    return (a2a(g, axis_name, 2, 1),)


heads_to_seq.defvjp(_h2s_fwd, _h2s_bwd)
