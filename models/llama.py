"""A Llama-style decoder in Flax NNX whose attention is ``jax_cp.CPAttention``.

Token embedding -> L x [RMSNorm -> causal GQA attention (RoPE from global
positions, optional QK-norm) -> residual -> RMSNorm -> SwiGLU MLP -> residual]
-> RMSNorm -> tied or untied vocabulary head. Optional, for public checkpoints
(``models.hf``): scaled RoPE (``jax_cp.RoPE``), a scaled embedding, ``1 + w`` norms,
post-attention and post-MLP norms, a GELU MLP, sliding-window layers with their
own RoPE, and a final logit soft cap (Gemma 3). Parameters are float32 and
sharded over ``tp`` (heads, MLP columns/rows, vocabulary), optionally FSDP over
``dp`` (and the CP axes: ``fsdp_axes``); the matmuls run in ``dtype`` (bfloat16 by default).
Letters: B batch, S sequence, D model width, F MLP width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec as P

import jax_cp

__all__ = [
    "CONFIGS", "FSDP_AXES", "Llama", "LlamaConfig", "Sharding", "abstract_model", "attention_sharding", "get_config",
    "fused_cross_entropy", "model_sharding", "next_token_loss", "param_count",
]

DP, TP = "dp", "tp"
CP = ("cp_colossal", "cp_ulysses")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shapes of one decoder; validated on creation."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float | jax_cp.RoPE = 500_000.0  # a jax_cp.RoPE: scaled frequencies (Llama 3.1, Gemma 3)
    use_qk_norm: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    logits_soft_cap: float | None = None  # attention logits -> c * tanh(logits / c) (Gemma 2)
    use_sinks: bool = False  # a learned sink logit per query head in every attention softmax (GPT-OSS)
    norm_offset: float = 0.0  # every RMSNorm scales by offset + w (Gemma: 1, its weights start at 0)
    embed_scale: float | None = None  # the embedding rows are multiplied by it (Gemma: sqrt(d_model))
    mlp_activation: str = "silu"  # of the gate: one of ACTIVATIONS ("gelu_tanh": Gemma)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before their residual adds (Gemma 2/3)
    sliding_window: int | None = None  # W: a sliding layer's query sees the keys with p_q - p_k < W
    sliding_layers: tuple[bool, ...] | None = None  # which layers slide (None: all, where sliding_window is set)
    sliding_rope_theta: float | jax_cp.RoPE | None = None  # the sliding layers' RoPE (None: rope_theta)
    final_logits_soft_cap: float | None = None  # vocabulary logits -> c * tanh(logits / c) (Gemma 2)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.mlp_activation not in ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} must be one of {sorted(ACTIVATIONS)}.")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer (or None).")
        if self.sliding_layers is not None:
            object.__setattr__(self, "sliding_layers", tuple(bool(b) for b in self.sliding_layers))
            if len(self.sliding_layers) != self.num_layers or self.sliding_window is None:
                raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for num_layers="
                                 f"{self.num_layers} with sliding_window={self.sliding_window}; give one per layer, "
                                 "and a sliding_window.")
        for i in range(self.num_layers if self.sliding_window is not None else 1):
            self.layer_attention(i)  # validates the attention shapes with the library's own messages

    @property
    def attention(self) -> jax_cp.AttentionSpec:
        """A global layer's attention as ``jax_cp.CPAttention`` builds it (causal, RoPE)."""
        return jax_cp.AttentionSpec(num_heads=self.num_heads, in_features=self.d_model,
                                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, is_causal=True,
                                    use_qk_norm=self.use_qk_norm, rope_theta=self.rope_theta,
                                    logits_soft_cap=self.logits_soft_cap, use_sinks=self.use_sinks)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) attends within ``sliding_window``."""
        return self.sliding_window is not None and (self.sliding_layers is None or self.sliding_layers[layer])

    def layer_attention(self, layer: int) -> jax_cp.AttentionSpec:
        """Layer ``layer``'s attention: a sliding layer has its window and ``sliding_rope_theta``."""
        if not self.is_sliding(layer):
            return self.attention
        theta = self.rope_theta if self.sliding_rope_theta is None else self.sliding_rope_theta
        return self.attention.replace(rope_theta=theta, local_window_size=(self.sliding_window - 1, 0))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


CONFIGS = {
    # Byte-level vocabulary (256 bytes + end-of-document, padded to a multiple of 64).
    "tiny": LlamaConfig(vocab_size=320, d_model=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                        d_ff=384, rope_theta=10_000.0, use_qk_norm=True, tie_embeddings=True),
    # Shapes only (for planning): never instantiated on the CPU; use abstract_model.
    "llama3-8b": LlamaConfig(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             head_dim=128, d_ff=14_336),
    "llama3-70b": LlamaConfig(vocab_size=128_256, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              head_dim=128, d_ff=28_672),
}


def get_config(name: str) -> LlamaConfig:
    if name not in CONFIGS:
        raise ValueError(f"model={name!r} is unknown; choose one of {sorted(CONFIGS)}.")
    return CONFIGS[name]


def param_count(cfg: LlamaConfig) -> int:
    """Number of parameters, from the shapes alone."""
    D, H, K, d = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = D * (H + 2 * K) * d + H * d * D + (2 * d if cfg.use_qk_norm else 0)
    block = attn + 3 * D * cfg.d_ff + (4 if cfg.post_norms else 2) * D
    head = 0 if cfg.tie_embeddings else D * cfg.vocab_size
    return cfg.vocab_size * D + cfg.num_layers * block + D + head


