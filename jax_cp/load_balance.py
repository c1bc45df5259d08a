"""Causal load balancing: the dual-chunk order of the sequence.

With a causal mask, contiguous chunks give colossal rank 0 almost no work and
the last rank almost all. Reorder once, at the input: cut the sequence into
``2c`` chunks (``c = |cp_colossal|``); colossal rank ``i`` takes chunks ``i`` and
``2c-1-i``. Tokens, labels, positions and segment ids move together, so masks
(computed from positions) stay right: :func:`reorder` hands back the positions
with the arrays, so the order never travels without them. Pure Ulysses (``c = 1``) is a no-op.
Implemented with reshape/reverse/concatenate, never a gather.

:func:`balanced` is the safe way to use it: it runs a function on the balanced order, hands it the
positions it must use and restores what it returns, so neither can be forgotten. Packed rows of
many documents are balanced by a per-batch :func:`plan` (a :class:`Dispatch`, ``jax_cp._dispatch``)
that equalises each rank's visible-pair area; ``balanced`` takes it in place of the mesh, and
:func:`fixed` gives the dual-chunk (or natural) order the same form, to measure a plan against. :func:`reorder` /
:func:`restore` are the parts, for a data pipeline that reorders once on the host (and a loss that
does not care about the order); there the caller passes the positions on and restores.
"""
from __future__ import annotations

import inspect
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp._dispatch import Dispatch, fixed, plan
from jax_cp._masks import normalize_window, visible
from jax_cp._mesh import is_explicit, mesh_dims

__all__ = ["Dispatch", "balanced", "fixed", "plan", "reorder", "restore", "positions", "work"]


def _check_len(seq_len: int, c: int, u: int, name: str = "seq_len") -> None:
    if c > 1 and seq_len % (2 * c):
        raise ValueError(
            f"{name}={seq_len} is not divisible by 2*cp_colossal={2 * c}, as load balancing needs; "
            f"pad the sequence to a multiple of {2 * c * u}."
        )
    if seq_len % (c * u):
        raise ValueError(f"{name}={seq_len} is not divisible by cp_colossal*cp_ulysses={c * u}; pad the sequence.")


def _permute(x, c: int, axis: int, inverse: bool):
    x = jnp.asarray(x)
    ax = axis % x.ndim
    S = x.shape[ax]
    _check_len(S, c, 1, name=f"array.shape[{axis}]")
    pre, post = x.shape[:ax], x.shape[ax + 1 :]
    L = S // (2 * c)
    if not inverse:  # [first half | second half] -> [(c_0, c_2c-1), (c_1, c_2c-2), ...]
        halves = x.reshape(pre + (2, c, L) + post)
        first = jax.lax.index_in_dim(halves, 0, ax, keepdims=False)
        second = jnp.flip(jax.lax.index_in_dim(halves, 1, ax, keepdims=False), axis=ax)
        return jnp.stack([first, second], axis=ax + 1).reshape(x.shape)
    pairs = x.reshape(pre + (c, 2, L) + post)
    first = jax.lax.index_in_dim(pairs, 0, ax + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(pairs, 1, ax + 1, keepdims=False), axis=ax)
    return jnp.concatenate([first, second], axis=ax).reshape(x.shape)


def _permute_any(x, c: int, axis: int, inverse: bool):
    """Explicitly sharded arrays are permuted in auto mode and keep their sharding."""
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and is_explicit(mesh) and any(p is not None for p in sharding.spec):
        return jax.sharding.auto_axes(lambda a: _permute(a, c, axis, inverse), out_sharding=sharding)(x)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_replicated:
        return jax.device_put(_permute(x, c, axis, inverse), x.sharding)  # Auto mesh, eager: keep it too
    return _permute(x, c, axis, inverse)


def _apply(tree, mesh, axis: int, inverse: bool):
    c = mesh_dims(mesh).c
    if c == 1:
        return tree
    return jax.tree.map(lambda x: _permute_any(x, c, axis, inverse), tree)


