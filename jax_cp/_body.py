"""The one per-shard body of every attention call, and the metadata it is handed.

``attention_shard`` runs inside ``jax.shard_map`` for ``CPAttention`` and for
``dot_product_attention`` alike; what differs is the ``projections`` object:

    per head chunk i:
      parts, carry = projections.q_parts(i, carry)   Q (or Q, K, V when fused), QK-norm/RoPE applied
      q, *kv = seq_to_heads(parts)           the Ulysses exchange, one all-to-all
      o = exchange.attend(q, k, v, ...)      the K/V exchange over cp_colossal and the local kernel
                                             (with the chunk's sink logits, projections.sinks(i), if any)
          (or exchange.attend_local(q, *projections.kv_parts(i), ...) when K/V were not fused)
      y += projections.output(i, o)          inverse all-to-all (+ output projection)
    projections.finish(y)                    psum over tp (+ output bias)

With ``spec.record_max_logits`` every chunk's exchange also returns its heads' largest logit, and
the body returns ``(y, max_logits [H/t])``: the maximum over dp and cp_colossal (other queries of
the same heads), the head groups gathered over cp_ulysses, chunks in head order. With
``spec.return_residual`` it also returns each row's log-sum-exp ``[B, S/(c*u), H/t]``, back on the
device's own tokens by the inverse all-to-all (``GivenQKV``'s single chunk).

Letters: B batch, S sequence.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_cp import kernels
from jax_cp._mesh import COLOSSAL, DP, METADATA, ULYSSES, place
from jax_cp._ulysses import heads_to_seq, seq_to_heads
from jax_cp._meta import Meta

__all__ = ["attention_shard", "GivenQKV", "placed_metadata", "span_sides", "check_dtype", "check_metadata", "kernel_for_dtype",
           "META_SPEC", "metadata_sides", "shard_call"]

# [B, S] positions / segment ids: replicated over the sequence axes. Each device slices
# the parts it needs, so the layer runs no collective for metadata (ints, B*S*4 bytes,
# gathered once outside the layer and shared by every layer of a model).
META_SPEC = METADATA


def attention_shard(projections, meta: Meta, *, spec, keep_kv: bool = False):
    """Per device: every head chunk through project -> exchange -> attend -> output, then finish
    (``meta``: the queries' and keys' positions and segment ids). ``keep_kv=True`` also returns each
    chunk's ``(k, v)`` on this device's own tokens, before any exchange (what a prefill caches)."""
    exchange = spec.kv_exchange
    y, stats, residuals, kept, carry = 0, [], [], [], projections.start()
    for i in range(spec.overlap_chunks):
        # Chunk i's collectives depend on nothing of chunk i+1: XLA hides one under the other.
        parts, carry = projections.q_parts(i, carry)
        q, *kv = seq_to_heads(parts, ULYSSES)
        sinks = ulysses_heads(projections.sinks(i))
        local = parts[1:] if kv else projections.kv_parts(i)  # K/V on own tokens: fused, or projected now
        kept.append(local)
        # Fused: Q, K and V crossed cp_ulysses together; else K/V go after Q's all-to-all was issued.
        o = exchange.attend(q, *kv, meta, spec, sinks) if kv else exchange.attend_local(q, *local, meta, spec, sinks)
        o, *extra = o if spec.record_max_logits or spec.return_residual else (o,)
        if spec.record_max_logits:
            stats.append(_heads_max(extra.pop(0)))
        if spec.return_residual:
            residuals.append(heads_to_seq(extra.pop(0)[..., None], ULYSSES)[..., 0])
        y = y + projections.output(i, o)
    extra = ([jnp.concatenate(stats)] if stats else []) + ([jnp.concatenate(residuals, axis=2)] if residuals else [])
    out = (projections.finish(y), *extra) if extra else projections.finish(y)
    return (out, kept) if keep_kv else out


def _heads_max(m_h):
    """This device's head group's maxima ``[H/u]`` -> the chunk's ``[H]``, maximised over every
    device: each group in its ``cp_ulysses`` slot (``-inf`` elsewhere), then one ``pmax``."""
    u, m_h = lax.axis_size(ULYSSES), lax.stop_gradient(m_h)  # a statistic: no tangent reaches the pmax
    slots = jnp.full((u, m_h.shape[0]), -jnp.inf, m_h.dtype)
    slots = lax.dynamic_update_slice_in_dim(slots, m_h[None], lax.axis_index(ULYSSES), axis=0)
    return lax.pmax(slots.reshape(-1), (DP, COLOSSAL, ULYSSES))


def ulysses_heads(x_H):
    """Per-head values of a chunk's heads ``[H]`` -> those of the head group ``seq_to_heads`` hands
    this device's ``cp_ulysses`` rank (``None`` passes)."""
    u = lax.axis_size(ULYSSES)
    if x_H is None or u == 1:
        return x_H
    n = x_H.shape[0] // u
    return lax.dynamic_slice_in_dim(x_H, lax.axis_index(ULYSSES) * n, n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GivenQKV:
    """``dot_product_attention``'s projections: the given q, k, v (and sink logits), one chunk, no weights."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    sink_logits: jax.Array | None = None

    def sinks(self, i):
        return self.sink_logits

    def start(self):
        return None

    def q_parts(self, i, carry):
        return (self.q,), None

    def kv_parts(self, i):
        return self.k, self.v

    def output(self, i, o):
        return heads_to_seq(o, ULYSSES)

    def finish(self, y):
        return y


def check_metadata(name: str, value, batch: int, seq_len: int):
    """Integer array broadcasting to ``[B, S]`` (``[S]``, ``[1, S]``, ``[B, S]``) -> ``[B, S]`` int32 (``None`` passes)."""
    if value is None:
        return None
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={value.dtype} must be an integer dtype (e.g. int32).")
    if value.ndim > 2 or value.shape[-1:] != (seq_len,) or value.ndim == 2 and value.shape[0] not in (1, batch):
        raise ValueError(f"{name}.shape={value.shape} must be (seq_len,)=({seq_len},) or (batch, seq_len)="
                         f"({batch}, {seq_len}) (or anything that broadcasts to it, e.g. (1, {seq_len})).")
    return jnp.broadcast_to(value.astype(jnp.int32), (batch, seq_len))


def check_dtype(name: str, dtype) -> None:
    """Real floating point only: complex and integer inputs are refused, not silently mis-computed."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={dtype} is not supported: jax_cp attends over real floating-point inputs "
                         "(float32, bfloat16, float16, float64 with jax_enable_x64); cast first, e.g. x.astype(jnp.float32).")


