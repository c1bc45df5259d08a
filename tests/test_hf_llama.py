"""Llama 3.x checkpoints in the Hugging Face layout, loaded onto CP meshes (``models.hf``).

The reference is transformers' ``FlaxLlamaForCausalLM`` (4.57; JAX, no torch), whose RoPE table
always uses base 10000 without scaling: the tests hand it the Llama 3.1 frequencies through its
``create_sinusoidal_positions`` hook, computed in NumPy from Hugging Face's
``_compute_llama3_parameters`` (``hf_reference.llama3_inv_freq``). Its random parameters are written as
the public checkpoint layout (``[out, in]`` ``weight`` matrices under the PyTorch names) by
``hf_flax``, independently of ``models.hf``; logits must agree at the float32 tolerance on every mesh.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jax_cp
from conftest import needs_devices
import hf_reference
from hf_flax import random_causal_lm, write_public_layout
from hf_util import logits_of, mesh_of
from models import families, hf
from util import assert_close

transformers = pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs safetensors (pip install -e '.[hf]')")
from transformers.models.llama import modeling_flax_llama  # noqa: E402

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
MESHES = [(1, 1, 1), (2, 2, 2), (4, 2, 1)]  # (cp_colossal, cp_ulysses, tp)


def hf_config(**kw) -> dict:
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=32,
                intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rms_norm_eps=1e-5, rope_theta=500_000.0, rope_scaling=LLAMA3, max_position_embeddings=64,
                tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2)
    return base | kw


def flax_reference(config: dict, monkeypatch, seed=0):
    """FlaxLlama with random parameters (norms too) and the config's RoPE frequencies."""
    d = config["head_dim"]
    inv = hf_reference.llama3_inv_freq(config["rope_theta"], config["head_dim"], config["rope_scaling"]) if config.get(
        "rope_scaling") else (1.0 / config["rope_theta"] ** (np.arange(0, d, 2) / d)).astype(np.float32)
    return random_causal_lm(modeling_flax_llama, modeling_flax_llama.FlaxLlamaForCausalLM,
                            transformers.LlamaConfig(**config), inv, config["tie_word_embeddings"], monkeypatch, seed)


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)


@needs_devices(8)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_flax_llama_on_every_mesh(tmp_path, monkeypatch, tokens, tied):
    """Llama 3.1 RoPE scaling (untied) and Llama 3.2's tied embeddings: the logits of FlaxLlama."""
    config = hf_config(tie_word_embeddings=tied)
    ref = flax_reference(config, monkeypatch)
    write_public_layout(ref, config, tmp_path / "ckpt")
    with jax.numpy_rank_promotion("allow"):  # FlaxLlama broadcasts by rank promotion
        expected = ref(tokens).logits
    for c, u, t in MESHES:
        model, _ = hf.load(tmp_path / "ckpt", mesh_of(c, u, t), dtype=jnp.float32)
        assert isinstance(model.cfg.rope_theta, jax_cp.RoPE) and model.cfg.tie_embeddings == tied
        assert_close(logits_of(model, tokens), expected, jnp.float32, f"mesh (c, u, t)=({c}, {u}, {t})")


def test_numpy_reference_matches_flax_llama(tmp_path, monkeypatch, tokens):
    """The NumPy reference the Qwen 3 and Gemma 3 tests use agrees with FlaxLlama on a Llama checkpoint."""
    config = hf_config()
    ref = flax_reference(config, monkeypatch)
    write_public_layout(ref, config, tmp_path / "ckpt")
    tensors = safetensors_numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    numpy_ref = hf_reference.Reference(config, tensors)
    with jax.numpy_rank_promotion("allow"):
        expected = ref(tokens).logits
    assert_close(np.stack([numpy_ref(row) for row in tokens]), expected, jnp.float32)
    assert numpy_ref.used == set(tensors)


