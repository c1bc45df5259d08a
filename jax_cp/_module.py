"""``CPAttention``: the Flax NNX attention module whose collectives hide behind its matmuls."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_cp._checks import check_positive_int
from jax_cp._layer import LayerConfig, init_param, layer_forward, layout_for, param_shapes, param_specs
from jax_cp._mesh import mesh_dims, place

__all__ = ["CPAttention"]


def make_config(in_features, num_heads, num_kv_heads, head_dim, **kw) -> LayerConfig:
    check_positive_int("num_heads", num_heads)
    if head_dim is None:
        if in_features % num_heads:
            raise ValueError(f"in_features={in_features} is not divisible by num_heads={num_heads}; pass head_dim explicitly.")
        head_dim = in_features // num_heads
    overlap_chunks = kw.pop("overlap_chunks", None)
    return LayerConfig(in_features=in_features, num_heads=num_heads,
                       num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
                       head_dim=head_dim, overlap_chunks=1 if overlap_chunks is None else overlap_chunks, **kw)


class CPAttention(nnx.Module):
    """Multi-head attention over a sequence sharded on ``mesh``.

    Call on a global ``x [B, S, D]`` (sharded ``P("dp", ("cp_colossal", "cp_ulysses"), None)``,
    or any sharding: it is resharded); returns ``y [B, S, D]`` sharded the same way.
    Parameters are created already sharded (q/k/v kernels split over ``tp`` by
    heads, the output kernel by rows) and carry ``out_sharding`` metadata, so
    ``nnx.get_partition_spec`` gives their layout. ``overlap_chunks=n`` runs the
    layer in ``n`` head groups (projections, exchanges, attention, output
    projection) so chunk i's collectives run under chunk i±1's matmuls and
    attention. ``kernel`` picks the local attention kernel, ``kv_exchange`` the
    colossal K/V exchange: ``"all_gather"``, ``"all_to_all"`` (the same gather as
    an all-to-all, asynchronous on every TPU generation) or ``"ring"``.
    ``fused_qkv_chunks=k`` sends Q, K and V of the first ``k`` head chunks over
    ``cp_ulysses`` in one all-to-all instead of two (Q; K and V): the same bytes
    in fewer collectives, which some TPU schedules hide better (the planner
    measures it; ``0`` none, ``overlap_chunks`` every chunk).
    """

    def __init__(self, in_features: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, mesh, is_causal: bool = False, use_qk_norm: bool = False,
                 rope_theta: float | None = None, use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), overlap_chunks: int | None = None,
                 kernel: str = "auto", kv_exchange: str = "all_gather", fused_qkv_chunks: int = 0,
                 rngs: nnx.Rngs):
        dims = mesh_dims(mesh)
        self.config = make_config(in_features, num_heads, num_kv_heads, head_dim, is_causal=is_causal,
                                  use_qk_norm=use_qk_norm, rope_theta=rope_theta, use_bias=use_bias,
                                  overlap_chunks=overlap_chunks, kernel=kernel, kv_exchange=kv_exchange,
                                  fused_qkv_chunks=fused_qkv_chunks)
        self.mesh = mesh
        self.dtype = dtype
        specs = param_specs(self.config, layout_for(self.config, dims))
        for name, shape in param_shapes(self.config).items():
            value = place(init_param(name, shape, rngs.params(), param_dtype, kernel_init), mesh, specs[name])
            setattr(self, name, nnx.Param(value, out_sharding=tuple(specs[name]), eager_sharding=False))

    def __call__(self, x, *, positions=None, segment_ids=None, local_window_size=None):
        params = {name: getattr(self, name)[...] for name in param_shapes(self.config)}
        return layer_forward(params, x, mesh=self.mesh, cfg=self.config, dtype=self.dtype, positions=positions,
                             segment_ids=segment_ids, local_window_size=local_window_size)