def reorder(tree, mesh, *, axis: int = 1):
    """Puts every array of ``tree`` (sequence on ``axis``) into the balanced order.

    :func:`restore` undoes the reorder.

    Args:
        tree: a pytree of arrays sharing one sequence length on ``axis``.
        mesh: the mesh whose ``cp_colossal`` size sets the dual-chunk order.
        axis: the sequence axis of every array.

    Returns:
        ``(reordered_tree, positions)``: ``positions`` (``[seq_len]`` int32) are
        the natural positions of the reordered tokens, what ``positions=`` of
        the attention call must be (attention without them assumes the natural
        order and is silently wrong on balanced inputs). A tree that carries its
        own positions (per-document positions of packed sequences, reordered
        with it) passes those instead.

    Raises:
        ValueError: the arrays of ``tree`` do not share one sequence length, or
            it is not divisible by ``2 * cp_colossal``.
    """
    lengths = {jnp.shape(x)[axis] for x in jax.tree.leaves(tree)}
    if len(lengths) != 1:
        raise ValueError(f"reorder: the arrays of tree must share one sequence length on axis={axis}, "
                         f"got lengths {sorted(lengths)}; reorder trees of one sequence length at a time.")
    (seq_len,) = lengths
    return _apply(tree, mesh, axis, inverse=False), _apply(jnp.arange(seq_len, dtype=jnp.int32), mesh, 0, False)


def restore(tree, mesh, *, axis: int = 1):
    """Inverse of :func:`reorder`: back to natural order.

    Args:
        tree: a pytree of arrays in the balanced order (sequence on ``axis``).
        mesh: the mesh :func:`reorder` was given.
        axis: the sequence axis of every array.

    Returns:
        ``tree`` with every array back in natural order.
    """
    return _apply(tree, mesh, axis, inverse=True)


def balanced(fn, order, *, axis: int = 1):
    """``fn`` run on the balanced order, with the positions it needs, its outputs back in natural order.

    Attention never sees the balanced order without its positions, and no caller sees it at all.
    A tree that carries per-document positions reorders them with it: pass those on inside ``fn``
    (``positions=`` then holds the natural positions of the reordered tokens). Works eagerly and
    under ``jit``, with ``jax.grad`` eager or jitted, on Auto and Explicit meshes (on an Explicit
    mesh, eager calls run under ``jax.set_mesh(mesh)``, as JAX asks of any eager op there).

    Given a :class:`Dispatch` read on the host (not a traced one) and an ``fn`` with a
    ``kv_exchange`` parameter, ``"auto"`` (or leaving it out) becomes the plan's
    :attr:`Dispatch.kv_exchange`: only the K/V blocks each rank's queries may see move (for the
    mask the plan was given). An explicit exchange passes as it is.

    Args:
        fn: called as ``fn(reordered_tree, *args, positions=positions, **kwargs)``.
        order: a mesh (the dual-chunk order of :func:`reorder`) or a :class:`Dispatch` (a packed
            batch's plan, :func:`plan`).
        axis: the sequence axis of the arrays of ``tree`` and of ``fn``'s outputs.

    Returns:
        ``g(tree, *args, **kwargs)``: every array of ``tree`` is put in that order, ``fn`` runs, and
        every array it returns whose ``axis`` has the sequence's length is put back; other outputs
        (a loss, per-head statistics) pass as they are.

    Raises:
        ValueError: ``fn`` takes no ``positions`` keyword (it would attend as if the order were
            natural), or (when ``g`` is called) the tree's arrays do not share one sequence length.
    """
    try:
        inspect.signature(fn).bind_partial(positions=None)
    except TypeError:
        raise ValueError(f"balanced: fn={getattr(fn, '__name__', fn)!r} takes no positions= keyword; on the balanced "
                         "order attention needs the positions of the reordered tokens: give fn a positions "
                         "parameter and pass it to the attention (positions=positions).") from None
    except ValueError:  # no signature to read (a builtin): the call will say
        pass

    if isinstance(order, Dispatch):
        forward, back = order.reorder, order.restore
    else:
        forward, back = partial(reorder, mesh=order), partial(restore, mesh=order)

    exchange = _plan_exchange(fn, order)

    def run(tree, *args, **kwargs):
        if exchange is not None and _is_auto(kwargs.get("kv_exchange", "auto")):
            kwargs = {**kwargs, "kv_exchange": exchange}
        reordered, pos = forward(tree, axis=axis)
        seq_len = pos.shape[-1]
        out = fn(reordered, *args, positions=pos, **kwargs)
        along = lambda x: -jnp.ndim(x) <= axis < jnp.ndim(x) and jnp.shape(x)[axis] == seq_len
        return jax.tree.map(lambda x: back(x, axis=axis) if along(x) else x, out)

    return run


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def _plan_exchange(fn, order):
    """The plan's ``kv_exchange`` where ``balanced`` hands it to ``fn`` (a host-side ``Dispatch`` and an
    ``fn`` with a ``kv_exchange`` parameter), else None."""
    if not isinstance(order, Dispatch) or isinstance(order.blocks, jax.core.Tracer):
        return None
    try:
        takes = "kv_exchange" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read
        takes = False
    return order.kv_exchange if takes else None


