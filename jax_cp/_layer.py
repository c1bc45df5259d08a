"""One context-parallel attention layer as a pure function of its parameters.

Shared by the NNX and Linen modules: parameter shapes, their sharding
(``AttentionSharding``, the storage layout; computed in the tp layout) and
``layer_forward``, which runs ``_body.attention_shard`` with the layer's
``LinearProjections`` inside one ``jax.shard_map``.
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cp._body import attention_shard, check_dtype, placed_metadata, shard_call
from jax_cp._mesh import CP, DP, TP, mesh_dims, place
from jax_cp._projection import LinearProjections
from jax_cp._spec import AttentionSpec, Layout, check_seq_batch

__all__ = ["AttentionSharding", "init_param", "layer_forward", "param_shapes", "param_specs", "storage_specs"]

X_SPEC = P(DP, CP, None)
PARAMS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
          "sinks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSharding:
    """Where ``CPAttention`` stores each parameter: one ``PartitionSpec`` per parameter name.

    ``None`` fields take the compute layout (q/k/v kernels split over ``tp`` by
    heads, the output kernel by rows). Any storage layout works: each call puts
    the weights in the compute layout first (e.g. an FSDP all-gather over
    ``dp``). ``param_specs(spec, mesh)`` gives the compute layout to start from.
    """

    q_kernel: P | None = None
    k_kernel: P | None = None
    v_kernel: P | None = None
    o_kernel: P | None = None
    q_bias: P | None = None
    k_bias: P | None = None
    v_bias: P | None = None
    o_bias: P | None = None
    q_norm: P | None = None
    k_norm: P | None = None
    sinks: P | None = None

    def resolve(self, compute: dict[str, P]) -> dict[str, P]:
        """Storage specs of the parameters in ``compute`` (their compute specs)."""
        return {name: getattr(self, name) or spec for name, spec in compute.items()}


def _compute_specs(spec: AttentionSpec, layout: Layout) -> dict[str, P]:
    kv = P(None, TP, None) if layout.kv_sharded else P(None, None, None)
    specs = {"q_kernel": P(None, TP, None), "k_kernel": kv, "v_kernel": kv, "o_kernel": P(TP, None, None)}
    if spec.use_bias:
        kvb = P(TP, None) if layout.kv_sharded else P(None, None)
        specs |= {"q_bias": P(TP, None), "k_bias": kvb, "v_bias": kvb, "o_bias": P(None)}
    if spec.use_qk_norm:
        specs |= {"q_norm": P(None), "k_norm": P(None)}
    if spec.use_sinks:
        specs |= {"sinks": P(TP)}  # with the query heads
    return specs


def param_specs(spec: AttentionSpec, mesh) -> AttentionSharding:
    """The compute layout of the layer's parameters on ``mesh`` (the default storage layout)."""
    return AttentionSharding(**_compute_specs(spec, spec.layout(mesh_dims(mesh))))


def storage_specs(spec: AttentionSpec, mesh, sharding: AttentionSharding | None = None) -> dict[str, P]:
    """Each parameter's storage spec: ``sharding``'s where it sets one, else the compute layout."""
    return (sharding or AttentionSharding()).resolve(_compute_specs(spec, spec.layout(mesh_dims(mesh))))


def param_shapes(spec: AttentionSpec) -> dict[str, tuple[int, ...]]:
    D, H, K, d, E = spec.in_features, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.out_features
    dv = spec.v_head_dim
    shapes = {"q_kernel": (D, H, d), "k_kernel": (D, K, d), "v_kernel": (D, K, dv), "o_kernel": (H, dv, E)}
    if spec.use_bias:
        shapes |= {"q_bias": (H, d), "k_bias": (K, d), "v_bias": (K, dv), "o_bias": (E,)}
    if spec.use_qk_norm:
        shapes |= {"q_norm": (d,), "k_norm": (d,)}
    if spec.use_sinks:
        shapes |= {"sinks": (H,)}
    return shapes


def init_param(name: str, shape, key, dtype, kernel_init):
    """Kernels are initialised as 2-D ``[fan_in, fan_out]`` matrices, then reshaped; norms to ones,
    biases and sinks to zeros."""
    if name.endswith("_kernel"):
        fan_in = shape[0] if name != "o_kernel" else shape[0] * shape[1]
        flat = kernel_init(key, (fan_in, math.prod(shape) // fan_in), dtype)
        return flat.reshape(shape)
    if name.endswith("_norm"):
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


def _layer_shard(params, x_BSD, pos_BS, seg_BS=None, *, spec: AttentionSpec, layout: Layout, dtype):
    projections = LinearProjections(params, x_BSD, pos_BS, spec=spec, layout=layout, dtype=dtype)
    return attention_shard(projections, pos_BS, seg_BS, spec=spec)


def layer_forward(params: dict, x_BSD, *, mesh, spec: AttentionSpec, dtype=None, positions=None,
                  segment_ids=None, local_window_size=None, scale=None):
    """Applies the layer to a global ``x [B, S, D]``; returns ``y [B, S, out_features]`` sharded like x (and
    ``max_logits [H]`` with ``spec.record_max_logits``)."""
    if getattr(x_BSD, "ndim", None) != 3 or x_BSD.shape[-1] != spec.in_features:
        raise ValueError(f"x.shape={getattr(x_BSD, 'shape', None)} must be (batch, seq_len, "
                         f"in_features={spec.in_features}).")
    B, S, _ = x_BSD.shape
    check_dtype("x", x_BSD.dtype)
    dtype = jnp.dtype(x_BSD.dtype if dtype is None else dtype)
    check_dtype("dtype", dtype)
    spec, _ = spec.replace(local_window_size=local_window_size, scale=scale).resolve(
        mesh, batch=B, seq_len=S, itemsize=dtype.itemsize)
    layout = spec.layout(mesh_dims(mesh))
    check_seq_batch(B, S, layout.dims)
    meta, meta_specs = placed_metadata(positions, segment_ids, B, S, mesh)
    specs = _compute_specs(spec, layout)
    params = {k: place(params[k], mesh, specs[k]) for k in specs}
    args = [params, place(x_BSD, mesh, X_SPEC)] + meta
    in_specs = [specs, X_SPEC] + meta_specs
    fn = partial(_layer_shard, spec=spec, layout=layout, dtype=dtype)
    out_specs = (X_SPEC, P(TP)) if spec.record_max_logits else X_SPEC
    return shard_call(fn, mesh, tuple(in_specs), out_specs, args)
