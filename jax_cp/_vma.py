"""Varying-manual-axes (``vma``) typing inside ``jax.shard_map``: shared by the kernels (Pallas calls run
unchecked and are retyped) and the exchanges (loop carries and cotangents typed as their inputs).
"""
from __future__ import annotations

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

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

    Inside a ``shard_map`` that leaves some mesh axes automatic, the call runs in a nested
    ``shard_map`` over those with ``check_vma=False``. Where every mesh axis is already manual (the
    layer's own ``shard_map``; JAX 0.12.1 and later refuse a nested ``shard_map`` over no axis),
    ``fn`` is traced unchecked into one ``jax_cp_unchecked`` primitive, whose lowering and
    batching rules trace it unchecked again. Either way the switch is part of the program, so
    transformations that trace the program again later (``jax.checkpoint``'s partial evaluation of
    the ring's loop) do not trace the kernel's code with the checks on. Callers retype the results
    (``vary_as``), so outside the kernel the checks stay on. Outside ``shard_map`` there is nothing
    to check. ``fn`` is not differentiated through: the kernels call it inside their own
    ``custom_vjp`` rules."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return fn(*args)
    if set(mesh.axis_names) <= set(mesh.manual_axes):
        flat, tree = jax.tree.flatten(args)
        out, out_tree = _bind_unchecked(lambda *a: fn(*jax.tree.unflatten(tree, a)), flat)
        return jax.tree.unflatten(out_tree, out)
    return jax.shard_map(fn, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), axis_names=set(),
                         check_vma=False)(*args)


def _checks_off():
    from jax._src import config  # no public switch: shard_map and pallas_call flip this one

    return config._check_vma(False)


def _bind_unchecked(fn, flat):
    """``fn(*flat)`` (flat arrays in, a pytree out) traced with the checks off and bound as one
    ``jax_cp_unchecked``; values ``fn`` closes over from an enclosing trace become its inputs."""
    with _checks_off():
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*flat)
    outer = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    hoisted = [c for c, t in zip(closed.consts, outer) if t]
    if hoisted:
        n = len(flat)

        def with_consts(*a):
            given = iter(a[n:])
            consts = [next(given) if t else c for c, t in zip(closed.consts, outer)]
            return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(closed.jaxpr, consts))(*a[:n])

        with _checks_off():
            closed = jax.make_jaxpr(with_consts)(*flat, *hoisted)
    return _unchecked_p.bind(*flat, *hoisted, jaxpr=closed), jax.tree.structure(shape)


def _run_unchecked(jaxpr, args):
    with _checks_off():
        return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _lower_unchecked(ctx, *args, jaxpr):
    with _checks_off():
        return mlir.lower_fun(lambda *a: _run_unchecked(jaxpr, a), multiple_results=True)(ctx, *args)


def _batch_unchecked(args, dims, *, jaxpr):
    out, _ = _bind_unchecked(jax.vmap(lambda *a: _run_unchecked(jaxpr, a), in_axes=tuple(dims)), list(args))
    return out, (0,) * len(out)


_unchecked_p = jex_core.Primitive("jax_cp_unchecked")
_unchecked_p.multiple_results = True
_unchecked_p.def_impl(lambda *args, jaxpr: _run_unchecked(jaxpr, args))
_unchecked_p.def_effectful_abstract_eval(lambda *avals, jaxpr: (jaxpr.out_avals, jaxpr.effects))
mlir.register_lowering(_unchecked_p, _lower_unchecked)
batching.primitive_batchers[_unchecked_p] = _batch_unchecked


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