TP_CHUNKS = 2  # the MLP's tp all-gather and reduce-scatter run in this many token pieces each (not on CPU)
FSDP_AXES = (DP, *CP)  # the axes a parameter is replicated over in compute: FSDP may store it sharded there


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """Where parameters are stored and where activations live.

    ``fsdp=True`` additionally shards every weight matrix for storage over ``fsdp_axes``
    (``("dp",)`` by default; ``FSDP_AXES`` adds the CP axes; vectors stay whole): each weight enters
    the ``shard_map`` that uses it as stored and is all-gathered there to the ``tp``-only layout
    (:meth:`compute`; ``jax_cp.unshard``), so its gradient sum over those axes is a reduce-scatter.
    ``residual_BSD``: the residual stream between blocks, split over ``tp`` along D by
    ``model_sharding`` where tp divides it.
    """

    fsdp: bool = False
    fsdp_axes: tuple[str, ...] = (DP,)
    x_BSD: P = P(DP, CP, None)
    residual_BSD: P = P(DP, CP, None)  # the residual stream between blocks (what remat keeps of each)
    h_BSF: P = P(DP, CP, TP)
    logits_BSV: P = P(DP, CP, TP)
    tokens_BS: P = P(DP, CP)

    def __post_init__(self):
        axes = tuple(self.fsdp_axes)
        if not axes or not set(axes) <= set(FSDP_AXES) or len(set(axes)) != len(axes):
            raise ValueError(f"fsdp_axes={self.fsdp_axes!r} must be distinct names among {FSDP_AXES} (the axes "
                             "weights are replicated over); e.g. ('dp',) or ('dp', 'cp_colossal', 'cp_ulysses').")
        object.__setattr__(self, "fsdp_axes", axes)

    def store(self, spec: P, shape, mesh) -> P:
        """``spec`` (the tp layout), plus the FSDP axes (those of size > 1) on the largest free dimension
        their product divides, when FSDP (matrices only)."""
        sizes = dict(mesh.shape)
        axes = tuple(a for a in self.fsdp_axes if sizes[a] > 1)
        n = math.prod(sizes[a] for a in axes)
        if not self.fsdp or n == 1 or len(shape) < 2:  # vectors (norm scales) stay whole: small, used as stored
            return spec
        dims = list(spec) + [None] * (len(shape) - len(spec))
        free = [i for i, a in enumerate(dims) if a is None and shape[i] % n == 0]
        if not free:
            return spec
        dims[max(free, key=lambda i: shape[i])] = axes[0] if len(axes) == 1 else axes
        return P(*dims)

    def decoding(self) -> "Sharding":
        """The activations of a decode step (a few new tokens): replicated over the CP axes."""
        return dataclasses.replace(self, x_BSD=P(DP, None, None), residual_BSD=P(DP, None, None), h_BSF=P(DP, None, TP),
                                   logits_BSV=P(DP, None, TP), tokens_BS=P(DP, None))

    @staticmethod
    def compute(spec: P) -> P:
        """The layout a weight is used in: its storage layout without the FSDP axes."""
        fsdp = lambda a: a in FSDP_AXES or (isinstance(a, tuple) and set(a) <= set(FSDP_AXES))  # noqa: E731
        return P(*(None if fsdp(a) else a for a in spec))


def model_sharding(mesh, d_model: int, *, fsdp: bool, fsdp_axes: tuple[str, ...]) -> Sharding:
    """A model's ``Sharding``: the residual stream between blocks split over ``tp`` along D where tp divides
    it (each block's norms run on its slice, its inputs all-gathered in the compute dtype, the MLP's output
    reduce-scattered), so remat keeps 1/tp of each block's input."""
    t = dict(mesh.shape).get(TP, 1)
    residual = P(DP, CP, TP) if t > 1 and d_model % t == 0 else P(DP, CP, None)
    return Sharding(fsdp=fsdp, fsdp_axes=fsdp_axes, residual_BSD=residual)


def _platform(mesh) -> str | None:
    """The platform of ``mesh``'s devices (``None`` for an abstract mesh)."""
    devices = getattr(mesh, "devices", None)
    return None if devices is None else devices.flat[0].platform


def _param(mesh, sharding: Sharding, value, spec: P) -> nnx.Param:
    spec = sharding.store(spec, value.shape, mesh)
    return nnx.Param(jax_cp.place(value, mesh, spec), out_sharding=tuple(spec), eager_sharding=False)


def _stored(param: nnx.Param) -> P:
    return P(*param.get_metadata()["out_sharding"])


def _unsharded(param_block, param: nnx.Param, dtype):
    """Inside ``shard_map``: ``param``'s block in its compute layout and ``dtype`` (``jax_cp.unshard``: when FSDP
    stores it sharded, an all-gather whose gradient is one reduce-scatter of this device's partial sum)."""
    stored = _stored(param)
    return jax_cp.unshard(param_block, stored, Sharding.compute(stored), dtype)


def _shard_mapped(body, mesh, x, x_spec: P, params: tuple, out_spec: P):
    """``body(x_block, *param_blocks)`` in ``jax.shard_map``: ``x`` as ``x_spec`` and each parameter as stored."""
    specs = tuple(_stored(p) for p in params)
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, *specs), out_specs=out_spec)(
        jax_cp.place(x, mesh, x_spec), *(jax_cp.place(p[...], mesh, s) for p, s in zip(params, specs)))


