"""Qwen 3 and Gemma 3 checkpoints written from another public JAX implementation: Google's Tunix.

Tunix (``google-tunix``; Flax NNX, ``tunix.models.qwen3`` and ``tunix.models.gemma3``) builds a tiny random
model; this file writes its parameters as a Hugging Face checkpoint (``config.json`` and
``model.safetensors`` under the PyTorch names, ``[out, in]`` matrices), Tunix's own safetensors reader must
read it back to the same parameters (the layout is the reference's, not ours), and ``models.hf`` must load
it to Tunix's logits on every mesh at the float32 tolerance. The NumPy port (test_hf_families) stays the
reference for what Tunix has not: Gemma 3's soft caps and a Qwen 3 ``rope_theta`` other than 1e6.

What each model has on: Qwen 3's QK-norm, GQA (4 query heads over 2) and a head_dim of 16 apart from
hidden/heads = 8; Gemma 3's QK-norm, GQA, ``1 + w`` norms, post norms, GELU and its 5 sliding : 1 global
layers (Tunix's fixed pattern, hence 6 layers), the window 8 under 32 tokens with RoPE base 10k, the global
layer base 1M with linear scaling 8, and ``query_pre_attn_scalar`` = hidden/heads = 8 apart from head_dim.
Tunix 0.1.5 quirks the configs follow: its Qwen 3 RoPE is always base 1e6 and its head is untied.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import needs_devices
from hf_util import logits_of, mesh_of
from models import families, hf
from util import assert_close

if importlib.util.find_spec("tunix") is None:  # not installed: skip; installed but broken: fail
    pytest.skip("the references need google-tunix (pip install -e '.[test]')", allow_module_level=True)
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs safetensors (pip install -e '.[hf]')")
# Tunix's model modules turn flax_always_shard_variable off for the whole process when imported: keep ours.
with flax.config.temp_flip_flag("always_shard_variable", flax.config.flax_always_shard_variable):
    from tunix.models.gemma3 import model as tunix_gemma3, params_safetensors as tunix_gemma3_reader
    from tunix.models.qwen3 import model as tunix_qwen3, params as tunix_qwen3_reader

MESHES = [(1, 1, 1), (2, 2, 2), (4, 2, 1)]  # (cp_colossal, cp_ulysses, tp)
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
QWEN3 = COMMON | dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2,
                      rope_theta=1_000_000.0, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                      sliding_window=None, attention_bias=False)
GEMMA3 = COMMON | dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=6,
                       rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       rope_local_base_freq=10_000.0, sliding_window=8,
                       layer_types=5 * ["sliding_attention"] + ["full_attention"], query_pre_attn_scalar=8,
                       hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None,
                       final_logit_softcapping=None, tie_word_embeddings=True)
CONFIGS = {"qwen3": QWEN3, "gemma3": GEMMA3}


def randomize(model, seed: int, norm_mean: float) -> None:
    """Every parameter random (Tunix initialises norms and MLPs to constants): norms ``norm_mean + 0.2 N``."""
    leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [
        norm_mean + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 else 0.3 * jax.random.normal(k, x.shape)
        for k, x in zip(keys, leaves)]))


def params_of(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(v[...])
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def qkv_weight(w_DNd: np.ndarray) -> np.ndarray:
    """A ``[D, heads, d]`` projection as Hugging Face's ``[heads * d, D]`` weight."""
    return w_DNd.reshape(w_DNd.shape[0], -1).T


def out_weight(w_NdD: np.ndarray) -> np.ndarray:
    """A ``[heads, d, D]`` output projection as Hugging Face's ``[D, heads * d]`` weight."""
    return w_NdD.reshape(-1, w_NdD.shape[-1]).T


