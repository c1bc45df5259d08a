"""The programs the planner compiles: forward+backward of one attention layer.

``cp_layer`` is ``jax_cp.CPAttention`` (separate q/k/v projections, each
followed by its own all-to-all). ``naive_layer`` is the baseline: one fused QKV
projection, then the collectives, same kernel and same backward mirror.
Both return ``(fn, args)``: ``fn(params, x)`` gives the gradients of a scalar
loss w.r.t. parameters and input, ``args`` are abstract, sharded arguments.
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_cp._checks import check_positive_fields
from jax_cp._mesh import CP, DP, TP, ULYSSES, mesh_dims
from jax_cp._spec import AttentionSpec
from jax_cp._defaults import AUTO, Choice

__all__ = ["LayerShape", "cp_layer", "naive_layer"]

X_SPEC = P(DP, CP, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One attention layer and its input: sizes, dtypes, and the ``CPAttention`` knobs (``.attention``).

    Attributes:
        batch, seq_len: the input's size.
        d_model, num_heads, num_kv_heads, head_dim: the layer's sizes.
        dtype, param_dtype: activations' and parameters' dtypes.
        is_causal, rope_theta: the mask and the RoPE base.
        kernel: the local attention kernel.
        kv_exchange: a ``jax_cp.exchanges`` name (a value is stored as its name) or ``"auto"``.
        overlap_chunks, fused_qkv_chunks: as ``jax_cp.CPAttention``.
    """

    batch: int
    seq_len: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    is_causal: bool = True
    rope_theta: float | None = 500_000.0
    kernel: str = "auto"
    kv_exchange: str = AUTO  # a jax_cp.exchanges name (a value is stored as its name) or "auto"
    overlap_chunks: int | str = AUTO
    fused_qkv_chunks: int | str = AUTO

    def __post_init__(self):
        check_positive_fields(self, ("batch", "seq_len", "d_model"))
        object.__setattr__(self, "kv_exchange", str(self.attention.kv_exchange))  # validates the layer once
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                raise ValueError(f"{name}={getattr(self, name)!r} is not a dtype name (e.g. 'bfloat16').") from None

    def resolved(self, mesh) -> tuple["LayerShape", Choice | None]:
        """The shape with every ``"auto"`` knob as ``CPAttention`` resolves it on ``mesh``, and why."""
        spec, why = self.attention.resolve(mesh, batch=self.batch, seq_len=self.seq_len,
                                           itemsize=jnp.dtype(self.dtype).itemsize)
        return dataclasses.replace(self, kv_exchange=spec.kv_exchange.name, overlap_chunks=spec.overlap_chunks,
                                   fused_qkv_chunks=spec.fused_qkv_chunks), why

    @property
    def attention(self) -> AttentionSpec:
        """The layer as ``CPAttention`` sees it (validated)."""
        return AttentionSpec(
            num_heads=self.num_heads, in_features=self.d_model, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, is_causal=self.is_causal, rope_theta=self.rope_theta, kernel=self.kernel,
            kv_exchange=self.kv_exchange, overlap_chunks=self.overlap_chunks,
            fused_qkv_chunks=self.fused_qkv_chunks)


def _sds(shape, dtype, mesh, spec):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def _x_sds(shape: LayerShape, mesh):
    return _sds((shape.batch, shape.seq_len, shape.d_model), shape.dtype, mesh, X_SPEC)


def _loss_grad(apply):
    """``(params, x) -> (dparams, dx)`` of a scalar loss of the layer's output."""
    def loss(params, x):
        return jnp.mean(jnp.square(apply(params, x).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1))


def cp_layer(shape: LayerShape, mesh):
    """Forward+backward of one ``jax_cp.CPAttention`` on ``mesh``.

    Args:
        shape: the :class:`LayerShape`.
        mesh: the mesh.

    Returns:
        ``(fn, args)``: the loss-and-gradient function and its ``jax.ShapeDtypeStruct``
        arguments ``(params, x)``, for :func:`analyze_program`.
    """
    from flax import nnx

    from jax_cp import CPAttention

    a = shape.attention

    def make():
        return CPAttention(
            a.num_heads, a.in_features, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, mesh=mesh,
            is_causal=a.is_causal, rope_theta=a.rope_theta, dtype=jnp.dtype(shape.dtype),
            param_dtype=jnp.dtype(shape.param_dtype), overlap_chunks=a.overlap_chunks, kernel=a.kernel,
            kv_exchange=a.kv_exchange, fused_qkv_chunks=a.fused_qkv_chunks, rngs=nnx.Rngs(0),
        )

    graphdef, state = nnx.split(nnx.eval_shape(make))
    specs = nnx.get_partition_spec(state)
    params = jax.tree.map(
        lambda a, s: _sds(a.shape, a.dtype, mesh, s if isinstance(s, P) else P()), state, specs,
        is_leaf=lambda a: isinstance(a, jax.ShapeDtypeStruct),
    )

    def apply(params, x):
        return nnx.merge(graphdef, params)(x)

    return _loss_grad(apply), (params, _x_sds(shape, mesh))


def naive_layer(shape: LayerShape, mesh):
    """The baseline: ``x @ [Wq|Wk|Wv]`` in one matmul, then every collective after it.

    Args:
        shape: the :class:`LayerShape`.
        mesh: the mesh.

    Returns:
        ``(fn, args)`` as :func:`cp_layer`.
    """
    from jax_cp._body import placed_metadata
    from jax_cp._ulysses import heads_to_seq, seq_to_heads

    shape, _ = shape.resolved(mesh)  # the exchange CPAttention would use
    dims = mesh_dims(mesh)
    spec = shape.attention
    layout = spec.replace(overlap_chunks=1, fused_qkv_chunks=0).layout(dims)
    H, d, D, t = shape.num_heads, shape.head_dim, shape.d_model, dims.t
    hq, hk = H // t, layout.kv_expanded // t  # per tp rank; kv heads repeated minimally, as CPAttention does
    dt = jnp.dtype(shape.dtype)

    def shard(w_qkv, w_o, x_BSD, meta):
        B, s, _ = x_BSD.shape
        y = jnp.einsum("bsd,dte->bse", x_BSD.astype(dt), w_qkv.astype(dt))
        q, k, v = jnp.split(y, [hq * d, (hq + hk) * d], axis=-1)
        q, k, v = (seq_to_heads((a.reshape(B, s, -1, d),), ULYSSES)[0] for a in (q, k, v))
        o = spec.kv_exchange.attend(q, k, v, meta, spec)
        o = heads_to_seq(o, ULYSSES).reshape(B, s, hq * d)
        return lax.psum(jnp.einsum("bse,ted->bsd", o, w_o.astype(dt)), TP)

    w_specs = (P(None, TP, None), P(TP, None, None))
    S, B = shape.seq_len, shape.batch

    def apply(params, x):
        meta, meta_specs = placed_metadata(None, None, B, S, mesh)  # default positions, placed as the library does
        fn = jax.shard_map(shard, mesh=mesh, in_specs=(*w_specs, X_SPEC, meta_specs), out_specs=X_SPEC)
        return fn(params["qkv_kernel"], params["o_kernel"], x, meta)

    params = {
        "qkv_kernel": _sds((D, t, (hq + 2 * hk) * d), shape.param_dtype, mesh, w_specs[0]),
        "o_kernel": _sds((t, hq * d, D), shape.param_dtype, mesh, w_specs[1]),
    }
    return _loss_grad(apply), (params, _x_sds(shape, mesh))

