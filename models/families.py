"""The Hugging Face model families ``models.hf`` reads and writes: ``config.json`` <-> ``LlamaConfig``, and
each parameter's tensor name and layout.

Llama 3.x (``LlamaForCausalLM``, RoPE scaling ``llama3`` or ``linear``, tied embeddings), Qwen 3
(``Qwen3ForCausalLM``: QK-norm, a ``head_dim`` of its own), Gemma 3 text (``Gemma3ForCausalLM``:
``1 + w`` norms, a scaled embedding, post norms, GELU, sliding and global layers with their own RoPE) and
Mistral (``MistralForCausalLM``: Llama's tensors; ``sliding_window``, where set, in every layer).
A ``config.json`` value the model cannot honour raises a ``ValueError`` naming the key.
Letters: D model width, H query heads, K kv heads, d head dim, F MLP width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import math

import jax_cp
from models.llama import LlamaConfig

__all__ = ["FAMILIES", "Family", "Tensor", "config_from_hf", "config_to_hf", "family_of", "tensors"]

QK_NORM_EPS = 1e-6  # jax_cp's QK-norm epsilon (Qwen 3 and Gemma 3 use rms_norm_eps there)


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: its names in ``config.json`` and the defaults of the keys it may leave out."""

    name: str
    architecture: str
    model_type: str
    defaults: dict


FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", dict(
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False, hidden_act="silu")),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", dict(
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False, hidden_act="silu", head_dim=128)),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", dict(
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, rope_local_base_freq=10_000.0,
        sliding_window=4096, sliding_window_pattern=6)),
    Family("mistral", "MistralForCausalLM", "mistral", dict(  # sliding_window: 4096 if missing, none if null
        rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False, hidden_act="silu", sliding_window=4096)),
)}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def family_of(hf: dict) -> Family:
    """The family of a ``config.json`` (its ``architectures``, else its ``model_type``)."""
    archs = hf.get("architectures") or []
    for family in FAMILIES.values():
        if family.architecture in archs or (not archs and hf.get("model_type") == family.model_type):
            return family
    supported = sorted(f.architecture for f in FAMILIES.values())
    raise ValueError(f"architectures={archs} (model_type={hf.get('model_type')!r}) is not supported; "
                     f"models.hf reads {supported}.")


def _get(hf: dict, family: Family, key: str):
    if key in hf and hf[key] is not None:
        return hf[key]
    if key in family.defaults:
        return family.defaults[key]
    raise ValueError(f"config.json has no {key!r}, which a {family.architecture} needs.")


def _refuse(hf: dict, key: str, allowed, why: str) -> None:
    value = hf.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"config.json {key}={value!r} is not supported ({why}); supported: {list(allowed)}.")


def _rope(theta: float, scaling: dict | None, head_dim: int) -> float | jax_cp.RoPE:
    """``rope_theta`` and ``rope_scaling`` as the model's ``rope_theta``: a float, or a ``jax_cp.RoPE``."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta)
    if kind == "linear":
        return jax_cp.RoPE(theta=float(theta), factor=float(scaling["factor"]))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ValueError(f"config.json rope_scaling={scaling} lacks {missing} (rope_type 'llama3' needs {keys}).")
        return jax_cp.RoPE(theta=float(theta), factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    raise ValueError(f"config.json rope_scaling.rope_type={kind!r} is not supported; supported: "
                     "['default', 'linear', 'llama3'] (or rope_scaling null).")


def _rope_to_hf(rope: float | jax_cp.RoPE) -> tuple[float, dict | None]:
    """The model's ``rope_theta`` as ``config.json``'s ``rope_theta`` and ``rope_scaling``."""
    if not isinstance(rope, jax_cp.RoPE):
        return float(rope), None
    if not rope.llama3:
        return rope.theta, {"rope_type": "linear", "factor": rope.factor}
    return rope.theta, {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                        "high_freq_factor": rope.high_freq_factor,
                        "original_max_position_embeddings": rope.original_max_position_embeddings}


def _sliding_layers(hf: dict, family: Family, n: int) -> tuple[bool, ...] | None:
    """Which layers slide: ``layer_types`` where given, else the family's rule; ``None``: none slides."""
    types = hf.get("layer_types")
    if types is None and family.name == "gemma3":
        pattern = _get(hf, family, "sliding_window_pattern")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if family.name == "mistral":
        return _mistral_sliding(hf, types, n)
    if types is None and family.name == "qwen3" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        types = ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(n)]
    if types is None:
        return None
    bad = [t for t in types if t not in _LAYER_TYPES]
    if bad or len(types) != n:
        raise ValueError(f"config.json layer_types={types} must hold num_hidden_layers={n} entries among "
                         f"{list(_LAYER_TYPES)}.")
    if family.name == "qwen3" and not hf.get("use_sliding_window"):
        return None  # Qwen 3 slides only with use_sliding_window
    sliding = tuple(t == "sliding_attention" for t in types)
    return sliding if any(sliding) else None