def positions(seq_len: int, mesh) -> jax.Array:
    """Global positions ``[seq_len]`` (int32) of the reordered sequence.

    Args:
        seq_len: the sequence length.
        mesh: the mesh whose ``cp_colossal`` size sets the order.

    Returns:
        The natural position of each token of the balanced order.

    Raises:
        ValueError: ``seq_len`` is not divisible as load balancing needs.
    """
    dims = mesh_dims(mesh)
    _check_len(seq_len, dims.c, dims.u)
    return _apply(jnp.arange(seq_len, dtype=jnp.int32), mesh, 0, inverse=False)


def work(mesh, seq_len: int, *, is_causal: bool, segment_ids=None, local_window_size=None,
         balanced: bool) -> np.ndarray:
    """Visible (query, key) pairs each CP device computes, shape ``[cp_colossal * cp_ulysses]``.

    Device ``(i, j)`` attends the queries of colossal chunk ``i`` (in the given
    order) for ``1/u`` of the heads, so it is charged ``pairs(chunk i) / u``.

    Args:
        mesh: the mesh.
        seq_len: the sequence length.
        is_causal: whether the attention is causal.
        segment_ids: ``[S]`` or ``[B, S]`` document ids in natural order (summed
            over the batch), or ``None``.
        local_window_size: the sliding window, or ``None``.
        balanced: count on the balanced order (:func:`reorder`) instead of the
            natural one.

    Returns:
        A numpy array of the pairs per CP device.

    Raises:
        ValueError: ``seq_len`` is not divisible by the CP degree (or by
            ``2 * cp_colossal`` when ``balanced``).
    """
    dims = mesh_dims(mesh)
    if balanced:
        _check_len(seq_len, dims.c, dims.u)
    elif seq_len % dims.cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp_colossal*cp_ulysses={dims.cp}; pad the sequence.")
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None]
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32).reshape(-1, seq_len)
    if balanced:
        pos, seg = _apply((pos, seg), mesh, 1, inverse=False)
    window = normalize_window(local_window_size)
    chunk = seq_len // dims.c
    pairs = []
    for i in range(dims.c):
        q = slice(i * chunk, (i + 1) * chunk)
        mask = visible(pos[:, q], pos, None if seg is None else seg[:, q], seg, is_causal=is_causal, window=window)
        pairs.append(float(mask.sum()))
    return np.repeat(np.asarray(pairs) / dims.u, dims.u)
