"""Qwen 3 and Gemma 3 (text) checkpoints in the Hugging Face layout, loaded onto CP meshes.

transformers ships no JAX Qwen 3 or Gemma 3, so the reference is ``hf_reference``: a NumPy float64
forward written from transformers' PyTorch modeling code, reading the checkpoint's own names and
``config.json`` (it agrees with FlaxLlama on Llama checkpoints: test_hf_llama). The checkpoints are
random, with every feature switched on that the family has: Qwen 3's QK-norm and a head_dim apart
from hidden/heads; Gemma 3's ``1 + w`` norms, scaled embedding, post norms, GELU, a sliding layer
(window 8 over 32 tokens, RoPE base 10k) and a global one (base 1M, linear scaling 8),
``query_pre_attn_scalar`` apart from head_dim and both soft caps.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hf_reference
from hf_util import logits_of, mesh_of
import jax_cp
from conftest import needs_devices
from models import families, hf
from util import assert_close

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs safetensors (pip install -e '.[hf]')")

MESHES = [(1, 1, 1), (2, 2, 2), (4, 2, 1)]  # (cp_colossal, cp_ulysses, tp)
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=1,
              eos_token_id=2)
QWEN3 = COMMON | dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1_000_000.0,
                      tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
                      sliding_window=None, attention_bias=False)
GEMMA3 = COMMON | dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_key_value_heads=1,
                       rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       rope_local_base_freq=10_000.0, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                       hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=20.0,
                       final_logit_softcapping=15.0, tie_word_embeddings=True)
CONFIGS = {"qwen3": QWEN3, "gemma3": GEMMA3}


def random_checkpoint(config: dict, folder, dtype=np.float32, seed=0) -> dict:
    """A checkpoint of random tensors (the names and shapes ``config.json`` implies); returns them."""
    rng = np.random.default_rng(seed)
    gemma = "gemma3" in config["model_type"]
    tensors = {}
    for name, shape in hf.tensor_shapes(config).items():
        if len(shape) == 1:  # a norm: Gemma's weight w scales by 1 + w
            value = 0.2 * rng.standard_normal(shape) + (0.0 if gemma else 1.0)
        else:
            value = 0.3 * rng.standard_normal(shape)
        tensors[name] = value.astype(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture
def tokens():
    return np.random.default_rng(1).integers(0, 96, (2, 32)).astype(np.int32)


@needs_devices(8)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_the_reference_on_every_mesh(tmp_path, tokens, family):
    config = CONFIGS[family]
    tensors = random_checkpoint(config, tmp_path / "ckpt")
    ref = hf_reference.Reference(config, tensors)
    expected = np.stack([ref(row) for row in tokens])
    assert ref.used == set(tensors)  # the checkpoint holds exactly what the reference reads
    for c, u, t in MESHES:
        model, _ = hf.load(tmp_path / "ckpt", mesh_of(c, u, t), dtype=jnp.float32)
        assert_close(logits_of(model, tokens), expected, jnp.float32, f"{family} mesh (c, u, t)=({c}, {u}, {t})")


def test_gemma3_layers_differ_where_the_checkpoint_says():
    """The sliding layer has its window and local RoPE; the global one neither; Qwen 3 has no window."""
    cfg = families.config_from_hf(GEMMA3)
    local, glob = cfg.layer_attention(0), cfg.layer_attention(1)
    assert local.local_window_size == (7, 0) and local.rope_theta == 10_000.0
    assert glob.local_window_size is None and glob.rope_theta == jax_cp.RoPE(theta=1e6, factor=8.0)
    assert cfg.norm_offset == 1.0 and cfg.embed_scale == 32 ** 0.5 and cfg.post_norms and cfg.use_qk_norm
    assert families.config_from_hf(QWEN3).sliding_window is None
    default = {k: v for k, v in GEMMA3.items() if k != "layer_types"} | {"num_hidden_layers": 12}
    slides = families.config_from_hf(default).sliding_layers
    assert slides == tuple(i % 6 != 5 for i in range(12))  # Gemma 3's 5 local : 1 global


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bfloat16_checkpoint_round_trip_is_exact(tmp_path, family):
    """A bfloat16 checkpoint (as published) loads to float32 and saves back bit for bit; its config too."""
    config = CONFIGS[family]
    tensors = random_checkpoint(config, tmp_path / "ckpt", dtype=ml_dtypes.bfloat16)
    model, cfg_json = hf.load(tmp_path / "ckpt", mesh_of(1, 1, 1), dtype=jnp.float32)
    hf.save(model, tmp_path / "out", cfg_json, dtype=jnp.bfloat16)
    saved = safetensors_numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(tensors)
    exact = [n for n in tensors if "q_norm" not in n or family != "gemma3"]
    for name in exact:
        np.testing.assert_array_equal(saved[name], tensors[name], err_msg=name)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert families.config_from_hf(written) == model.cfg and written["torch_dtype"] == "bfloat16"


def test_gemma3_query_scale_folds_into_q_norm(tmp_path):
    """Gemma 3's query_pre_attn_scalar is held in the q_norm scale, and saving takes it out again (within
    one float32 rounding: the stored w comes back as (w + 1) * c / c - 1)."""
    tensors = random_checkpoint(GEMMA3, tmp_path / "ckpt")
    model, cfg_json = hf.load(tmp_path / "ckpt", mesh_of(1, 1, 1), dtype=jnp.float32)
    c = np.sqrt(16 / 24)
    w = tensors["model.layers.0.self_attn.q_norm.weight"]
    np.testing.assert_allclose(np.asarray(model.blocks[0].attn.q_norm[...]), (w + 1) * c, rtol=1e-6)
    hf.save(model, tmp_path / "out", cfg_json)
    saved = safetensors_numpy.load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_allclose(saved["model.layers.0.self_attn.q_norm.weight"], w, atol=4e-7)


def test_unsupported_family_values_are_named():
    cases = [
        (QWEN3 | dict(rms_norm_eps=1e-5), r"rms_norm_eps=1e-05 is also the QK-norm epsilon"),
        (GEMMA3 | dict(hidden_activation="relu"), r"hidden_activation='relu' is not supported"),
        (GEMMA3 | dict(layer_types=["sliding_attention", "chunked_attention"]), r"layer_types=.*must hold"),
        (GEMMA3 | dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True"),
        (dict(QWEN3, architectures=[], model_type="qwen2"), r"model_type='qwen2'\) is not supported"),
    ]
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            families.config_from_hf(config)


@needs_devices(8)
def test_gemma3_decode_follows_the_full_forward(tmp_path):
    """Prefill and decode on the CP mesh (its sliding layer windowed in the cache too): each greedy token is
    the argmax of a full forward pass over the tokens so far."""
    from models import generate

    random_checkpoint(GEMMA3, tmp_path / "ckpt")
    mesh = mesh_of(2, 2, 2)
    model, _ = hf.load(tmp_path / "ckpt", mesh, dtype=jnp.float32)
    prompt = np.random.default_rng(2).integers(0, 96, (1, 12)).astype(np.int32)
    gen = generate.Generator(model, batch=1, prompt_len=12, max_length=32)
    tok, new = gen.prefill(prompt, np.array([12]), jax.random.key(0)), []
    for _ in range(10):
        new.append(int(tok[0]))
        tok = gen.step(tok, jax.random.key(0))
    seq = np.concatenate([prompt[0], new[:-1]])
    tokens = np.zeros((1, 24), np.int32)
    tokens[0, :len(seq)] = seq
    fresh, _ = hf.load(tmp_path / "ckpt", mesh, dtype=jnp.float32)
    greedy = np.argmax(np.asarray(logits_of(fresh, tokens))[0, 11:len(seq)], axis=-1)
    np.testing.assert_array_equal(greedy, new)
