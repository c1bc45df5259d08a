"""Varying-manual-axes (``vma``) typing inside ``jax.shard_map``: shared by the kernels (Pallas calls run
unchecked and are retyped) and the exchanges (loop carries and cotangents typed as their inputs).
"""
from __future__ import annotations

import jax
from jax import lax

__all__ = ["unchecked", "vary_as", "varying", "vma"]


def vma(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``jax.shard_map``.

    Args:
        x: a value (traced inside ``jax.shard_map``, or not).

    Returns:
        A frozenset of axis names (empty outside ``shard_map``), on every supported JAX release.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older releases call it ``vma``
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def unchecked(fn, *args):
    """``fn(*args)`` traced without manual-axis type checks: for ``pallas_call`` kernels (splash,
    ``pallas_gpu``), which declare their outputs without manual-axis types, which
    ``shard_map(check_vma=True)`` rejects.

    Inside a ``shard_map`` the call runs in a nested ``shard_map`` over no further axes with
    ``check_vma=False``: the switch is part of the program, so transformations that trace the call
    again later (``jax.checkpoint``'s partial evaluation of the ring's loop) trace it unchecked too.
    Callers retype the results (``vary_as``), so outside the kernel the checks stay on. Outside
    ``shard_map`` there is nothing to check."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), axis_names=set(),
                         check_vma=False)(*args)


def varying(refs, *xs):
    """Marks fresh loop carries as varying over the manual mesh axes the inputs vary over.

    Inside ``jax.shard_map`` loop carries must keep one type; zeros start out
    invariant while the updates vary with the data.
    """
    axes = frozenset().union(*(vma(r) for r in jax.tree.leaves(refs)))
    if not axes:
        return xs
    return tuple(lax.pcast(x, tuple(sorted(axes)), to="varying") for x in xs)


def vary_as(x, *refs):
    """``x`` retyped to vary over the manual axes the ``refs`` vary over (no data movement; ``None``
    passes). A differentiable input of a ``custom_vjp`` typed so gets a cotangent of its own type."""
    if x is None:
        return None
    want, have = frozenset().union(*(vma(r) for r in jax.tree.leaves(refs))), vma(x)
    return lax.pcast(x, tuple(sorted(want - have)), to="varying") if want - have else x

