"""A Qwen3-Next-style hybrid decoder: gated DeltaNet layers with a full-attention layer every few.

The Llama-style model of ``models.llama`` (embedding, pre-norm blocks with a SwiGLU MLP, float32
residual, sharded over ``tp`` and optionally FSDP) whose blocks mix tokens with
``jax_cp.linear.GatedDeltaNet`` except every ``full_attention_interval``-th, which keeps
``jax_cp.CPAttention``: three linear layers per softmax layer with the default interval of 4, as
Qwen3-Next. Both kinds run on the same sequence-sharded activations, positions and segment ids (so
the same load-balanced or dispatch-planned order), and both have a cache: prefill and decode run
through the model as through ``models.llama.Llama``. ``models.train --model hybrid-tiny`` trains it.
Letters: B batch, S sequence, D model width.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import jax_cp
from jax_cp import linear
from models import llama
from models.llama import DP, MLP, Block, Llama, LlamaConfig, RMSNorm, Sharding, _param

__all__ = ["CONFIGS", "Hybrid", "HybridConfig", "LinearBlock", "abstract_model", "get_config", "model_class"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig(LlamaConfig):
    """A ``LlamaConfig`` whose layers are gated DeltaNet but every ``full_attention_interval``-th (attention).

    The ``linear_*`` fields are the DeltaNet layers' shapes (Hugging Face ``Qwen3NextConfig``'s names);
    the attention fields (``num_heads``, ``num_kv_heads``, ``head_dim``, ...) the attention layers'.
    """

    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    linear_max_pieces: int | None = None  # GatedDeltaNetSpec.max_pieces; None: models.train sizes each batch
    # The dispatch plan's chunks per colossal rank (load_balance.plan's chunks_per_rank) under --balance dispatch:
    # each chunk continuing a document elsewhere is a state slot of every linear layer, so 4 (not the plan's 8)
    # halves their state bytes; the attention layers' balance stays within 1.02 (benchmarks/RESULTS.md).
    dispatch_chunks: int = 4

    def __post_init__(self):
        super().__post_init__()
        for name in ("full_attention_interval", "linear_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        self.linear  # noqa: B018  (validates the linear layers' shapes with the library's own messages)

    @property
    def linear(self) -> linear.GatedDeltaNetSpec:
        """One DeltaNet layer's shapes, as ``jax_cp.linear.GatedDeltaNet`` builds it."""
        return linear.GatedDeltaNetSpec(
            in_features=self.d_model, num_k_heads=self.linear_num_key_heads, head_k_dim=self.linear_key_head_dim,
            num_v_heads=self.linear_num_value_heads, head_v_dim=self.linear_value_head_dim,
            conv_width=self.linear_conv_kernel_dim, norm_eps=self.norm_eps, chunk_size=self.linear_chunk_size,
            max_pieces=self.linear_max_pieces)

    def is_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) is a full-attention layer: every ``full_attention_interval``-th."""
        return (layer + 1) % self.full_attention_interval == 0


CONFIGS = {
    # Byte-level vocabulary as llama's "tiny"; 4 layers: DeltaNet, DeltaNet, DeltaNet, attention.
    "hybrid-tiny": HybridConfig(vocab_size=320, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                                d_ff=192, rope_theta=10_000.0, use_qk_norm=True, tie_embeddings=True,
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                linear_value_head_dim=16, linear_chunk_size=16),
}


def get_config(name: str) -> LlamaConfig:
    """The configuration called ``name``: one of ``models.llama.CONFIGS`` or of this module's ``CONFIGS``."""
    if name in CONFIGS:
        return CONFIGS[name]
    if name not in llama.CONFIGS:
        raise ValueError(f"model={name!r} is unknown; choose one of {sorted(llama.CONFIGS)} (Llama) or "
                         f"{sorted(CONFIGS)} (hybrid).")
    return llama.CONFIGS[name]


def model_class(cfg: LlamaConfig) -> type[Llama]:
    """``Hybrid`` for a ``HybridConfig``, else ``models.llama.Llama``."""
    return Hybrid if isinstance(cfg, HybridConfig) else Llama


def linear_sharding(spec: linear.GatedDeltaNetSpec, mesh, sharding: Sharding) -> dict[str, P]:
    """Where each DeltaNet layer stores its weight matrices: the tp layout, plus the FSDP axes under FSDP."""
    shapes, compute = spec.param_shapes(), spec.param_specs()
    return {name: sharding.store(compute[name], shape, mesh) for name, shape in shapes.items() if len(shape) > 1}


