"""``CPAttention``: the Flax NNX attention module whose collectives hide behind its matmuls."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_cp import _decode
from jax_cp._checks import refuse_dense
from jax_cp._defaults import AUTO, Choice
from jax_cp._layer import (AttentionSharding, gather_stored, init_param, kv_inputs, layer_forward, param_shapes,
                            storage_specs)
from jax_cp._mesh import place
from jax_cp._spec import AttentionSpec

__all__ = ["CPAttention"]


class CPAttention(nnx.Module):
    """Multi-head attention over a sequence sharded on ``mesh`` (arguments in ``nnx.MultiHeadAttention``'s order).

    Call on a global ``x [B, S, D]`` (sharded ``P("dp", ("cp_colossal", "cp_ulysses"), None)``,
    or any sharding: it is resharded); returns ``y [B, S, out_features]`` sharded the same way.
    ``model(x, inputs_kv)`` (or flax's ``inputs_k, inputs_v``) is cross attention to other tokens
    ``[B, S_kv, D]``, sharded along their sequence the same way. Parameters are created already
    sharded and carry ``out_sharding`` metadata, so ``nnx.get_partition_spec`` gives their layout.
    ``self.spec`` is the validated ``AttentionSpec``. Inference: ``init_cache((batch,
    max_length))``, then ``prefill=True`` on a prompt and ``decode=True`` (or ``decode=True``
    here / ``nnx.view(model, decode=True)``) on new tokens: a KV cache sharded along the sequence
    over the CP axes (``jax_cp._decode``).

    Args:
        num_heads: query heads.
        in_features: the model width ``D``.
        num_kv_heads, head_dim, v_head_dim: as :class:`AttentionSpec`.
        out_features: the output width (``None``: ``D``).
        mesh: the mesh (:func:`jax_cp.make_mesh`).
        is_causal, use_qk_norm, rope_theta, use_bias: causal mask, QK norm, RoPE base, biases.
        dtype, param_dtype, kernel_init, rngs: as flax's attention modules.
        overlap_chunks: ``n`` runs the layer in ``n`` head groups (projections, exchanges,
            attention, output projection) so chunk i's collectives run under chunk i±1's
            matmuls and attention.
        kernel: the local attention kernel.
        kv_exchange: the colossal K/V exchange (a ``jax_cp.exchanges`` value or its name,
            ``jax_cp.exchanges.NAMES``).
        fused_qkv_chunks: ``k`` sends Q, K and V of the first ``k`` head chunks over
            ``cp_ulysses`` in one all-to-all instead of two (Q; K and V): the same bytes in
            fewer collectives, which some TPU schedules hide better (the planner measures it;
            ``0`` none, ``overlap_chunks`` every chunk). ``overlap_chunks``, ``kernel``,
            ``kv_exchange`` and ``fused_qkv_chunks`` default to ``"auto"``: resolved when the
            layer is traced, from the mesh's chip and layout, by the measured rule in
            ``jax_cp._defaults`` (``resolved`` shows the choice and why); explicit values win.
        sharding: an ``AttentionSharding`` storing the parameters otherwise than the default
            (q/k/v kernels split over ``tp`` by heads, the output kernel by rows), e.g. FSDP
            over ``dp``.
        block_q, block_kv: the blockwise kernel's tiles (``None``: ``jax_cp.kernels.auto_blocks``).
        logits_soft_cap: ``c`` caps the scaled logits to ``c * tanh(logits / c)``.
        use_sinks: adds a ``sinks [num_heads]`` parameter (zeros, split over ``tp`` with the
            heads): a learned logit per query head joining its softmax denominator once
            (GPT-OSS attention sinks).
        record_max_logits: sows each call's per-head maximum logit (``[num_heads]`` float32,
            over the whole mesh; for QK-clip) as ``nnx.Intermediate`` ``max_logits`` (read it
            with ``nnx.pop(model, nnx.Intermediate)``).
        decode: run calls as decode steps on the KV cache.

    Raises:
        ValueError: an argument is invalid (see :class:`AttentionSpec`).
    """

    def __init__(self, num_heads: int, in_features: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, out_features: int | None = None, v_head_dim: int | None = None,
                 mesh, is_causal: bool = False,
                 use_qk_norm: bool = False,
                 rope_theta: float | None = None, use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), overlap_chunks: int | str = AUTO,
                 kernel: str = "auto", kv_exchange=AUTO, fused_qkv_chunks: int | str = AUTO,
                 sharding: AttentionSharding | None = None, block_q: int | None = None,
                 block_kv: int | None = None, logits_soft_cap: float | None = None, use_sinks: bool = False,
                 record_max_logits: bool = False, decode: bool = False, rngs: nnx.Rngs):
        self.spec = AttentionSpec(
            num_heads=num_heads, in_features=in_features, num_kv_heads=num_kv_heads, head_dim=head_dim,
            out_features=out_features, v_head_dim=v_head_dim, is_causal=is_causal, use_qk_norm=use_qk_norm, rope_theta=rope_theta, use_bias=use_bias,
            overlap_chunks=AUTO if overlap_chunks is None else overlap_chunks, kernel=kernel,
            kv_exchange=kv_exchange, fused_qkv_chunks=fused_qkv_chunks, block_q=block_q, block_kv=block_kv,
            logits_soft_cap=logits_soft_cap, use_sinks=use_sinks, record_max_logits=record_max_logits)
        self.mesh, self.dtype, self.decode = mesh, dtype, decode
        specs = storage_specs(self.spec, mesh, sharding)
        for name, shape in param_shapes(self.spec).items():
            value = place(init_param(name, shape, rngs.params(), param_dtype, kernel_init), mesh, specs[name])
            setattr(self, name, nnx.Param(value, out_sharding=tuple(specs[name]), eager_sharding=False))

    def resolved(self, batch: int, seq_len: int) -> tuple[AttentionSpec, Choice | None]:
        """The spec a call on ``[batch, seq_len, D]`` inputs runs ("auto" filled in) and the rule's reason."""
        itemsize = jnp.dtype(self.dtype or jnp.float32).itemsize
        return self.spec.resolve(self.mesh, batch=batch, seq_len=seq_len, itemsize=itemsize)

    def set_view(self, decode: bool | None = None, batch_size: int | None = None, max_length: int | None = None):
        """``nnx.view(model, decode=True[, batch_size=B, max_length=L])`` (flax's convention): a view in
        decode mode, its cache created by ``init_cache`` when it has none yet."""
        if decode is None:
            return
        self.decode = decode
        if decode and getattr(self, "cached_key", None) is None:
            if batch_size is None or max_length is None:
                raise ValueError(f"nnx.view(..., decode=True) on a layer with no cache needs batch_size= and "
                                 f"max_length= (got batch_size={batch_size}, max_length={max_length}), or call "
                                 "init_cache first.")
            self.init_cache((batch_size, max_length))

    def init_cache(self, input_shape, dtype=None):
        """Creates the KV cache for ``decode=True`` calls, already sharded (``jax_cp._decode``): ``input_shape``
        is ``(batch_size, max_length)`` or flax's ``(batch_size, max_length, in_features)``; ``dtype``
        defaults to the layer's (float32 when None). Variables (``nnx.Cache``): ``cached_key [B, L, Kc, d]``,
        ``cached_value``, ``cached_positions [B, L]``, ``cache_index [B]`` (each sequence's next position),
        ``cache_slots`` (slots written) and ``cache_window`` (the prefill's left window; -1: none), split
        over the CP axes along L and over tp by kv heads."""
        batch, max_length = tuple(input_shape)[:2]
        dtype = jnp.dtype(dtype or self.dtype or jnp.float32)
        specs = _decode.cache_layout(self.spec, self.mesh).specs()
        for name, value in _decode.init_cache(self.spec, self.mesh, batch, max_length, dtype).items():
            setattr(self, name, nnx.Cache(value, out_sharding=tuple(specs[name]), eager_sharding=False))

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, positions=None, segment_ids=None,
                 kv_positions=None, kv_segment_ids=None, local_window_size=None, decode: bool | None = None,
                 span_ids=None, kv_span_ids=None,
                 prefill: bool = False, lengths=None, mask=None, split_over_tp: bool = False):
        """Self-attention over ``inputs_q [B, S, D]``, or cross attention (flax's arguments): keys from
        ``inputs_k`` and values from ``inputs_v`` (``[B, S_kv, D]``; each defaults to the one before;
        ``inputs_kv`` gives one input for both), at ``kv_positions`` with ``kv_segment_ids``.

        Inference (after ``init_cache``): ``prefill=True`` runs a prompt ``[B, S, D]`` (sharded like
        training inputs, at ``positions``; ``lengths [B]``: real tokens per prompt, the rest padding)
        and writes its K/V into the cache; ``decode=True`` (or the module's ``decode``) attends
        ``T`` new tokens per sequence ``[B, T, D]`` to the cache at positions ``cache_index + t``.
        A packed prompt's ``segment_ids`` (negative: padding) mask the prompt as in training; decode
        then continues each row's last document (its largest segment id) with the prefill's window.
        Decoding is causal whatever ``is_causal`` (as flax's). ``mask`` (flax's dense mask) is refused
        with the data-driven arguments to use instead. ``span_ids`` (``[B, S]`` ints, 0: none; the
        keys' ``kv_span_ids`` for cross attention): a causal layer also lets a token see the later
        tokens of its own span (prefix-LM prompts, image tokens, video frames); prefill takes them,
        and the tokens decode generates are outside every span.

        ``split_over_tp=True`` (training, self-attention): ``inputs_q`` arrives split over ``tp`` along
        its features, ``P(dp, (cp_colossal, cp_ulysses), tp)`` (a residual stream kept split, as
        ``models.llama`` keeps it), is all-gathered inside the layer (its gradient a reduce-scatter),
        and the output comes back split the same way (a reduce-scatter instead of the all-reduce).
        """
        refuse_dense(mask=mask)
        _decode.refuse_split(split_over_tp, prefill, decode if decode is not None else self.decode)
        params = {name: getattr(self, name)[...] for name in param_shapes(self.spec)}
        stored = {n: getattr(self, n).get_metadata().get("out_sharding") for n in params}
        decode = self.decode if decode is None else decode
        if prefill or decode:
            params = gather_stored(params, stored, self.spec, self.mesh)
            _decode.check_inference(self.spec, kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv), prefill,
                                    kv_positions=kv_positions, kv_segment_ids=kv_segment_ids, segment_ids=segment_ids,
                                    span_ids=span_ids, kv_span_ids=kv_span_ids)
            cache = {name: getattr(self, name, None) for name in _decode.CACHE_FIELDS}
            y, cache = _decode.infer(params, inputs_q, {k: None if v is None else v[...] for k, v in cache.items()},
                                     mesh=self.mesh, spec=self.spec, dtype=self.dtype, prefill=prefill,
                                     positions=positions, lengths=lengths, local_window_size=local_window_size,
                                     segment_ids=segment_ids, span_ids=span_ids)
            for name, value in cache.items():
                getattr(self, name)[...] = value
            return y
        y = layer_forward(params, inputs_q, mesh=self.mesh, spec=self.spec, dtype=self.dtype, positions=positions,
                          segment_ids=segment_ids, local_window_size=local_window_size, split_over_tp=split_over_tp,
                          stored=stored,
                          kv_x=kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv), kv_positions=kv_positions,
                          kv_segment_ids=kv_segment_ids, span_ids=span_ids, kv_span_ids=kv_span_ids)
        if self.spec.record_max_logits:
            y, max_logits = y
            self.sow(nnx.Intermediate, "max_logits", max_logits)
        return y

