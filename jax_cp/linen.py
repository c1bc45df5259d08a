"""Linen twin of ``jax_cp.CPAttention`` (same arguments and semantics)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_cp._layer import init_param, layer_forward, layout_for, param_shapes, param_specs
from jax_cp._mesh import is_explicit, mesh_dims, place
from jax_cp._module import make_config

__all__ = ["CPAttention"]


class CPAttention(nn.Module):
    """Linen context-parallel attention; parameters boxed with ``nn.Partitioned`` names.

    ``nn.get_partition_spec(variables)`` gives their layout, e.g. for
    ``jax.jit(model.init, out_shardings=...)``.
    """

    in_features: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mesh: Any = None
    is_causal: bool = False
    use_qk_norm: bool = False
    rope_theta: float | None = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    overlap_chunks: int | None = None
    kernel: str = "auto"
    kv_exchange: str = "all_gather"
    fused_qkv_chunks: int = 0

    @nn.compact
    def __call__(self, x, *, positions=None, segment_ids=None, local_window_size=None):
        cfg = make_config(self.in_features, self.num_heads, self.num_kv_heads, self.head_dim,
                          is_causal=self.is_causal, use_qk_norm=self.use_qk_norm, rope_theta=self.rope_theta,
                          use_bias=self.use_bias, overlap_chunks=self.overlap_chunks, kernel=self.kernel,
                          kv_exchange=self.kv_exchange, fused_qkv_chunks=self.fused_qkv_chunks)
        specs = param_specs(cfg, layout_for(cfg, mesh_dims(self.mesh)))
        params = {}
        for name, shape in param_shapes(cfg).items():
            init = lambda key, shape, dtype, name=name: _born_placed(
                init_param(name, shape, key, dtype, self.kernel_init), self.mesh, specs[name])
            params[name] = self.param(name, nn.with_partitioning(init, tuple(specs[name])), shape, self.param_dtype)
        return layer_forward(params, x, mesh=self.mesh, cfg=cfg, dtype=self.dtype, positions=positions,
                             segment_ids=segment_ids, local_window_size=local_window_size)


def _born_placed(value, mesh, spec):
    """Places a fresh parameter as the NNX module does: under ``jax.set_mesh`` on an Explicit mesh,
    flax's ``nn.with_partitioning`` asserts the layout it names; with no mesh in context it checks
    nothing (and ``jax.jit(init, out_shardings=...)`` places), so the value stays as it is."""
    if is_explicit(mesh) and jax.sharding.get_abstract_mesh().empty:
        return value
    return place(value, mesh, spec)