class LinearBlock(Block):
    """``models.llama.Block`` whose token mixer (``attn``) is a ``jax_cp.linear.GatedDeltaNet``."""

    def __init__(self, cfg: HybridConfig, *, mesh, sharding: Sharding, dtype, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, mesh=mesh, sharding=sharding,
                                 offset=cfg.norm_offset)
        self.attn_norm = norm()
        self.dtype = dtype
        s = cfg.linear
        self.attn = linear.GatedDeltaNet(
            s.in_features, num_k_heads=s.num_k_heads, head_k_dim=s.head_k_dim, num_v_heads=s.num_v_heads,
            head_v_dim=s.head_v_dim, conv_width=s.conv_width, norm_eps=s.norm_eps, chunk_size=s.chunk_size,
            max_pieces=s.max_pieces, mesh=mesh, dtype=dtype, sharding=linear_sharding(s, mesh, sharding), rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, mesh=mesh, sharding=sharding, dtype=dtype, rngs=rngs)
        if cfg.post_norms:
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()


class Hybrid(Llama):
    """``models.llama.Llama`` with ``LinearBlock``s but every ``cfg.full_attention_interval``-th block.

    Called, trained, prefilled and decoded as ``Llama`` (same arguments): ``init_cache`` gives every
    attention layer its KV cache and every DeltaNet layer its recurrent state; ``kernel``,
    ``kv_exchange``, ``overlap_chunks`` and ``fused_qkv_chunks`` reach the attention layers.
    """

    def __init__(self, cfg: HybridConfig, *, mesh, dtype=jnp.bfloat16, fsdp: bool = False,
                 fsdp_axes: tuple[str, ...] = (DP,), remat: bool | str = False, kernel: str = "auto",
                 kv_exchange="auto", overlap_chunks: int | str = "auto", fused_qkv_chunks: int | str = "auto",
                 scan_layers: bool = False, residual_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.mesh, self.dtype, self.remat = cfg, mesh, jnp.dtype(dtype), llama.remat_policy(remat)
        self.scan_layers, self.residual_dtype = scan_layers, llama._residual_dtype(residual_dtype)
        self.sharding = sharding = llama.model_sharding(mesh, cfg.d_model, fsdp=fsdp, fsdp_axes=fsdp_axes)
        V, D = cfg.vocab_size, cfg.d_model
        self.embed = _param(mesh, sharding, nnx.initializers.normal(0.02)(rngs.params(), (V, D), jnp.float32),
                            P(llama.TP, None))
        attention = dict(kernel=kernel, kv_exchange=kv_exchange, overlap_chunks=overlap_chunks,
                         fused_qkv_chunks=fused_qkv_chunks)
        common = dict(mesh=mesh, sharding=sharding, dtype=self.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attention=attention, layer=i, **common) if cfg.is_attention(i)
                                else LinearBlock(cfg, **common) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(D, eps=cfg.norm_eps, mesh=mesh, sharding=sharding, offset=cfg.norm_offset)
        if not cfg.tie_embeddings:
            head = nnx.initializers.lecun_normal()(rngs.params(), (D, V), jnp.float32)
            self.head = _param(mesh, sharding, head, P(None, llama.TP))

    def use_kv_exchange(self, kv_exchange) -> None:
        """Every attention layer runs ``kv_exchange`` from now on (``Llama.use_kv_exchange``; the DeltaNet
        layers exchange no K/V)."""
        for block in self.blocks:
            if isinstance(block.attn, jax_cp.CPAttention):
                block.attn.spec = block.attn.spec.replace(kv_exchange=kv_exchange)

    def use_linear_pieces(self, pieces: int) -> None:
        """Every DeltaNet layer holds ``pieces`` state slots per CP rank from now on
        (``GatedDeltaNetSpec.max_pieces``). For a batch's own count (``models.train.linear_pieces``)
        inside a jitted step: call it on the model merged there, with ``pieces`` a static argument."""
        for block in self.blocks:
            if isinstance(block.attn, linear.GatedDeltaNet):
                block.attn.spec = dataclasses.replace(block.attn.spec, max_pieces=pieces)


def abstract_model(cfg: LlamaConfig | str, mesh=None, **kw) -> Llama:
    """``models.llama.abstract_model`` for any configuration here or in ``models.llama``: the model with
    ``jax.ShapeDtypeStruct`` leaves (shapes and shardings, nothing allocated)."""
    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    mesh = jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto) if mesh is None else mesh
    return nnx.eval_shape(lambda: model_class(cfg)(cfg, mesh=mesh, rngs=nnx.Rngs(0), **kw))