def kernel_for_dtype(kernel, dtype, argument: str = "kernel"):
    """The kernel for inputs of ``dtype``: float64 (``jax_enable_x64``) runs blockwise or ``"xla"``,
    whose accumulators follow the inputs (``"auto"`` picks blockwise); the platform kernels compute in
    float32 and would round float64 silently, so naming one is refused (``argument``: the parameter
    that named it)."""
    if jnp.dtype(dtype) != jnp.float64 or kernel in (kernels.BLOCKWISE, kernels.DENSE, kernels.DENSE.name):
        return kernel
    if kernel == kernels.AUTO:
        return kernels.BLOCKWISE
    raise ValueError(f"{argument}={kernel!r} computes in float32, so float64 inputs (jax_enable_x64) would lose "
                     "precision silently; use kernel='blockwise', 'xla' or 'auto' (float64 computed in float64), "
                     "or cast the inputs to float32.")


def metadata_sides(positions, segment_ids, kv_positions, kv_segment_ids, batch: int, q_len: int, kv_len: int):
    """Checked ``[B, T]`` / ``[B, S]`` metadata ``(pos, seg, kv_seg, kv_pos)`` of the queries and the
    keys (``exchanges.Meta``'s fields). The keys' are ``None`` where they are the queries' own
    (self-attention); cross attention (``kv_len != q_len`` or key metadata given) states them:
    positions ``arange(kv_len)`` unless given, segment ids on both sides or neither."""
    pos = check_metadata("positions", positions, batch, q_len)
    seg = check_metadata("segment_ids", segment_ids, batch, q_len)
    kv_pos = check_metadata("kv_positions", kv_positions, batch, kv_len)
    kv_seg = check_metadata("kv_segment_ids", kv_segment_ids, batch, kv_len)
    if kv_seg is not None and seg is None:
        raise ValueError("kv_segment_ids is given but segment_ids is not: pass the queries' segment ids too "
                         "(segment_ids=, shape (batch, q_len)).")
    if kv_len != q_len and seg is not None and kv_seg is None:
        raise ValueError(f"segment_ids gives the queries' documents, but the keys are other tokens (cross "
                         f"attention: kv length {kv_len} != query length {q_len}); pass kv_segment_ids= of shape "
                         f"(batch, {kv_len}) too.")
    if kv_len != q_len and kv_pos is None:
        kv_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
    return pos, seg, kv_seg, kv_pos


def span_sides(span_ids, kv_span_ids, batch: int, q_len: int, kv_len: int):
    """Checked ``[B, T]`` / ``[B, S]`` span ids of the queries and the keys (``None`` for the keys:
    the queries' own). Cross attention states the keys' span ids when it gives the queries'."""
    span = check_metadata("span_ids", span_ids, batch, q_len)
    kv_span = check_metadata("kv_span_ids", kv_span_ids, batch, kv_len)
    if kv_span is not None and span is None:
        raise ValueError("kv_span_ids is given but span_ids is not: pass the queries' span ids too "
                         f"(span_ids=, shape (batch, {q_len})).")
    if span is not None and kv_span is None and kv_len != q_len:
        raise ValueError(f"span_ids gives the queries' spans, but the keys are other tokens (cross attention: kv "
                         f"length {kv_len} != query length {q_len}); pass kv_span_ids= of shape (batch, {kv_len}) too.")
    return span, kv_span