def attention_sharding(spec: jax_cp.AttentionSpec, mesh, sharding: Sharding) -> jax_cp.AttentionSharding:
    """Where each layer's ``CPAttention`` stores its weights: the tp layout, plus ``dp`` under FSDP."""
    shapes, compute = jax_cp.param_shapes(spec), jax_cp.param_specs(spec, mesh)
    return jax_cp.AttentionSharding(**{
        name: sharding.store(getattr(compute, name), shape, mesh) if len(shape) > 1 else None
        for name, shape in shapes.items()})


def _lookup(embed: nnx.Param):
    """The embedding rows of a block of tokens, inside ``shard_map`` (float32): each tp rank looks up the
    tokens in its slice of the vocabulary, zeros elsewhere, summed over tp. FSDP stores the table split
    along D: the tokens of the FSDP group are all-gathered (ints), each device takes its columns of their
    rows, and one all-to-all returns every device its own tokens' rows, so the table is never gathered
    (at tp = 1 a float32 [V, D]) and its gradient stays in its stored layout."""

    def rows_of(table, tokens):
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(TP) * rows
        inside = (local >= 0) & (local < rows)
        return jnp.where(inside[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0.0)

    def lookup(tokens, block):
        return jax.lax.psum(rows_of(_unsharded(block, embed, jnp.float32), tokens), TP)

    axes = _axes_of(_stored(embed), 1)
    if not axes:
        return lookup

    def lookup_d_sharded(tokens, block):
        # FSDP stores the table split along D over `axes`: rather than gathering the whole table, every
        # device of the group looks up the group's tokens in its own columns, and one all-to-all hands each
        # device its tokens' rows. The gradient is this device's columns' scatter-add: no reduce-scatter.
        group = jax.lax.all_gather(tokens, axes)  # [n, B', S'] every device's tokens, in the group's order
        cols = jax.lax.psum(rows_of(block, group), TP)  # [n, B', S', D/n]
        cols = jax.lax.all_to_all(cols, axes, 0, 0)  # [n, B', S', D/n]: my tokens, column block i from device i
        return jnp.moveaxis(cols, 0, -2).reshape(*tokens.shape, -1)

    return lookup_d_sharded


class RMSNorm(nnx.Module):
    """``jax_cp.rms_norm`` scaled by ``offset + scale`` (``offset`` 1 and ``scale`` starting at 0: Gemma's)."""

    def __init__(self, dim: int, *, eps: float, mesh, sharding: Sharding, offset: float = 0.0):
        self.eps, self.offset = eps, offset
        self.scale = _param(mesh, sharding, jnp.full((dim,), 1.0 - offset, jnp.float32), P(None))

    def __call__(self, x):
        scale = self.scale[...]
        return jax_cp.rms_norm(x, scale + self.offset if self.offset else scale, self.eps)


class MLP(nnx.Module):
    """SwiGLU: ``(silu(x @ W_gate) * (x @ W_up)) @ W_down``, F split over tp."""

    def __init__(self, cfg: LlamaConfig, *, mesh, sharding: Sharding, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        D, F = cfg.d_model, cfg.d_ff
        self.mesh, self.sharding, self.dtype, self.activation = mesh, sharding, dtype, cfg.mlp_activation
        self.w_gate = _param(mesh, sharding, init(rngs.params(), (D, F), jnp.float32), P(None, TP))
        self.w_up = _param(mesh, sharding, init(rngs.params(), (D, F), jnp.float32), P(None, TP))
        self.w_down = _param(mesh, sharding, init(rngs.params(), (F, D), jnp.float32), P(TP, None))

    def __call__(self, x_BSD, sharding: Sharding | None = None):
        """In one ``shard_map``: the weights gathered there (FSDP: their gradients reduce-scattered), F split
        over tp, the output summed over tp (reduce-scattered along D where the residual stream is split)."""
        sh, dt, params = sharding or self.sharding, self.dtype, (self.w_gate, self.w_up, self.w_down)
        scatter = sh.residual_BSD[2] == TP
        on_cpu = _platform(self.mesh) == "cpu"

        def mlp(x, w_gate, w_up, w_down):  # x: the normed input, split like the residual stream
            w_gate, w_up, w_down = (_unsharded(b, p, dt) for b, p in zip((w_gate, w_up, w_down), params))

            def tokens(x):
                x = jax.lax.all_gather(x, TP, axis=2, tiled=True) if scatter else x  # transpose: a reduce-scatter
                h = ACTIVATIONS[self.activation](jnp.einsum("bsd,df->bsf", x, w_gate)) * jnp.einsum(
                    "bsd,df->bsf", x, w_up)
                y = jnp.einsum("bsf,fd->bsd", h, w_down)
                return jax.lax.psum_scatter(y, TP, scatter_dimension=2, tiled=True) if scatter else jax.lax.psum(y, TP)

            # Over tp, the tokens in TP_CHUNKS pieces: one piece's all-gather runs under another's matmuls,
            # and its reduce-scatter under the next's (forward and backward alike). Not on CPU, whose
            # collectives are copies: pieces only add ops there.
            n = TP_CHUNKS if scatter and x.shape[1] % TP_CHUNKS == 0 and not on_cpu else 1
            return tokens(x) if n == 1 else jnp.concatenate([tokens(c) for c in jnp.split(x, n, axis=1)], axis=1)

        return _shard_mapped(mlp, self.mesh, x_BSD.astype(dt), sh.residual_BSD, params, sh.residual_BSD)


class Block(nnx.Module):
    """Pre-norm attention and MLP with residuals; layer ``layer``'s window and RoPE (``cfg.layer_attention``)."""

    window = None  # (left, 0): a sliding layer's window, given to its attention at each call
    attn_post_norm = mlp_post_norm = None  # RMSNorms of the attention and MLP outputs (cfg.post_norms)

    def __init__(self, cfg: LlamaConfig, *, mesh, sharding: Sharding, dtype, attention: dict, rngs: nnx.Rngs,
                 layer: int = 0):
        norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, mesh=mesh, sharding=sharding,
                                 offset=cfg.norm_offset)
        self.attn_norm = norm()
        self.dtype = dtype
        spec = cfg.layer_attention(layer)
        if spec.local_window_size is not None:
            self.window = spec.local_window_size
        self.attn = jax_cp.CPAttention(
            spec.num_heads, spec.in_features, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, mesh=mesh,
            is_causal=spec.is_causal, use_qk_norm=spec.use_qk_norm, rope_theta=spec.rope_theta, dtype=dtype,
            logits_soft_cap=spec.logits_soft_cap, use_sinks=spec.use_sinks,
            sharding=attention_sharding(spec, mesh, sharding), rngs=rngs, **attention,
        )
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, mesh=mesh, sharding=sharding, dtype=dtype, rngs=rngs)
        if cfg.post_norms:
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, infer: dict | None = None, sharding=None,
                 span_ids_BS=None):
        """``infer``: the attention's ``prefill``/``decode``/``lengths`` (inference), else training;
        ``span_ids_BS``: bidirectional spans (a prefix-LM prompt), or None."""
        spans = {} if span_ids_BS is None else {"span_ids": span_ids_BS}
        if self.window is not None:
            spans["local_window_size"] = self.window
        # The mixers and the MLP compute in the model's dtype: cast before their inputs are gathered over tp.
        if infer is None and sharding is not None and sharding.residual_BSD[2] == TP \
                and isinstance(self.attn, jax_cp.CPAttention):
            spans["split_over_tp"] = True  # the input arrives split like the residual stream, the output leaves so
        a = self.attn(self.attn_norm(x_BSD).astype(self.dtype), positions=positions_BS, segment_ids=segment_ids_BS,
                      **spans, **(infer or {}))
        a = a if self.attn_post_norm is None else self.attn_post_norm(a)
        x_BSD = x_BSD + a.astype(x_BSD.dtype)
        m = self.mlp(self.mlp_norm(x_BSD), sharding)
        m = m if self.mlp_post_norm is None else self.mlp_post_norm(m)
        return x_BSD + m.astype(x_BSD.dtype)