def _mistral_window(hf: dict) -> int | None:
    """Mistral's ``sliding_window`` (missing: MistralConfig's 4096; null: none); a query sees ``W`` keys,
    ``p_q - p_k < W``, as transformers' ``sliding_window_overlay`` and ``LlamaConfig.sliding_window``."""
    w = hf.get("sliding_window", FAMILIES["mistral"].defaults["sliding_window"])
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"config.json sliding_window={w!r} is not supported; a MistralForCausalLM's is a positive "
                         "integer or null.")
    return w


def _mistral_sliding(hf: dict, types, n: int) -> None:
    """Mistral slides in every layer (``sliding_layers`` None); ``layer_types`` may only say the same."""
    window = _mistral_window(hf)
    same = ["full_attention" if window is None else "sliding_attention"] * n
    if types is not None and list(types) != same:
        raise ValueError(f"config.json layer_types={types} is not supported: MistralForCausalLM applies "
                         f"sliding_window={window} to every layer (layer_types {same}); alternating layers are "
                         "Ministral's.")
    return None


def _check_supported(hf: dict, family: Family) -> None:
    """Refuses the ``config.json`` values the model cannot honour, naming the key."""
    _refuse(hf, "attention_bias", (False,), "no attention biases")
    _refuse(hf, "mlp_bias", (False,), "no MLP biases")
    _refuse(hf, "partial_rotary_factor", (1.0,), "RoPE rotates the whole head")
    _refuse(hf, "use_bidirectional_attention", (False, None), "causal decoders only")
    if family.name == "mistral":
        _refuse(hf, "rope_scaling", (None,), "MistralConfig has no RoPE scaling")
    act_key = "hidden_activation" if family.name == "gemma3" else "hidden_act"
    if _get(hf, family, act_key) not in _ACTIVATIONS:
        raise ValueError(f"config.json {act_key}={_get(hf, family, act_key)!r} is not supported; supported: "
                         f"{sorted(_ACTIVATIONS)}.")
    eps = float(_get(hf, family, "rms_norm_eps"))
    if family.name in ("qwen3", "gemma3") and eps != QK_NORM_EPS:
        raise ValueError(f"config.json rms_norm_eps={eps} is also the QK-norm epsilon of a {family.architecture}, "
                         f"which jax_cp fixes at {QK_NORM_EPS}; use rms_norm_eps={QK_NORM_EPS}.")


