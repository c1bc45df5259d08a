"""The four-axis device mesh and how arrays are placed on it.

Axes, always these names: ``dp`` (batch), ``cp_colossal`` (K/V exchange along
the sequence), ``cp_ulysses`` (sequence <-> head all-to-all), ``tp`` (heads).

``make_mesh``'s axes are ``Auto`` by default (not ``jax.make_mesh``'s ``Explicit``), so the
Flax and optax code around the attention (embedding lookups, losses, optimizer updates, orbax
restores, eager ``jax.grad``) runs unchanged. ``AxisType.Explicit`` works too; see the README
(and docs/guides/meshes.md) for what it asks of that code.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_cp._checks import check_positive_int

DP, COLOSSAL, ULYSSES, TP = "dp", "cp_colossal", "cp_ulysses", "tp"
AXES = (DP, COLOSSAL, ULYSSES, TP)
CP = (COLOSSAL, ULYSSES)  # the sequence axis is sharded colossal-major
METADATA = P(DP, None)  # [B, S] positions / segment ids / span ids: whole rows on every device

__all__ = ["AXES", "CP", "METADATA", "MeshDims", "make_mesh", "mesh_dims", "place", "place_metadata", "seq_chunk"]


def make_mesh(
    *,
    cp_colossal: int = 1,
    cp_ulysses: int = 1,
    tp: int = 1,
    dp: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
) -> Mesh:
    """Builds the ``("dp", "cp_colossal", "cp_ulysses", "tp")`` mesh (why ``Auto`` axes: the Meshes guide).

    Args:
        cp_colossal, cp_ulysses, tp, dp: the axes' sizes; ``dp=None`` takes the devices left over.
        devices: any device list (default ``jax.devices()``), TPU topology devices too (ahead-of-time).
        axis_types: one ``AxisType`` for all axes or one per axis; default ``Auto`` (not ``jax.make_mesh``'s).

    Returns:
        The mesh, laid out by ``jax.make_mesh`` so ``cp_ulysses`` and ``tp`` land on the nearest chips.

    Raises:
        ValueError: a degree is not a positive int or does not fit the devices; bad ``axis_types``.
    """
    for name, value in (("cp_colossal", cp_colossal), ("cp_ulysses", cp_ulysses), ("tp", tp)):
        check_positive_int(name, value)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    cp_tp = cp_colossal * cp_ulysses * tp
    if dp is None:
        if n % cp_tp:
            raise ValueError(
                f"cp_colossal*cp_ulysses*tp={cp_tp} does not divide the {n} devices; "
                f"choose degrees whose product divides {n}."
            )
        dp = n // cp_tp
    check_positive_int("dp", dp)
    if dp * cp_tp != n:
        raise ValueError(
            f"dp*cp_colossal*cp_ulysses*tp={dp}*{cp_colossal}*{cp_ulysses}*{tp}={dp * cp_tp} "
            f"does not match the {n} devices; pass dp=None to use the rest for dp."
        )
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(AXES)
    if axis_types is None:
        raise ValueError("axis_types=None: pass an AxisType (default AxisType.Auto) or one per axis of "
                         f"{AXES}.")
    axis_types = tuple(axis_types)
    if len(axis_types) != len(AXES):
        raise ValueError(f"axis_types={axis_types} needs one AxisType per axis of {AXES}.")
    return jax.make_mesh((dp, cp_colossal, cp_ulysses, tp), AXES, axis_types=axis_types, devices=devices)


@dataclasses.dataclass(frozen=True)
class MeshDims:
    """Sizes of the four axes: ``P = c*u`` is the context-parallel degree.

    Attributes:
        dp: size of the ``dp`` axis.
        c: size of the ``cp_colossal`` axis.
        u: size of the ``cp_ulysses`` axis.
        t: size of the ``tp`` axis.
    """

    dp: int
    c: int
    u: int
    t: int

    @property
    def cp(self) -> int:
        """The context-parallel degree ``P = c*u``."""
        return self.c * self.u


def mesh_dims(mesh) -> MeshDims:
    """Checks that ``mesh`` has the four named axes and returns their sizes.

    Args:
        mesh: a mesh built with :func:`make_mesh` (axes ``dp``, ``cp_colossal``,
            ``cp_ulysses``, ``tp``; extra axes of size 1 are allowed).

    Returns:
        The :class:`MeshDims` of ``mesh``.

    Raises:
        ValueError: ``mesh`` is ``None``, lacks one of the four axes, or has
            extra axes of size > 1.
    """
    if mesh is None:
        raise ValueError("mesh=None: pass the mesh to shard over, e.g. mesh=jax_cp.make_mesh(cp_ulysses=8).")
    names = tuple(getattr(mesh, "axis_names", ()))
    missing = [a for a in AXES if a not in names]
    if missing:
        raise ValueError(
            f"mesh.axis_names={names} lacks {missing}; build the mesh with jax_cp.make_mesh "
            f"(axes {AXES})."
        )
    shape = dict(mesh.shape)
    extra = [a for a in names if a not in AXES and shape[a] != 1]
    if extra:
        raise ValueError(f"mesh has extra axes {extra} of size > 1; jax_cp meshes have exactly the axes {AXES}.")
    return MeshDims(dp=shape[DP], c=shape[COLOSSAL], u=shape[ULYSSES], t=shape[TP])


def is_explicit(mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """Puts ``x`` on ``mesh`` with ``spec``, for Explicit and Auto meshes alike.

    Args:
        x: the array to place.
        mesh: the mesh to place it on.
        spec: the ``PartitionSpec`` of the result.

    Returns:
        ``x`` resharded (Explicit meshes) or sharding-constrained (Auto meshes)
        to ``NamedSharding(mesh, spec)``.
    """
    sharding = NamedSharding(mesh, spec)
    if is_explicit(mesh):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def place_metadata(mesh: Mesh | None, *arrays):
    """Positions, segment ids and span ids placed as every jax_cp layer reads them: whole rows.

    Attention and the linear layers read each row's mask metadata whole on every device
    (``P("dp", None)`` for ``[B, S]``; ``[S]`` ones replicated). Metadata sharded along the sequence
    are gathered where a layer reads them, and inside a rematerialised layer (``jax.checkpoint``,
    ``nnx.remat``, a scan over layers) that gather is redone by every layer of the backward. Placing
    them once before the layers makes it one gather a step.

    Args:
        mesh: a :func:`make_mesh` mesh (Auto or Explicit axes), or ``None`` (the arrays come back as
            they are).
        *arrays: ``[B, S]`` or ``[S]`` integer arrays, or ``None`` (passed through).

    Returns:
        A tuple of the arrays in order, placed ``P("dp", None)`` (``[B, S]``) or ``P()`` (``[S]``).

    Raises:
        ValueError: an array that is not ``[B, S]`` or ``[S]``, or not integer.
    """
    for i, a in enumerate(arrays):
        if a is None:
            continue
        if jnp.ndim(a) not in (1, 2):
            raise ValueError(f"arrays[{i}].shape={tuple(jnp.shape(a))}: mask metadata are [B, S] or [S] "
                             "(positions, segment ids, span ids); pass one per argument.")
        if not jnp.issubdtype(jnp.result_type(a), jnp.integer):
            raise ValueError(f"arrays[{i}].dtype={jnp.result_type(a)}: mask metadata are integers; cast them "
                             "with .astype(jnp.int32).")
    if mesh is None:
        return tuple(arrays)
    return tuple(None if a is None else place(a, mesh, METADATA if jnp.ndim(a) == 2 else P()) for a in arrays)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def gather_dims(stored: P, spec: P, rank: int) -> tuple[tuple[int, tuple[str, ...]], ...] | None:
    """``((dim, axes), ...)``: the dimensions ``stored`` shards over ``axes`` where ``spec`` leaves them
    whole, when ``stored`` is ``spec`` plus such axes (``()``: the same layout); else None."""
    stored_e, spec_e = [list(p) + [None] * (rank - len(p)) for p in (stored, spec)]
    dims = tuple((i, _axes_of(a)) for i, (a, b) in enumerate(zip(stored_e, spec_e)) if a is not None and b is None)
    same = all(a == b for i, (a, b) in enumerate(zip(stored_e, spec_e)) if i not in dict(dims))
    return dims if same else None


def _gather_blocks(w, dims):
    """Inside ``shard_map``: ``w`` all-gathered (tiled) over ``axes`` along each ``(dim, axes)`` of ``dims``."""
    for i, axes in dims:
        w = jax.lax.all_gather(w, axes, axis=i, tiled=True)
    return w


@jax.custom_vjp
def after(x, dep):
    """``x``, computed only once every array of ``dep`` is: a collective on the result can neither start
    before ``dep`` exists nor be combined with one that produces it. The tie is data, not an
    ``optimization_barrier`` (whose control edges the TPU compiler's loop passes drop): one float32 element
    of each ``dep`` array times zero, added to ``x`` (exact for finite values; IEEE keeps XLA from folding
    ``y * 0``). The gradient passes to ``x`` unchanged; ``dep`` gets none from here."""
    leaves = jax.tree.leaves(dep)
    if not leaves:
        return x
    zero = sum(jnp.ravel(a)[0].astype(jnp.float32) for a in leaves) * jnp.float32(0)
    return x + zero.astype(x.dtype)


def _after_fwd(x, dep):
    return after(x, dep), None


def _after_bwd(_, g):
    return g, None


after.defvjp(_after_fwd, _after_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _unshard(w, dims, dtype):
    return _gather_blocks(w.astype(dtype), dims)


def _unshard_fwd(w, dims, dtype):
    return _unshard(w, dims, dtype), jnp.zeros((), w.dtype)


def _unshard_bwd(dims, dtype, res, g):
    # g has the gathered weight's type: sums over axes the weight does not vary over happened at its uses.
    g = g.astype(res.dtype)  # the sum over devices in the stored dtype (float32 parameters: float32)
    for i, axes in reversed(dims):
        g = jax.lax.psum_scatter(g, axes, scatter_dimension=i, tiled=True)
    return (g,)


_unshard.defvjp(_unshard_fwd, _unshard_bwd)


def unshard(w: jax.Array, stored: P, spec: P, dtype=None) -> jax.Array:
    """Inside ``shard_map``: this device's block of a weight stored as ``stored``, all-gathered to the
    layout ``spec`` and cast to ``dtype`` (before the gather: the bytes of ``dtype`` travel).

    The weight's gradient is then this device's partial sum (its own tokens' contribution),
    reduce-scattered over the storage axes in the stored dtype: one reduce-scatter, where
    gathering outside the ``shard_map`` that uses the weight (:func:`gather`) makes the
    sum over the devices an all-reduce of the whole weight first.

    Args:
        w: the local block (the ``shard_map`` input with ``in_specs`` ``stored``).
        stored: the storage layout: ``spec`` plus storage axes (e.g. FSDP) on dimensions ``spec``
            leaves whole.
        spec: the compute layout.
        dtype: the compute dtype (default: ``w``'s).

    Returns:
        The block of the weight in the layout ``spec``.
    """
    dims = gather_dims(stored, spec, w.ndim)
    if dims is None:
        raise ValueError(f"stored={stored} is not spec={spec} plus storage axes on dimensions spec leaves whole; "
                         "store the weight in its compute layout with the storage axes added.")
    dtype = w.dtype if dtype is None else jnp.dtype(dtype)
    return _unshard(w, dims, dtype) if dims else w.astype(dtype)


def gather(x: jax.Array, mesh: Mesh, stored: P, spec: P) -> jax.Array:
    """Gathers ``x`` from its storage layout ``stored`` into the layout ``spec``.

    One explicit all-gather per storage dimension inside ``shard_map``, whose
    transpose is a reduce-scatter (``psum_scatter``). Outside the ``shard_map``
    that uses the weight, the compiler first sums the gradient over the devices
    that hold it whole (an all-reduce): where the use is inside a ``shard_map``,
    :func:`unshard` there instead (CPAttention does).

    Args:
        x: the array, stored as ``stored``.
        mesh: the mesh.
        stored: the storage layout: ``spec`` plus storage axes on dimensions
            ``spec`` leaves whole (e.g. FSDP).
        spec: the layout wanted.

    Returns:
        ``x`` in the layout ``spec``. Other layouts (not ``spec`` plus storage
        axes) go through :func:`place`.
    """
    dims = gather_dims(stored, spec, x.ndim)
    if not dims:
        return place(x, mesh, spec)

    shard = partial(_gather_blocks, dims=dims)
    # all_gather's result is typed varying (only all_gather_invariant's is not, and that one transposes to a
    # slice, not a reduce-scatter): the gathered weight is the same on every device, so the check is off.
    return jax.shard_map(shard, mesh=mesh, in_specs=stored, out_specs=spec, check_vma=False)(place(x, mesh, stored))


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def seq_chunk(a_BS, axis_names: tuple[str, ...]):
    """Inside ``shard_map``: this device's contiguous piece of a full-sequence ``[B, S]`` array,
    for the sequence split over ``axis_names`` (row-major, like ``P(..., (cp_colossal, cp_ulysses))``)."""
    if a_BS is None:
        return None
    n, idx = 1, 0
    for name in axis_names:
        size = jax.lax.axis_size(name)
        n, idx = n * size, idx * size + jax.lax.axis_index(name)
    if n == 1:
        return a_BS
    T = a_BS.shape[1] // n
    return jax.lax.dynamic_slice_in_dim(a_BS, idx * T, T, axis=1)
