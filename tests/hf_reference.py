"""A plain NumPy (float64) forward of Hugging Face's Llama, Qwen 3, Gemma 3 text and Mistral decoders.

Written from transformers' PyTorch modeling code (``modeling_llama.py``, ``modeling_qwen3.py``,
``modeling_gemma3.py``, ``modeling_mistral.py``, ``masking_utils.py``, ``modeling_rope_utils.py``, 4.57)
and read straight from a checkpoint's ``config.json`` and its tensors under their public names,
independently of ``models.hf`` and ``models.families``. Every tensor the forward reads is recorded in
``used``, so a test can check that the checkpoint holds nothing else. Letters: S sequence, D width,
H heads, K kv heads, d head dim.
"""
from __future__ import annotations

import math

import numpy as np

GEMMA3, QWEN3, MISTRAL = "Gemma3ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"


def llama3_inv_freq(theta: float, dim: int, s: dict) -> np.ndarray:
    """``_compute_llama3_parameters``: Llama 3.1's banded rescaling of the RoPE frequencies (float32)."""
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim))).astype(np.float32)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    llama = np.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * llama / s["factor"] + smooth * llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, llama).astype(np.float32)


def inv_freq(theta: float, dim: int, scaling: dict | None) -> np.ndarray:
    """The RoPE frequencies of ``rope_theta`` and ``rope_scaling`` (default, linear, llama3)."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return llama3_inv_freq(theta, dim, scaling)
    base = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return base / scaling["factor"] if kind == "linear" else base


class Reference:
    """The decoder of ``config`` (a ``config.json`` dict) over ``tensors`` (name -> array)."""

    def __init__(self, config: dict, tensors: dict):
        self.c, self.t, self.used = config, tensors, set()
        self.gemma = GEMMA3 in config["architectures"]
        self.qk_norm = self.gemma or QWEN3 in config["architectures"]
        self.eps = config["rms_norm_eps"]
        self.mistral = MISTRAL in config["architectures"]
        self.window = config.get("sliding_window", 4096 if self.mistral else None)  # MistralConfig's default

    def w(self, name: str) -> np.ndarray:
        self.used.add(name)
        return np.asarray(self.t[name], np.float64)

    def norm(self, x, name):
        w = self.w(name)
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return y * (1.0 + w) if self.gemma else y * w

    def rope(self, x_SHd, layer: int):
        c, d = self.c, x_SHd.shape[-1]
        sliding = self.is_sliding(layer)
        if self.gemma and sliding:
            freq = inv_freq(c["rope_local_base_freq"], d, None)
        else:
            freq = inv_freq(c["rope_theta"], d, c.get("rope_scaling"))
        ang = np.arange(x_SHd.shape[0])[:, None] * np.asarray(freq, np.float64)[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        rotated = np.concatenate([-x_SHd[..., d // 2:], x_SHd[..., : d // 2]], axis=-1)
        return x_SHd * cos + rotated * sin

    def is_sliding(self, layer: int) -> bool:
        if self.mistral:  # every layer, where sliding_window is set
            return self.window is not None
        types = self.c.get("layer_types")
        return bool(types) and types[layer] == "sliding_attention"

    def attention(self, x_SD, layer: int):
        c, p = self.c, f"model.layers.{layer}.self_attn."
        H, K = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or c["hidden_size"] // H
        S = x_SD.shape[0]
        q = (x_SD @ self.w(p + "q_proj.weight").T).reshape(S, H, d)
        k = (x_SD @ self.w(p + "k_proj.weight").T).reshape(S, K, d)
        v = (x_SD @ self.w(p + "v_proj.weight").T).reshape(S, K, d)
        if self.qk_norm:
            q, k = self.norm(q, p + "q_norm.weight"), self.norm(k, p + "k_norm.weight")
        q, k = self.rope(q, layer), self.rope(k, layer)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        scaling = c["query_pre_attn_scalar"] ** -0.5 if self.gemma else d ** -0.5
        s_HSS = np.einsum("qhd,khd->hqk", q, k) * scaling
        if c.get("attn_logit_softcapping"):
            cap = c["attn_logit_softcapping"]
            s_HSS = np.tanh(s_HSS / cap) * cap
        i, j = np.arange(S)[:, None], np.arange(S)[None, :]
        visible = j <= i
        if self.is_sliding(layer):
            visible &= i - j < self.window  # sliding_window_overlay: kv_idx > q_idx - sliding_window
        s_HSS = np.where(visible[None], s_HSS, -np.inf)
        p_HSS = np.exp(s_HSS - s_HSS.max(-1, keepdims=True))
        p_HSS /= p_HSS.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p_HSS, v).reshape(S, H * d)
        return o @ self.w(p + "o_proj.weight").T

    def mlp(self, x_SD, layer: int):
        p = f"model.layers.{layer}.mlp."
        g = x_SD @ self.w(p + "gate_proj.weight").T
        if self.gemma:  # gelu_pytorch_tanh
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        else:  # silu
            act = g / (1 + np.exp(-g))
        return (act * (x_SD @ self.w(p + "up_proj.weight").T)) @ self.w(p + "down_proj.weight").T

    def block(self, x, layer: int):
        p = f"model.layers.{layer}."
        if self.gemma:
            x = x + self.norm(self.attention(self.norm(x, p + "input_layernorm.weight"), layer),
                              p + "post_attention_layernorm.weight")
            return x + self.norm(self.mlp(self.norm(x, p + "pre_feedforward_layernorm.weight"), layer),
                                 p + "post_feedforward_layernorm.weight")
        x = x + self.attention(self.norm(x, p + "input_layernorm.weight"), layer)
        return x + self.mlp(self.norm(x, p + "post_attention_layernorm.weight"), layer)

    def __call__(self, tokens_S: np.ndarray) -> np.ndarray:
        """Logits ``[S, V]`` of one sequence at positions ``0..S-1``."""
        c = self.c
        x = self.w("model.embed_tokens.weight")[tokens_S]
        if self.gemma:
            x = x * np.float64(np.float32(c["hidden_size"] ** 0.5))
        for layer in range(c["num_hidden_layers"]):
            x = self.block(x, layer)
        x = self.norm(x, "model.norm.weight")
        tied = c.get("tie_word_embeddings", self.gemma)
        logits = x @ self.w("model.embed_tokens.weight" if tied else "lm_head.weight").T
        if c.get("final_logit_softcapping"):
            cap = c["final_logit_softcapping"]
            logits = np.tanh(logits / cap) * cap
        return logits