class Llama(nnx.Module):
    """Decoder over a sequence sharded on ``mesh``; returns float32 logits ``[B, S, V]``.

    ``positions`` are the global positions of the tokens in the order given
    (after load-balance reordering, or restarting at each packed document);
    ``segment_ids`` keep packed documents apart. The residual stream is float32.
    ``kernel``, ``kv_exchange``, ``overlap_chunks`` and ``fused_qkv_chunks`` go to
    every layer's ``jax_cp.CPAttention`` (``jax_cp.plan`` compares them for a pod).

    Inference: ``init_cache(batch_size, max_length)``, then ``model(prompt, prefill=True, lengths=...)``
    (sequence-sharded like training, each layer writing its KV cache; a packed prompt's
    ``segment_ids``/``positions`` as in training, decode continuing each row's last document) and
    ``model(tokens [B, T], decode=True)`` for the next tokens (replicated over the CP axes);
    ``models.generate`` samples.
    """

    def __init__(self, cfg: LlamaConfig, *, mesh, dtype=jnp.bfloat16, fsdp: bool = False,
                 fsdp_axes: tuple[str, ...] = (DP,), remat: bool | str = False, kernel: str = "auto",
                 kv_exchange="auto", overlap_chunks: int | str = "auto", fused_qkv_chunks: int | str = "auto",
                 scan_layers: bool = False, residual_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.mesh, self.dtype, self.remat = cfg, mesh, jnp.dtype(dtype), remat_policy(remat)
        self.scan_layers, self.residual_dtype = scan_layers, _residual_dtype(residual_dtype)
        self.sharding = sharding = model_sharding(mesh, cfg.d_model, fsdp=fsdp, fsdp_axes=fsdp_axes)
        V, D = cfg.vocab_size, cfg.d_model
        embed = nnx.initializers.normal(0.02)(rngs.params(), (V, D), jnp.float32)
        self.embed = _param(mesh, sharding, embed, P(TP, None))
        self.blocks = nnx.List([
            Block(cfg, mesh=mesh, sharding=sharding, dtype=self.dtype, rngs=rngs, layer=i, attention=dict(
                kernel=kernel, kv_exchange=kv_exchange, overlap_chunks=overlap_chunks,
                fused_qkv_chunks=fused_qkv_chunks))
            for i in range(cfg.num_layers)
        ])
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, mesh=mesh, sharding=sharding, offset=cfg.norm_offset)
        if not cfg.tie_embeddings:
            head = nnx.initializers.lecun_normal()(rngs.params(), (D, V), jnp.float32)
            self.head = _param(mesh, sharding, head, P(None, TP))

    def use_kv_exchange(self, kv_exchange) -> None:
        """Every layer's ``CPAttention`` runs ``kv_exchange`` (a ``jax_cp.exchanges`` value or name) from now on.

        For a batch's own exchange (``Dispatch.kv_exchange``) inside a jitted step: call it on the
        model merged there, with the exchange a static argument of the step (one program a value).
        """
        for block in self.blocks:
            block.attn.spec = block.attn.spec.replace(kv_exchange=kv_exchange)

    def init_cache(self, batch_size: int, max_length: int, dtype=None):
        """Every layer's KV cache (``jax_cp.CPAttention.init_cache``; ``dtype`` defaults to the model's)."""
        for block in self.blocks:
            block.attn.init_cache((batch_size, max_length), dtype or self.dtype)

    def __call__(self, tokens_BS, *, positions=None, segment_ids=None, prefill: bool = False, decode: bool = False,
                 lengths=None, span_ids=None):
        h_BSD = self.features(tokens_BS, positions=positions, segment_ids=segment_ids, prefill=prefill,
                              decode=decode, lengths=lengths, span_ids=span_ids)
        sh = self.sharding.decoding() if decode and not prefill else self.sharding
        tied = self.cfg.tie_embeddings

        def head(h, w):  # the vocabulary split over tp; FSDP: the weight gathered here
            w = _unsharded(w, self.head_weight, self.dtype)
            return jnp.einsum("bsd,vd->bsv" if tied else "bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)

        logits = _shard_mapped(head, self.mesh, h_BSD, sh.x_BSD, (self.head_weight,), sh.logits_BSV)
        if self.cfg.final_logits_soft_cap is not None:
            cap = jnp.float32(self.cfg.final_logits_soft_cap)
            logits = cap * jnp.tanh(logits / cap)
        return jax_cp.place(logits, self.mesh, sh.logits_BSV)

    @property
    def head_weight(self) -> nnx.Param:
        """The vocabulary head's weight: ``head [D, V]``, or ``embed [V, D]`` when tied."""
        return self.embed if self.cfg.tie_embeddings else self.head

    def token_nll(self, h_BSD, labels_BS, weights_BS) -> jax.Array:
        """``sum(weights * -log p(labels))`` over the batch from the final features (``features``), without
        ``[B, S, V]`` logits: ``fused_cross_entropy`` per chunk of tokens, recomputed in the backward (per
        chunk of vocabulary columns, each gathered in turn, where FSDP stores the head split along D)."""
        sh, cfg = self.sharding, self.cfg

        stored = _stored(self.head_weight)
        d_axes = _axes_of(stored, 1 if cfg.tie_embeddings else 0)  # FSDP along D: gather the vocabulary by chunks

        def nll(h, labels, weights, w):
            w = w if d_axes else _unsharded(w, self.head_weight, self.dtype)  # d_axes: this device's D rows
            w_DV = w.T if cfg.tie_embeddings else w
            local = fused_cross_entropy(h, w_DV, labels, weights, cap=cfg.final_logits_soft_cap, gather_axes=d_axes)
            return jax.lax.psum(local, (DP, *CP))

        specs = (sh.x_BSD, sh.tokens_BS, sh.tokens_BS, stored)
        args = (h_BSD, labels_BS.astype(jnp.int32), weights_BS.astype(jnp.float32), self.head_weight[...])
        return jax.shard_map(nll, mesh=self.mesh, in_specs=specs, out_specs=P())(
            *(jax_cp.place(a, self.mesh, spec) for a, spec in zip(args, specs)))

    def features(self, tokens_BS, *, positions=None, segment_ids=None, prefill: bool = False, decode: bool = False,
                 lengths=None, span_ids=None):
        """The final norm's output ``[B, S, D]`` in the model's dtype (what the vocabulary head reads)."""
        m = self.mesh
        sh = self.sharding.decoding() if decode and not prefill else self.sharding
        infer = dict(prefill=True, lengths=lengths) if prefill else dict(decode=True) if decode else None
        x_BSD = _shard_mapped(_lookup(self.embed), m, tokens_BS, sh.tokens_BS, (self.embed,), sh.x_BSD)
        if self.cfg.embed_scale is not None:
            x_BSD = x_BSD * jnp.float32(self.cfg.embed_scale)
        x_BSD = jax_cp.place(x_BSD.astype(self.residual_dtype), m, sh.residual_BSD)
        if infer is None and m is not None:
            # Every layer reads whole rows of the mask metadata: gathered once here, not by every
            # rematerialised layer of the backward.
            positions, segment_ids, span_ids = jax_cp.place_metadata(m, positions, segment_ids, span_ids)

        def apply(block, x, pos, seg, span):
            x = checkpoint_name(x, BLOCK_INPUT)  # what remat="offload" keeps in host memory
            return jax_cp.place(block(x, pos, seg, infer, sh, span), m, sh.residual_BSD)

        if self.scan_layers and infer is None:
            x_BSD = self._scanned(apply, x_BSD, positions, segment_ids, span_ids)
        else:
            if self.remat and infer is None:
                apply = nnx.remat(apply, policy=_POLICIES[self.remat])
            for block in self.blocks:
                x_BSD = apply(block, x_BSD, positions, segment_ids, span_ids)
        return self.final_norm(x_BSD).astype(self.dtype)

    def _scanned(self, apply, x_BSD, positions, segment_ids, span_ids):
        """The blocks of a training step as one ``lax.scan`` over groups of ``period`` blocks (``layer_period``:
        1 for Llama, the attention interval for a hybrid, 6 for Gemma 3's 5:1; layers after the last whole
        group run after it): each group position's parameters stacked along a new leading axis for the step
        (the parameter tree keeps one entry per layer), so the compiler schedules one group's buffers and
        collectives, and compiles one body. ``apply(block, x, positions, segment_ids, span_ids)``: one block."""
        blocks = list(self.blocks)
        splits = [nnx.split(block) for block in blocks]
        period = layer_period([graph for graph, _ in splits])
        groups = len(blocks) // period  # the layers after the last whole group run one by one after the scan
        stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in splits[j:groups * period:period]])
                   for j in range(period)]

        def one(j, state, x):
            return apply(nnx.merge(splits[j][0], state), x, positions, segment_ids, span_ids)

        steps = [functools.partial(one, j) for j in range(period)]
        if self.remat:
            steps = [jax.checkpoint(step, policy=_POLICIES[self.remat]) for step in steps]

        def body(x, group):
            for step, state in zip(steps, group):
                x = step(state, x)
            return x, None

        x_BSD, _ = jax.lax.scan(body, x_BSD, stacked)
        for i in range(groups * period, len(blocks)):
            x_BSD = steps[i % period](splits[i][1], x_BSD)
        return x_BSD