def test_llama3_frequencies_are_hugging_faces():
    """``jax_cp.RoPE`` (float64 on the host) against Hugging Face's float32 rule, for Llama 3.1 8B's values."""
    s = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    rope = families.config_from_hf(hf_config(head_dim=128, hidden_size=512, rope_scaling=s | {"rope_type": "llama3"}))
    np.testing.assert_allclose(rope.rope_theta.inv_freq(128), hf_reference.llama3_inv_freq(500_000.0, 128, s), rtol=1e-6)
    linear = jax_cp.RoPE(theta=10_000.0, factor=4.0)
    np.testing.assert_allclose(linear.inv_freq(8), 1 / 10_000.0 ** (np.arange(0, 8, 2) / 8) / 4, rtol=1e-12)
    x, pos = jnp.ones((1, 3, 1, 8)), jnp.arange(3)[None]
    assert_close(jax_cp.apply_rope(x, 4 * pos, linear), jax_cp.apply_rope(x, pos, 10_000.0), jnp.float32,
                 "linear scaling by 4 at position 4p is plain RoPE at p")


@needs_devices(8)
def test_save_load_round_trip_is_exact(tmp_path, monkeypatch):
    """load -> save gives the original tensors bit for bit; numbered files with an index and bfloat16 too."""
    config = hf_config()
    write_public_layout(flax_reference(config, monkeypatch), config, tmp_path / "ckpt")
    model, cfg_json = hf.load(tmp_path / "ckpt", mesh_of(2, 2, 2), dtype=jnp.float32)
    hf.save(model, tmp_path / "one", cfg_json)
    original = safetensors_numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    saved = safetensors_numpy.load_file(tmp_path / "one" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    assert families.config_from_hf(json.loads((tmp_path / "one" / "config.json").read_text())) == model.cfg
    hf.save(model, tmp_path / "many", cfg_json, max_shard_bytes=20_000, dtype=jnp.bfloat16)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and sorted(index["weight_map"]) == sorted(original)
    again, _ = hf.load(tmp_path / "many", mesh_of(4, 2, 1), dtype=jnp.float32)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(b[...]), np.asarray(a[...]).astype(jnp.bfloat16).astype(np.float32),
                                      err_msg=str(path))


@needs_devices(8)
def test_fsdp_loads_the_same_values(tmp_path, monkeypatch):
    """Weights stored sharded over dp and the CP axes (FSDP) hold the same values as the tp-only layout."""
    config = hf_config()
    write_public_layout(flax_reference(config, monkeypatch), config, tmp_path / "ckpt")
    mesh = jax_cp.make_mesh(cp_colossal=2, tp=2, dp=2, axis_types=AxisType.Auto)
    plain, _ = hf.load(tmp_path / "ckpt", mesh, dtype=jnp.float32)
    fsdp, _ = hf.load(tmp_path / "ckpt", mesh, dtype=jnp.float32, fsdp=True, fsdp_axes=("dp", "cp_colossal"))
    sharded = 0
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(plain, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(fsdp, nnx.Param))):
        sharded += b[...].sharding.spec != a[...].sharding.spec
        np.testing.assert_array_equal(np.asarray(b[...]), np.asarray(a[...]), err_msg=str(path))
    assert sharded > 0


def _bad_checkpoint(folder, config: dict, tensors: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        safetensors_numpy.save_file(tensors, folder / "model.safetensors")
    return folder


def test_bad_checkpoints_name_the_key_or_tensor(tmp_path):
    mesh = mesh_of(1, 1, 1)
    good = hf_config(rope_scaling=None)
    tensors = {n: np.zeros(s, np.float32) for n, s in hf.tensor_shapes(good).items()}
    cases = [
        (dict(architectures=["MambaForCausalLM"]), None, r"architectures=\['MambaForCausalLM'\].*not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None, r"rope_scaling.rope_type='yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), None, r"lacks \['low_freq_factor'"),
        (dict(attention_bias=True), None, r"attention_bias=True is not supported"),
        (dict(hidden_act="gelu"), None, r"hidden_act='gelu' is not supported"),
        ({}, {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
         r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
        ({}, tensors | {"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)},
         r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\], expected \[16, 32\]"),
        ({}, tensors | {"model.layers.2.mlp.up_proj.weight": np.zeros((4,), np.float32)},
         r"tensor 'model.layers.2.mlp.up_proj.weight' .* is not part of the model"),
    ]
    for i, (change, ts, match) in enumerate(cases):
        folder = _bad_checkpoint(tmp_path / str(i), good | change, tensors if ts is None else ts)
        with pytest.raises(ValueError, match=match):
            hf.load(folder, mesh, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"no config.json"):
        hf.load(tmp_path / "nothing", mesh)
    with pytest.raises(ValueError, match=r"needs all three"):
        jax_cp.RoPE(theta=1e4, factor=8.0, low_freq_factor=1.0)