def placed_metadata(positions, segment_ids, batch: int, seq_len: int, mesh, kv_segment_ids=None,
                    kv_positions=None, spans: tuple = (None, None)):
    """Checked, placed ``[B, S]`` positions (``arange`` when None) and segment ids (if given), and
    the keys' own (``kv_segment_ids``, ``kv_positions``: ``metadata_sides``'), if given.

    ``spans``: the queries' and the keys' span ids (``span_ids``, ``kv_span_ids``; ``span_sides``).

    Returns ``(meta, specs)``: the placed ``Meta`` (``natural`` when nothing was given, so the splash
    kernel builds its masks when traced) and its shard_map in_specs.
    """
    positions = check_metadata("positions", positions, batch, seq_len)
    segment_ids = check_metadata("segment_ids", segment_ids, batch, seq_len)
    kv_len = seq_len if kv_positions is None else kv_positions.shape[1]
    span, kv_span = span_sides(*spans, batch, seq_len, kv_len)
    natural = positions is None and segment_ids is None and kv_segment_ids is None and kv_positions is None \
        and span is None
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    meta = jax.tree.map(lambda a: place(a, mesh, META_SPEC),
                        Meta(positions, segment_ids, kv_segment_ids, kv_positions, span, kv_span, natural=natural))
    # Opaque to constant folding: folded into the kernel's per-block bounds, the default arange
    # becomes a reduce over an iota that libtpu 0.0.52 aborts on while splitting it over a v5p
    # chip's two TensorCores (MegacoreTransformWindow check failure).
    meta = lax.optimization_barrier(meta)
    return meta, meta.specs(META_SPEC)


def _eager(args) -> bool:
    """No argument is traced by ``jit`` (concrete, or only under ``grad``/``vjp`` of concrete values)."""
    for x in jax.tree.leaves(args):
        while isinstance(x, jax.core.Tracer):
            x = getattr(x, "primal", None)  # JVP/linearize tracers carry their primal; jit/vmap ones do not
            if x is None:
                return False
    return True


_EAGER_PROGRAMS: dict = {}


def _eager_program(mapped, mesh, out_specs):
    """The jitted program of an eager call, its output shardings stated (``out_specs`` on ``mesh``),
    each output then put on its sharding once more.

    Under ``jax.grad`` the program's transpose states those shardings for the cotangents. Left
    unstated, jax 0.10 reads a cotangent's sharding against the mesh named in the cotangent's type,
    and that can be an earlier call's mesh: JAX's cache of eager ops keys an uncommitted array by its
    device, not by the mesh in its type, so the eager product in a loss (``jnp.sum(f(q) * ct)``)
    comes back typed with the mesh of the first call at those shapes (an ``IndivisibleError``).
    Stated, an eager ``jit`` refuses a cotangent committed to another sharding of the mesh (not
    resharding it), and the eager ops after the call commit theirs as they choose: a gather
    restoring the natural order, a loss's ``out ** 2`` (``P()``). The ``device_put`` after the
    program is a no-op forward; its transpose puts each cotangent on the output's sharding, the
    one the transposed program states.
    """
    is_spec = lambda x: isinstance(x, P)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=is_spec)
    program = jax.jit(mapped, out_shardings=shardings)
    return lambda *args: jax.device_put(program(*args), shardings)


def shard_call(fn, mesh, in_specs: tuple, out_specs, args: list):
    """``jax.shard_map(fn, ...)(*args)``. Called eagerly (outside ``jit``: a plain call, Linen's
    ``init``, ``jax.grad`` of concrete values) it runs as one jitted program, cached per layer
    and mesh, instead of primitive by primitive (a Linen ``init`` took 35 s that way, 1.7 s
    jitted); under ``jit`` it is inlined into the caller's program as before."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if not _eager(args):
        return mapped(*args)
    try:
        leaves, tree = jax.tree.flatten(in_specs, is_leaf=lambda x: isinstance(x, P))
        key = (fn.func, tuple(sorted(fn.keywords.items())), mesh, tuple(leaves), tree, out_specs)
        hash(key)
    except (AttributeError, TypeError):  # not a keyword partial of hashable settings: jit uncached
        return _eager_program(mapped, mesh, out_specs)(*args)
    if key not in _EAGER_PROGRAMS:
        _EAGER_PROGRAMS[key] = _eager_program(mapped, mesh, out_specs)
    return _EAGER_PROGRAMS[key](*args)