REMAT = ("full", "attention", "offload")  # what a rematerialised block keeps beside its input (remat_policy)
BLOCK_INPUT = "block_input"  # each block's input, by name: remat="offload" keeps it in host memory
_POLICIES = {"full": None, "attention": jax_cp.save_attention_residuals,
             "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
                 names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
                 offload_src="device", offload_dst="pinned_host")}


def remat_policy(remat) -> str | None:
    """``None`` (no remat) or the name of what a block keeps for a model's ``remat``: ``False``; ``True`` or
    ``"full"`` (every block recomputed in the backward pass from its input); ``"attention"`` (the same,
    keeping also its attention kernel's output and log-sum-exp, ``jax_cp.save_attention_residuals``: the
    backward pass does not rerun the attention); ``"offload"`` (as ``"full"``, with each block's input
    kept in the host's memory, ``pinned_host``, instead of the device's: the longest contexts, where those
    inputs, ``L x B x S/c x D`` a device, are what fills it; they travel to the host in the forward pass and
    back in the backward)."""
    if remat is False or remat is None:
        return None
    name = "full" if remat is True else remat
    if name not in REMAT:
        raise ValueError(f"remat={remat!r} must be False, True, 'full', 'attention' or 'offload' ('attention' "
                         "keeps each block's attention output and log-sum-exp so the backward pass does not rerun "
                         "the kernel; 'full' recomputes the whole block; 'offload' recomputes it and keeps its "
                         "input in host memory).")
    return name


