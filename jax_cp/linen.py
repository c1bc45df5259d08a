"""Linen twin of ``jax_cp.CPAttention`` (same arguments and semantics)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_cp import _decode
from jax_cp._checks import refuse_dense
from jax_cp._defaults import AUTO
from jax_cp._layer import (AttentionSharding, gather_stored, init_param, kv_inputs, layer_forward, param_shapes,
                            storage_specs)
from jax_cp._mesh import is_explicit, place
from jax_cp._spec import AttentionSpec

__all__ = ["CPAttention"]


class CPAttention(nn.Module):
    """Linen context-parallel attention; parameters boxed with ``nn.Partitioned`` names.

    ``nn.get_partition_spec(variables)`` gives their layout, e.g. for
    ``jax.jit(model.init, out_shardings=...)``. ``record_max_logits=True`` sows the per-head
    maximum logit into the ``"intermediates"`` collection as ``max_logits``
    (``model.apply(..., mutable=["intermediates"])``). Called as flax's attention: ``model(x)``
    self-attention, ``model(x, inputs_k, inputs_v)`` or ``model(x, inputs_kv=kv)`` cross attention.

    Inference, flax's convention: ``decode=True`` (attribute or call argument) with no ``"cache"``
    collection yet (``model.init(key, jnp.zeros((B, max_length, D)), decode=True)``) creates the KV
    cache for that batch and length; later calls with ``mutable=["cache"]`` take ``prefill=True`` (a
    prompt, ``lengths`` real tokens each) or ``decode=True`` (new tokens), as ``jax_cp.CPAttention``.

    Attributes:
        num_heads, in_features, num_kv_heads, head_dim, out_features, v_head_dim: as
            ``jax_cp.CPAttention``.
        mesh, is_causal, use_qk_norm, rope_theta, use_bias: as ``jax_cp.CPAttention``.
        dtype, param_dtype, kernel_init: as flax's attention modules.
        overlap_chunks, kernel, kv_exchange, fused_qkv_chunks, sharding: as
            ``jax_cp.CPAttention`` (``overlap_chunks=None`` means ``"auto"``).
        block_q, block_kv, logits_soft_cap, use_sinks: as ``jax_cp.CPAttention``.
        record_max_logits: sow the per-head maximum logit into ``"intermediates"`` (above).
        decode: run calls as decode steps on the KV cache (above).
    """

    num_heads: int
    in_features: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    v_head_dim: int | None = None
    mesh: Any = None
    is_causal: bool = False
    use_qk_norm: bool = False
    rope_theta: float | None = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    overlap_chunks: int | str | None = AUTO
    kernel: str = "auto"
    kv_exchange: Any = AUTO
    fused_qkv_chunks: int | str = AUTO
    sharding: AttentionSharding | None = None
    block_q: int | None = None
    block_kv: int | None = None
    logits_soft_cap: float | None = None
    use_sinks: bool = False
    record_max_logits: bool = False
    decode: bool = False

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads, in_features=self.in_features, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, out_features=self.out_features, v_head_dim=self.v_head_dim,
            is_causal=self.is_causal, use_qk_norm=self.use_qk_norm,
            rope_theta=self.rope_theta, use_bias=self.use_bias, kernel=self.kernel, kv_exchange=self.kv_exchange,
            overlap_chunks=AUTO if self.overlap_chunks is None else self.overlap_chunks,
            fused_qkv_chunks=self.fused_qkv_chunks, block_q=self.block_q, block_kv=self.block_kv,
            logits_soft_cap=self.logits_soft_cap, use_sinks=self.use_sinks,
            record_max_logits=self.record_max_logits)

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, positions=None, segment_ids=None,
                 kv_positions=None, kv_segment_ids=None, local_window_size=None, decode: bool | None = None,
                 span_ids=None, kv_span_ids=None,
                 prefill: bool = False, lengths=None, mask=None, split_over_tp: bool = False):
        refuse_dense(mask=mask)
        _decode.refuse_split(split_over_tp, prefill, self.decode if decode is None else decode)
        spec = self.spec
        specs = storage_specs(spec, self.mesh, self.sharding)
        params = {}
        for name, shape in param_shapes(spec).items():
            init = lambda key, shape, dtype, name=name: _born_placed(
                init_param(name, shape, key, dtype, self.kernel_init), self.mesh, specs[name])
            params[name] = self.param(name, nn.with_partitioning(init, tuple(specs[name])), shape, self.param_dtype)
        decode = self.decode if decode is None else decode
        if (prefill or decode) and self.has_variable("cache", "cached_key"):
            params = gather_stored(params, specs, spec, self.mesh)
            _decode.check_inference(spec, kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv), prefill,
                                    kv_positions=kv_positions, kv_segment_ids=kv_segment_ids, segment_ids=segment_ids,
                                    span_ids=span_ids, kv_span_ids=kv_span_ids)
            cache = {name: self.get_variable("cache", name) for name in _decode.CACHE_FIELDS}
            y, cache = _decode.infer(params, inputs_q, cache, mesh=self.mesh, spec=spec, dtype=self.dtype,
                                     prefill=prefill, positions=positions, lengths=lengths,
                                     local_window_size=local_window_size, segment_ids=segment_ids, span_ids=span_ids)
            for name, value in cache.items():
                self.put_variable("cache", name, value)
            return y
        if decode:  # the first decode call (init): a cache of the input's batch and length
            dtype = jnp.dtype(self.dtype or inputs_q.dtype)
            for name, value in _decode.init_cache(spec, self.mesh, *inputs_q.shape[:2], dtype).items():
                self.variable("cache", name, lambda value=value: value)
        y = layer_forward(params, inputs_q, mesh=self.mesh, spec=spec, dtype=self.dtype, positions=positions,
                          segment_ids=segment_ids, local_window_size=local_window_size, split_over_tp=split_over_tp,
                          stored=specs,
                          kv_x=kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv), kv_positions=kv_positions,
                          kv_segment_ids=kv_segment_ids, span_ids=span_ids, kv_span_ids=kv_span_ids)
        if spec.record_max_logits:
            y, max_logits = y
            self.sow("intermediates", "max_logits", max_logits)
        return y


def _born_placed(value, mesh, spec):
    """Places a fresh parameter as the NNX module does: under ``jax.set_mesh`` on an Explicit mesh,
    flax's ``nn.with_partitioning`` asserts the layout it names; with no mesh in context it checks
    nothing (and ``jax.jit(init, out_shardings=...)`` places), so the value stays as it is."""
    if is_explicit(mesh) and jax.sharding.get_abstract_mesh().empty:
        return value
    return place(value, mesh, spec)