def qwen3_reference(config: dict, seed=0):
    """Tunix's Qwen 3 for ``config``, random, and its parameters under the Hugging Face names."""
    c = config
    cfg = tunix_qwen3.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"], rope_theta=int(c["rope_theta"]), norm_eps=c["rms_norm_eps"])
    with nnx.use_eager_sharding(False):  # its parameters carry mesh-axis names; no mesh here
        model = tunix_qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    randomize(model, seed + 1, norm_mean=1.0)
    p = params_of(model)
    out = {"model.embed_tokens.weight": p["embedder.input_embedding"], "model.norm.weight": p["final_norm.w"],
           "lm_head.weight": p["lm_head.w"].T}
    for i in range(cfg.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        for n in "qkv":
            out[f"{h}self_attn.{n}_proj.weight"] = qkv_weight(p[f"{t}attn.{n}_proj.w"])
        out[f"{h}self_attn.o_proj.weight"] = out_weight(p[f"{t}attn.o_proj.w"])
        for n in ("q_norm", "k_norm"):
            out[f"{h}self_attn.{n}.weight"] = p[f"{t}attn.{n}.w"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{h}mlp.{n}.weight"] = p[f"{t}mlp.{n}.kernel"].T
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{h}{n}.weight"] = p[f"{t}{n}.w"]
    return model, out


def gemma3_reference(config: dict, seed=0):
    """Tunix's Gemma 3 (text) for ``config``, random, and its parameters under the Hugging Face names."""
    c = config
    cfg = tunix_gemma3.ModelConfig(
        num_layers=c["num_hidden_layers"], num_embed=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"], sliding_window_size=c["sliding_window"],
        local_base_frequency=int(c["rope_local_base_freq"]), global_base_frequency=int(c["rope_theta"]),
        global_scale_factor=c["rope_scaling"]["factor"], param_dtype=jnp.float32,
        query_pre_attn_norm=tunix_gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS)
    assert c["query_pre_attn_scalar"] == c["hidden_size"] // c["num_attention_heads"]
    with nnx.use_eager_sharding(False):
        model = tunix_gemma3.Gemma3(cfg, rngs=nnx.Rngs(seed))
    randomize(model, seed + 1, norm_mean=0.0)  # Gemma's norm weight w scales by 1 + w
    p = params_of(model)
    out = {"model.embed_tokens.weight": p["embedder.input_embedding"], "model.norm.weight": p["final_norm.scale"]}
    norms = dict(input_layernorm="pre_attention_norm", post_attention_layernorm="post_attention_norm",
                 pre_feedforward_layernorm="pre_ffw_norm", post_feedforward_layernorm="post_ffw_norm")
    for i in range(cfg.num_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        k_KDd, v_KDd = p[f"{t}attn.kv_einsum.w"]
        out[f"{h}self_attn.q_proj.weight"] = qkv_weight(p[f"{t}attn.q_einsum.w"].transpose(1, 0, 2))
        out[f"{h}self_attn.k_proj.weight"] = qkv_weight(k_KDd.transpose(1, 0, 2))
        out[f"{h}self_attn.v_proj.weight"] = qkv_weight(v_KDd.transpose(1, 0, 2))
        out[f"{h}self_attn.o_proj.weight"] = out_weight(p[f"{t}attn.attn_vec_einsum.w"])
        out[f"{h}self_attn.q_norm.weight"] = p[f"{t}attn._query_norm.scale"]
        out[f"{h}self_attn.k_norm.weight"] = p[f"{t}attn._key_norm.scale"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{h}mlp.{n}.weight"] = p[f"{t}mlp.{n}.kernel"].T
        for ours, theirs in norms.items():
            out[f"{h}{ours}.weight"] = p[f"{t}{theirs}.scale"]
    return model, out


REFERENCES = {"qwen3": (qwen3_reference, tunix_qwen3_reader), "gemma3": (gemma3_reference, tunix_gemma3_reader)}


def write_checkpoint(tensors: dict, config: dict, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
                                folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    """The reference's logits for ``tokens [B, S]``: positions ``arange(S)``, a causal mask."""
    B, S = tokens.shape
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    causal = np.broadcast_to(np.tril(np.ones((S, S), bool)), (B, S, S))
    with jax.numpy_rank_promotion("allow"):  # Tunix's norms broadcast by rank promotion
        logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), None, jnp.asarray(causal))
    return np.asarray(logits)


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)


@pytest.fixture(params=sorted(CONFIGS))
def reference(request, tmp_path):
    """``(family, Tunix model, its checkpoint folder)``."""
    family = request.param
    model, tensors = REFERENCES[family][0](CONFIGS[family])
    write_checkpoint(tensors, CONFIGS[family], tmp_path / "ckpt")
    return family, model, tmp_path / "ckpt"


def test_tunix_reads_the_checkpoint_back(reference):
    """Tunix's own Hugging Face reader gives back the reference's parameters bit for bit: the names and
    layouts written here are the public ones as Tunix reads them, not as models.hf does."""
    family, model, folder = reference
    with nnx.use_eager_sharding(False):
        again = REFERENCES[family][1].create_model_from_safe_tensors(str(folder), model.config)
    expected, got = params_of(model), params_of(again)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@needs_devices(8)
def test_logits_match_tunix_on_every_mesh(reference, tokens):
    family, ref, folder = reference
    expected = tunix_logits(ref, tokens)
    for c, u, t in MESHES:
        model, _ = hf.load(folder, mesh_of(c, u, t), dtype=jnp.float32)
        assert model.cfg.use_qk_norm and model.cfg.num_kv_heads < model.cfg.num_heads
        assert_close(logits_of(model, tokens), expected, jnp.float32, f"{family} mesh (c, u, t)=({c}, {u}, {t})")


def test_gemma3_window_matters(tokens):
    """The comparison above is not vacuous: Tunix's Gemma 3 with the window opened to the whole sequence
    gives other logits, and models.hf loads the 5 sliding : 1 global pattern with the window of 8."""
    ref, tensors = gemma3_reference(GEMMA3)
    wide = dataclasses.replace(ref.config, sliding_window_size=tokens.shape[1])
    with nnx.use_eager_sharding(False):
        unwindowed = tunix_gemma3.Gemma3(wide, rngs=nnx.Rngs(0))
    nnx.update(unwindowed, nnx.state(ref, nnx.Param))
    gap = np.abs(tunix_logits(unwindowed, tokens) - tunix_logits(ref, tokens)).max()
    assert gap > 1e-2, f"{gap=}: the window changes nothing at this length"
    cfg = families.config_from_hf(GEMMA3)
    assert cfg.sliding_layers == (True,) * 5 + (False,) and cfg.layer_attention(0).local_window_size == (7, 0)
