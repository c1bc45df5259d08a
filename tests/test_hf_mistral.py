"""Mistral checkpoints (``MistralForCausalLM``) in the Hugging Face layout, loaded onto CP meshes.

The checkpoints are transformers' ``FlaxMistralForCausalLM`` (4.57) with random parameters (norms
too), GQA and ``rope_theta`` 1e6, written as the public layout by ``hf_flax.write_public_layout``
(the parameter trees are FlaxLlama's). Flax Mistral's masks are not PyTorch's: its
``triu(causal, k=-sliding_window)`` lets a query see ``sliding_window + 1`` keys where PyTorch's
``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) and flash attention's
``window_size=(W - 1, W - 1)`` give ``W``; with ``sliding_window`` null it keeps only the diagonal.
So a window is checked against ``hf_reference`` (PyTorch's rule), which
``test_flax_mistral_masks_are_pytorchs_shifted_by_one`` ties to Flax at ``W - 1``; a null window
against Flax given ``sliding_window=max_position_embeddings`` (causal, nothing slides within 64).
Flax Mistral also ignores ``rope_theta`` and ``head_dim``: its RoPE table is patched in as
FlaxLlama's (``hf_flax``), and ``head_dim`` is hidden/heads.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_reference
from conftest import needs_devices
from hf_flax import random_causal_lm, write_public_layout
from hf_util import logits_of, mesh_of
from models import families, hf
from util import assert_close

transformers = pytest.importorskip("transformers", reason="the reference needs transformers (pip install -e '.[test]')")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs safetensors (pip install -e '.[hf]')")
from transformers.models.mistral import modeling_flax_mistral  # noqa: E402

MESHES = [(1, 1, 1), (2, 2, 2), (4, 2, 1)]  # (cp_colossal, cp_ulysses, tp)
WINDOW = 8  # over 32 tokens


def hf_config(**kw) -> dict:
    base = dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=96, hidden_size=32,
                intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rms_norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=64, sliding_window=WINDOW,
                tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2)
    return base | kw


def flax_mistral(config: dict, monkeypatch, seed=0):
    """FlaxMistral with random parameters and the config's RoPE base; Flax's own sliding-window rule."""
    d = config["hidden_size"] // config["num_attention_heads"]
    inv = (1.0 / config["rope_theta"] ** (np.arange(0, d, 2) / d)).astype(np.float32)
    return random_causal_lm(modeling_flax_mistral, modeling_flax_mistral.FlaxMistralForCausalLM,
                            transformers.MistralConfig(**config), inv, config["tie_word_embeddings"], monkeypatch, seed)


def flax_logits(model, tokens):
    with jax.numpy_rank_promotion("allow"):
        return np.asarray(model(tokens).logits)


def reference_logits(config: dict, tensors: dict, tokens) -> np.ndarray:
    ref = hf_reference.Reference(config, tensors)
    out = np.stack([ref(row) for row in tokens])
    assert ref.used == set(tensors)  # the checkpoint holds exactly what the reference reads
    return out


def changed(a, b) -> bool:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) > 1e-2


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)


def test_flax_mistral_masks_are_pytorchs_shifted_by_one(tmp_path, monkeypatch, tokens):
    """The NumPy reference's window W (PyTorch's) is Flax's W - 1; Flax's null window attends to itself only."""
    config = hf_config()
    model = flax_mistral(config, monkeypatch)
    params = model.params
    write_public_layout(model, config, tmp_path / "ckpt")
    tensors = safetensors_numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    expected = reference_logits(config, tensors, tokens)

    def flax_with(window):
        model = flax_mistral(hf_config(sliding_window=window), monkeypatch)
        model.params = params
        return flax_logits(model, tokens)

    assert_close(expected, flax_with(WINDOW - 1), jnp.float32, "PyTorch's W is Flax's W - 1")
    assert changed(expected, flax_with(WINDOW)), "Flax's W sees one key more than PyTorch's"
    full = reference_logits(hf_config(sliding_window=None), tensors, tokens)
    assert_close(full, flax_with(config["max_position_embeddings"]), jnp.float32, "no window: causal")
    assert changed(full, flax_with(None)), "Flax's null window keeps only the diagonal"


@needs_devices(8)
@pytest.mark.parametrize("window,tied", [(WINDOW, False), (None, True)], ids=["window8-untied", "null-tied"])
def test_logits_match_on_every_mesh(tmp_path, monkeypatch, tokens, window, tied):
    """A window of 8 over 32 tokens against the NumPy reference (a window of 16, or none, changes them);
    a null window against FlaxMistral."""
    config = hf_config(sliding_window=window, tie_word_embeddings=tied)
    # Flax's null window is the diagonal; one of max_position_embeddings is the causal mask over 64 positions
    ref = flax_mistral(config | dict(sliding_window=window or config["max_position_embeddings"]), monkeypatch)
    write_public_layout(ref, config, tmp_path / "ckpt")
    tensors = safetensors_numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    if window is None:
        expected = flax_logits(ref, tokens)
    else:
        expected = reference_logits(config, tensors, tokens)
        assert changed(expected, reference_logits(hf_config(sliding_window=2 * window), tensors, tokens))
        assert changed(expected, reference_logits(hf_config(sliding_window=None), tensors, tokens))
    for c, u, t in MESHES:
        model, _ = hf.load(tmp_path / "ckpt", mesh_of(c, u, t), dtype=jnp.float32)
        assert model.cfg.sliding_window == window and model.cfg.sliding_layers is None
        assert model.cfg.tie_embeddings == tied and model.cfg.head_dim == 8
        assert_close(logits_of(model, tokens), expected, jnp.float32, f"window={window} mesh (c, u, t)=({c}, {u}, {t})")


@needs_devices(8)
@pytest.mark.parametrize("window", [WINDOW, None], ids=["window8", "null"])
def test_save_load_round_trip_is_exact(tmp_path, monkeypatch, window):
    """load -> save gives the tensors bit for bit and the same sliding_window (null written out, not dropped:
    a missing one is MistralConfig's 4096)."""
    config = hf_config(sliding_window=window)
    write_public_layout(flax_mistral(config | dict(sliding_window=WINDOW), monkeypatch), config, tmp_path / "ckpt")
    model, cfg_json = hf.load(tmp_path / "ckpt", mesh_of(2, 2, 2), dtype=jnp.float32)
    hf.save(model, tmp_path / "saved", cfg_json)
    original = safetensors_numpy.load_file(tmp_path / "ckpt" / "model.safetensors")
    saved = safetensors_numpy.load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"] and written["model_type"] == "mistral"
    assert "sliding_window" in written and written["sliding_window"] == window and "layer_types" not in written
    assert families.config_from_hf(written) == model.cfg
    again, _ = hf.load(tmp_path / "saved", mesh_of(4, 2, 1), dtype=jnp.float32)
    assert again.cfg == model.cfg


def test_window_maps_to_llama_config_exactly():
    """HF's W (a query sees keys p_q - W < p_k <= p_q) is LlamaConfig.sliding_window=W in every layer:
    jax_cp's local window (W - 1, 0); a missing sliding_window is MistralConfig's 4096, null is none."""
    cfg = families.config_from_hf(hf_config(head_dim=None))
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.head_dim) == (WINDOW, None, 8)
    assert all(cfg.layer_attention(i).local_window_size == (WINDOW - 1, 0) for i in range(cfg.num_layers))
    missing = {k: v for k, v in hf_config().items() if k != "sliding_window"}
    assert families.config_from_hf(missing).sliding_window == 4096
    assert families.config_from_hf(hf_config(sliding_window=None)).sliding_window is None
    assert families.config_from_hf(dict(hf_config(), architectures=[])).sliding_window == WINDOW  # by model_type
    assert families.config_from_hf(hf_config(layer_types=["sliding_attention"] * 2)).sliding_window == WINDOW
    assert families.config_from_hf(hf_config(rope_scaling=None, tie_word_embeddings=True)).tie_embeddings


def test_unsupported_mistral_values_are_named():
    cases = [
        (hf_config(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling=.* is not supported"),
        (hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling=.* is not supported"),
        (hf_config(sliding_window=0), r"sliding_window=0 is not supported"),
        (hf_config(sliding_window=8.5), r"sliding_window=8.5 is not supported"),
        (hf_config(layer_types=["sliding_attention", "full_attention"]), r"layer_types=.*every layer"),
        (hf_config(sliding_window=None, layer_types=["sliding_attention"] * 2), r"layer_types=.*every layer"),
        (hf_config(attention_bias=True), r"attention_bias=True is not supported"),
        (hf_config(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ]
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            families.config_from_hf(config)
    alternating = dataclasses.replace(families.config_from_hf(hf_config()), sliding_layers=(True, False))
    with pytest.raises(ValueError, match=r"cannot be written as a MistralForCausalLM"):
        families.config_to_hf(alternating, "mistral")
