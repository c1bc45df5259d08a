"""Linen twin of ``jax_cp.linear.GatedDeltaNet`` (same arguments and semantics)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cp._mesh import gather, is_explicit, place
from jax_cp.linear._args import refuse_spans
from jax_cp.linear.module import CACHE_FIELDS, GatedDeltaNetSpec, empty_cache, gated_deltanet, infer, init_param

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    """Linen gated DeltaNet layer; parameters boxed with ``nn.Partitioned`` names.

    ``nn.get_partition_spec(variables)`` gives their layout. Inference, flax's convention:
    ``decode=True`` with no ``"cache"`` collection yet (``model.init(key, jnp.zeros((B, max_length, D)),
    decode=True)``) creates the cache for that batch; later calls with ``mutable=["cache"]`` take
    ``prefill=True`` (a prompt) or ``decode=True`` (new tokens), as ``jax_cp.linear.GatedDeltaNet``.

    Attributes:
        in_features, num_k_heads, head_k_dim, num_v_heads: as :class:`jax_cp.linear.GatedDeltaNetSpec`.
        head_v_dim, out_features, conv_width: as :class:`jax_cp.linear.GatedDeltaNetSpec`.
        norm_eps, chunk_size, max_pieces: as :class:`jax_cp.linear.GatedDeltaNetSpec`.
        mesh, dtype, param_dtype, kernel_init, sharding, decode: as ``jax_cp.linear.GatedDeltaNet``.
    """

    in_features: int
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int | None = None
    head_v_dim: int | None = None
    out_features: int | None = None
    conv_width: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    max_pieces: int | None = None
    mesh: Any = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    sharding: Mapping[str, P] | None = None
    decode: bool = False

    @property
    def spec(self) -> GatedDeltaNetSpec:
        return GatedDeltaNetSpec(in_features=self.in_features, num_k_heads=self.num_k_heads,
                                 head_k_dim=self.head_k_dim, num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim,
                                 out_features=self.out_features, conv_width=self.conv_width, norm_eps=self.norm_eps,
                                 chunk_size=self.chunk_size, max_pieces=self.max_pieces)

    @nn.compact
    def __call__(self, x_BSD, *, positions=None, segment_ids=None, prefill: bool = False, lengths=None,
                 decode: bool | None = None, span_ids=None):
        refuse_spans(span_ids)
        spec = self.spec
        spec.check_mesh(self.mesh)
        compute = spec.param_specs()
        stored = compute | dict(self.sharding or {})
        params = {}
        for name, shape in spec.param_shapes().items():
            init = lambda key, shape, dtype, name=name: _born_placed(  # noqa: E731
                init_param(name, shape, key, dtype, self.kernel_init), self.mesh, stored[name])
            value = self.param(name, nn.with_partitioning(init, tuple(stored[name])), shape, self.param_dtype)
            params[name] = gather(value, self.mesh, stored[name], compute[name])
        kw = dict(spec=spec, mesh=self.mesh, dtype=self.dtype)
        decode = self.decode if decode is None else decode
        if (prefill or decode) and self.has_variable("cache", "recurrent_state"):
            cache = {n: self.get_variable("cache", n) for n in CACHE_FIELDS}
            y, cache = infer(params, x_BSD, cache, prefill=prefill, positions=positions, segment_ids=segment_ids,
                             lengths=lengths, **kw)
            for name, value in cache.items():
                self.put_variable("cache", name, value)
            return y
        if decode:  # the first decode call (init): a cache of the input's batch
            dtype = jnp.dtype(self.dtype or x_BSD.dtype)
            for name, value in empty_cache(spec, self.mesh, x_BSD.shape[0], dtype).items():
                self.variable("cache", name, lambda value=value: value)
        return gated_deltanet(params, x_BSD, positions=positions, segment_ids=segment_ids, **kw)


def _born_placed(value, mesh, spec):
    """A fresh parameter placed as the NNX module places it (on an Explicit mesh with no mesh in
    context, ``jax.jit(init, out_shardings=...)`` places it instead)."""
    if is_explicit(mesh) and jax.sharding.get_abstract_mesh().empty:
        return value
    return place(value, mesh, spec)