def _residual_dtype(dtype) -> jnp.dtype:
    """``float32`` or ``bfloat16``: the residual stream's dtype; a ValueError for any other."""
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"residual_dtype={d.name} must be float32 or bfloat16 (bfloat16: half the memory "
                         "remat keeps a layer, MaxText's choice; float32: the default).")
    return d


def layer_period(graphs: list) -> int:
    """The shortest ``p`` with every layer built as layer ``i % p`` (same graph: structure and static
    attributes, e.g. a sliding window), so groups of ``p`` stacked blocks scan as one (Gemma 3 1B: 26
    layers of period 6, four groups and two layers after them)."""
    n = len(graphs)
    return next(p for p in range(1, n + 1) if all(graphs[i] == graphs[i % p] for i in range(n)))


def next_token_loss(model: Llama, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Mean cross entropy over the tokens with ``weights`` 1, and that token count.

    ``batch`` holds ``[B, S]`` arrays ``tokens``, ``labels``, ``positions``,
    ``segment_ids`` and ``weights`` (0 where the label belongs to another document), and ``span_ids``
    for a prefix-LM objective (``data.prefix_lm``). The vocabulary head and the cross entropy run fused,
    a chunk of tokens at a time (``Llama.token_nll``): no ``[B, S, V]`` logits are kept.
    """
    h_BSD = model.features(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                           span_ids=batch.get("span_ids"))
    w = batch["weights"].astype(jnp.float32)
    count = jnp.sum(w)
    return model.token_nll(h_BSD, batch["labels"], w) / jnp.maximum(count, 1.0), count


LOSS_CHUNK_BYTES = 128 * 2**20  # fused_cross_entropy: the float32 logits of one chunk of tokens, at most


def fused_cross_entropy(h_BSD, w_DV, labels_BS, weights_BS, *, cap: float | None = None,
                        chunk_bytes: int = LOSS_CHUNK_BYTES, gather_axes: tuple[str, ...] = ()) -> jax.Array:
    """Inside ``shard_map``, the vocabulary split over ``tp``: this device's ``sum(weights * -log p(labels))``.

    ``h_BSD`` (this device's tokens, whole over tp) times ``w_DV`` (its tp rank's vocabulary columns) gives
    float32 logits a chunk of tokens at a time (at most ``chunk_bytes`` of them; soft-capped by ``cap``);
    the log-normaliser and the label's logit are summed over tp. The backward recomputes each chunk's
    logits (softmax minus the label's one-hot), so neither pass keeps ``[B, S, V/tp]`` logits: one
    chunk's at a time. The gradients: ``h``'s summed over tp, ``w``'s this device's partial sum over its
    tokens, summed over the axes ``w`` does not vary over (as a replicated weight's would be).

    ``gather_axes``: ``w_DV`` is this device's block of rows (D split over these FSDP axes). The vocabulary
    is then taken a chunk of columns at a time, each chunk all-gathered in ``h``'s dtype while the previous
    one multiplies (and, backward, its float32 gradient reduce-scattered while the next one does), so
    neither the whole weight nor its float32 gradient is ever held.
    """
    B, S, _ = h_BSD.shape
    V = w_DV.shape[1]
    if gather_axes:
        k = _loss_chunks(1, V, B * S, chunk_bytes)  # vocabulary chunks: [B*S, V/k] float32 logits at most
        groups = _loss_chunks(1, B * S, h_BSD.shape[-1], 2 * chunk_bytes)  # the backward's float32 dh: [B*S/groups, D]
        return _gathered_ce(_varying(h_BSD), _varying(w_DV), labels_BS, weights_BS, tuple(gather_axes), cap, k,
                            groups)
    n = _loss_chunks(B, S, V, chunk_bytes)
    # Both typed varying over every axis first: their gradients' sums over the axes they do not vary over are
    # then the transposes of these casts, outside the custom VJP, as every other weight's in the model.
    return _fused_ce(_varying(h_BSD), _varying(w_DV), labels_BS, weights_BS, cap, n)


def _varying(a):
    missing = tuple(ax for ax in jax.sharding.get_abstract_mesh().axis_names if ax not in jax_cp.vma(a))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _loss_chunks(B: int, S: int, V: int, chunk_bytes: int) -> int:
    n = 1
    while B * (S // n) * V * 4 > chunk_bytes and S % (2 * n) == 0:
        n *= 2
    return n


def _ce_logits(h, w, cap):
    logits = jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _ce_chunks(a, n):  # [B, S, ...] -> [n, B, S/n, ...]
    return jnp.moveaxis(a.reshape(a.shape[0], n, a.shape[1] // n, *a.shape[2:]), 1, 0)


def _ce_local_labels(labels, V):
    """The labels as columns of this tp rank's ``V`` vocabulary columns (outside ``[0, V)``: another rank's)."""
    return labels - jax.lax.axis_index(TP) * V


def _ce_label_logit(logits, at):
    """``logits[..., at]`` where the label's column ``at`` is among the chunk's ``[0, V)``, else 0."""
    V = logits.shape[-1]
    got = jnp.take_along_axis(logits, jnp.clip(at, 0, V - 1)[..., None], axis=-1)[..., 0]
    return jnp.where((at >= 0) & (at < V), got, 0.0)


def _ce_dlogits(logits, lse, at, scale, cap, dtype):
    """The loss's gradient with respect to a chunk of logits, in ``dtype``: ``(softmax - one_hot(at)) * scale``
    (``one_hot`` is zero where the label's column ``at`` lies outside the chunk), through the soft cap."""
    d = (jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(at, logits.shape[-1], dtype=logits.dtype)) * scale
    return (d if cap is None else d * (1.0 - (logits / cap) ** 2)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ce(h, w, labels, weights, cap, n):
    return _fused_ce_fwd(h, w, labels, weights, cap, n)[0]


def _fused_ce_fwd(h, w, labels, weights, cap, n):
    V = w.shape[1]

    def chunk(_, xs):
        h_c, labels_c, weights_c = xs
        logits = _ce_logits(h_c, w, cap)
        m = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1)), TP)
        lse = m + jnp.log(jax.lax.psum(jnp.exp(logits - m[..., None]).sum(-1), TP))
        picked = jax.lax.psum(_ce_label_logit(logits, _ce_local_labels(labels_c, V)), TP)
        return None, (jnp.sum((lse - picked) * weights_c), lse)

    _, (totals, lse) = jax.lax.scan(chunk, None, (_ce_chunks(h, n), _ce_chunks(labels, n), _ce_chunks(weights, n)))
    return totals.sum(), (h, w, labels, weights, lse)


def _fused_ce_bwd(cap, n, res, g):
    h, w, labels, weights, lse = res
    V = w.shape[1]

    def chunk(dw, xs):
        h_c, labels_c, weights_c, lse_c = xs
        logits = _ce_logits(h_c, w, cap)
        d = _ce_dlogits(logits, lse_c, _ce_local_labels(labels_c, V), (g * weights_c)[..., None], cap, h.dtype)
        dh = jnp.einsum("bsv,dv->bsd", d, w, preferred_element_type=jnp.float32).astype(h.dtype)  # stacked: h's
        return dw + jnp.einsum("bsd,bsv->dv", h_c, d, preferred_element_type=jnp.float32), dh

    # The carry's type is the chunk's dw's: varying over every axis (tokens over dp and CP, vocabulary over tp).
    xs = (_ce_chunks(h, n), _ce_chunks(labels, n), _ce_chunks(weights, n), lse)
    dw, dh = jax.lax.scan(chunk, _varying(jnp.zeros(w.shape, jnp.float32)), xs)
    dh = jnp.moveaxis(dh, 0, 1).reshape(h.shape)
    return dh, dw.astype(w.dtype), None, None  # both vary over every axis, as h and w do (fused_cross_entropy)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def _axes_of(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes ``spec`` splits dimension ``dim`` over (``()``: none)."""
    a = spec[dim] if len(spec) > dim else None
    return () if a is None else (a,) if isinstance(a, str) else tuple(a)


def _gather_cols(w_DnVc, axes, dtype):
    return jax.lax.all_gather(w_DnVc.astype(dtype), axes, axis=0, tiled=True)  # [D, Vc]


def _vocab_blocks(w, k):  # [D/n, V] -> [k, D/n, V/k], and the next chunk's at each step (the first again last)
    blocks = jnp.moveaxis(w.reshape(w.shape[0], k, w.shape[1] // k), 1, 0)
    return blocks, jnp.roll(blocks, -1, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _gathered_ce(h, w, labels, weights, axes, cap, k, groups):
    return _gathered_ce_fwd(h, w, labels, weights, axes, cap, k, groups)[0]


def _gathered_ce_fwd(h, w, labels, weights, axes, cap, k, groups):
    D, V = h.shape[-1], w.shape[1]
    Vc = V // k
    h_TD = h.reshape(-1, D)
    local = _ce_local_labels(labels.reshape(-1), V)
    blocks, after = _vocab_blocks(w, k)

    def chunk(carry, xs):
        m, s, picked, cur = carry
        i, nxt = xs
        nxt = _gather_cols(nxt, axes, h.dtype)  # in flight while this chunk multiplies
        logits = _ce_logits(h_TD[None], cur, cap)[0]  # [T, Vc]
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        return (m_new, s, picked + _ce_label_logit(logits, local - i * Vc), nxt), None

    T = h_TD.shape[0]
    zero = jnp.zeros((T,), jnp.float32)
    init = (jnp.full((T,), -jnp.inf, jnp.float32), zero, zero, _gather_cols(blocks[0], axes, h.dtype))
    init = tuple(_varying(a) for a in init)
    (m, s, picked, _), _ = jax.lax.scan(chunk, init, (jnp.arange(k), after))
    top = jax.lax.pmax(m, TP)
    lse = top + jnp.log(jax.lax.psum(s * jnp.exp(m - top), TP))
    picked = jax.lax.psum(picked, TP)
    return jnp.sum((lse - picked) * weights.reshape(-1)), (h, w, labels, weights, lse)


def _gathered_ce_bwd(axes, cap, k, groups, res, g):
    h, w, labels, weights, lse = res
    D, V = h.shape[-1], w.shape[1]
    Vc = V // k
    blocks, after = _vocab_blocks(w, k)

    def group(dw, xs):  # the tokens a group at a time: dh's float32 sum holds one group's rows
        h_TD, labels_T, weights_T, lse_T = xs
        local, scale = _ce_local_labels(labels_T, V), (g * weights_T)[:, None]

        def chunk(carry, xs):  # one vocabulary chunk
            dh, cur, pending = carry
            i, nxt = xs
            nxt = _gather_cols(nxt, axes, h.dtype)
            done = jax.lax.psum_scatter(pending, axes, scatter_dimension=0, tiled=True)  # the previous chunk's dW
            logits = _ce_logits(h_TD[None], cur, cap)[0]
            d = _ce_dlogits(logits, lse_T, local - i * Vc, scale, cap, h.dtype)
            dh = dh + jnp.einsum("tv,dv->td", d, cur, preferred_element_type=jnp.float32)
            return (dh, nxt, jnp.einsum("td,tv->dv", h_TD, d, preferred_element_type=jnp.float32)), done

        init = (jnp.zeros(h_TD.shape, jnp.float32), _gather_cols(blocks[0], axes, h.dtype),
                jnp.zeros((D, Vc), jnp.float32))
        (dh, _, last), done = jax.lax.scan(chunk, tuple(_varying(a) for a in init), (jnp.arange(k), after))
        dw_g = jnp.concatenate([done[1:], jax.lax.psum_scatter(last, axes, scatter_dimension=0, tiled=True)[None]])
        return dw + jnp.moveaxis(dw_g, 0, 1).reshape(w.shape), dh.astype(h.dtype)

    split = lambda a: a.reshape(groups, -1, *a.shape[1:])  # noqa: E731  [T, ...] -> [groups, T/groups, ...]
    xs = (split(h.reshape(-1, D)), split(labels.reshape(-1)), split(weights.reshape(-1)), split(lse))
    dw, dh = jax.lax.scan(group, _varying(jnp.zeros(w.shape, jnp.float32)), xs)
    return dh.reshape(h.shape), dw.astype(w.dtype), None, None


_gathered_ce.defvjp(_gathered_ce_fwd, _gathered_ce_bwd)


def abstract_model(cfg: LlamaConfig | str, mesh=None, **kw) -> Llama:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and shardings without allocating.

    ``nnx.state(abstract_model("llama3-70b", mesh))`` gives every parameter's
    shape and sharding on ``mesh`` (default: one device), e.g. for the planner.
    """
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    mesh = jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto) if mesh is None else mesh
    return nnx.eval_shape(lambda: Llama(cfg, mesh=mesh, rngs=nnx.Rngs(0), **kw))