def config_from_hf(hf: dict) -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face ``config.json`` (a dict).

    Raises:
        ValueError: the architecture or a key's value is not supported (the key is named).
    """
    family = family_of(hf)
    _check_supported(hf, family)
    D, H = int(_get(hf, family, "hidden_size")), int(_get(hf, family, "num_attention_heads"))
    n = int(_get(hf, family, "num_hidden_layers"))
    head_dim = int(hf.get("head_dim") or family.defaults.get("head_dim") or D // H)
    sliding = _sliding_layers(hf, family, n)
    common = dict(
        vocab_size=int(_get(hf, family, "vocab_size")), d_model=D, num_layers=n, num_heads=H,
        num_kv_heads=int(hf.get("num_key_value_heads") or H), head_dim=head_dim,
        d_ff=int(_get(hf, family, "intermediate_size")), norm_eps=float(_get(hf, family, "rms_norm_eps")),
        rope_theta=_rope(_get(hf, family, "rope_theta"), hf.get("rope_scaling"), head_dim),
        tie_embeddings=bool(_get(hf, family, "tie_word_embeddings")),
        sliding_window=None if sliding is None else int(_get(hf, family, "sliding_window")),
        sliding_layers=sliding)
    if family.name == "mistral":
        common["sliding_window"] = _mistral_window(hf)
    if family.name in ("llama", "mistral"):
        return LlamaConfig(**common)
    if family.name == "qwen3":
        return LlamaConfig(**common, use_qk_norm=True)
    return LlamaConfig(
        **common, use_qk_norm=True, norm_offset=1.0, embed_scale=math.sqrt(D), post_norms=True,
        mlp_activation=_ACTIVATIONS[_get(hf, family, "hidden_activation")],
        sliding_rope_theta=float(_get(hf, family, "rope_local_base_freq")),
        logits_soft_cap=hf.get("attn_logit_softcapping"), final_logits_soft_cap=hf.get("final_logit_softcapping"))


def config_to_hf(cfg: LlamaConfig, family: str | Family, base: dict | None = None) -> dict:
    """``cfg`` as a ``config.json`` dict of ``family``, over ``base`` (the loaded ``config.json``: its other
    keys, such as token ids, are kept); ``config_from_hf`` of the result gives ``cfg`` back."""
    family = FAMILIES[family] if isinstance(family, str) else family
    hf = dict(base or {}) | {"architectures": [family.architecture], "model_type": family.model_type}
    theta, scaling = _rope_to_hf(cfg.rope_theta)
    hf |= dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               intermediate_size=cfg.d_ff, rms_norm_eps=cfg.norm_eps, rope_theta=theta, rope_scaling=scaling,
               tie_word_embeddings=cfg.tie_embeddings)
    hf.pop("layer_types", None)
    if family.name == "mistral":  # every layer slides, or none; null written out (missing means 4096)
        hf["sliding_window"] = cfg.sliding_window
    elif cfg.sliding_window is not None:
        hf |= dict(sliding_window=cfg.sliding_window, layer_types=[
            "sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.num_layers)])
        if family.name == "qwen3":
            hf["use_sliding_window"] = True
    elif family.name == "qwen3":
        hf["use_sliding_window"] = False
    if family.name == "gemma3":
        hf |= dict(hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=cfg.logits_soft_cap,
                   final_logit_softcapping=cfg.final_logits_soft_cap, query_pre_attn_scalar=hf.get(
                       "query_pre_attn_scalar", cfg.head_dim),
                   rope_local_base_freq=float(cfg.sliding_rope_theta or theta))
    else:
        hf["hidden_act"] = "silu"
    check = config_from_hf(hf)
    if check != cfg:
        diff = {f.name: (getattr(cfg, f.name), getattr(check, f.name)) for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(check, f.name)}
        raise ValueError(f"the model's config cannot be written as a {family.architecture} config.json: "
                         f"{diff} (field: (model, as read back)); save it as a family that has these.")
    return hf


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter's tensor in the checkpoint: ``name``, and how the model's array derives from it.

    ``layout``: ``"same"``; ``"T"`` (a ``[out, in]`` matrix stored ``[in, out]``); ``"heads_out"``
    (q/k/v ``[N*d, D]`` -> ``[D, N, d]``); ``"heads_in"`` (o ``[D, H*d]`` -> ``[H, d, D]``).
    ``offset`` and ``scale``: the model holds ``(w + offset) * scale`` of the stored ``w``.
    """

    name: str
    layout: str = "same"
    heads: int = 0
    offset: float = 0.0
    scale: float = 1.0


def tensors(cfg: LlamaConfig, family: str | Family, hf: dict | None = None) -> dict[tuple, Tensor]:
    """Every model parameter's path (``nnx.to_pure_dict`` keys) -> its ``Tensor`` in a ``family`` checkpoint."""
    family = FAMILIES[family] if isinstance(family, str) else family
    H, K = cfg.num_heads, cfg.num_kv_heads
    out = {("embed",): Tensor("model.embed_tokens.weight"), ("final_norm", "scale"): Tensor("model.norm.weight")}
    if not cfg.tie_embeddings:
        out[("head",)] = Tensor("lm_head.weight", "T")
    gemma = family.name == "gemma3"
    qk_offset = 1.0 if gemma else 0.0
    q_scale = math.sqrt(cfg.head_dim / float((hf or {}).get("query_pre_attn_scalar", cfg.head_dim))) if gemma else 1.0
    norms = ({"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
              "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"} if gemma
             else {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"})
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {(i, n, "scale"): Tensor(p + hf_name + ".weight") for n, hf_name in norms.items()}
        out |= {(i, "attn", f"{x}_kernel"): Tensor(f"{p}self_attn.{x}_proj.weight", "heads_out", n)
                for x, n in (("q", H), ("k", K), ("v", K))}
        out[(i, "attn", "o_kernel")] = Tensor(p + "self_attn.o_proj.weight", "heads_in", H)
        if cfg.use_qk_norm:
            out[(i, "attn", "q_norm")] = Tensor(p + "self_attn.q_norm.weight", offset=qk_offset, scale=q_scale)
            out[(i, "attn", "k_norm")] = Tensor(p + "self_attn.k_norm.weight", offset=qk_offset)
        out |= {(i, "mlp", f"w_{x}"): Tensor(f"{p}mlp.{x}_proj.weight", "T") for x in ("gate", "up", "down")}
    return {(("blocks",) + k if isinstance(k[0], int) else k): v for k, v in out.items()}
