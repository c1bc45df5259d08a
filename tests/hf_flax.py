"""The transformers-Flax side of the checkpoint comparisons (FlaxLlama, FlaxMistral, 4.57; no torch): a
causal LM with random parameters and given RoPE frequencies, and its parameters written as the public
Hugging Face layout (``[out, in]`` ``weight`` matrices under the PyTorch names), independently of
``models.hf``. Both models share Llama's parameter tree."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np


def sinusoids(inv_freq: np.ndarray):
    """A ``create_sinusoidal_positions`` for FlaxLlama / FlaxMistral with the given frequencies (their layout)."""
    def create(num_pos, dim):
        freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
        emb = np.concatenate((freqs, freqs), axis=-1)
        return jnp.array(np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1))
    return create


def random_causal_lm(modeling, model_class, hf_config, inv_freq: np.ndarray, tied: bool, monkeypatch, seed=0):
    """``model_class(hf_config)`` from the transformers Flax module ``modeling``, its RoPE table from
    ``inv_freq`` (patched into ``modeling.create_sinusoidal_positions``), every parameter random (norms
    ``1 + 0.2 N``, matrices ``0.3 N``); ``tied``: the head set to the embedding's transpose (the Flax
    models have no tying of their own)."""
    monkeypatch.setattr(modeling, "create_sinusoidal_positions", sinusoids(inv_freq))
    with jax.numpy_rank_promotion("allow"):  # the Flax models broadcast by rank promotion
        model = model_class(hf_config, seed=seed, dtype=jnp.float32)
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [(1 + 0.2 * jax.random.normal(k, x.shape)) if x.ndim == 1 else 0.3 * jax.random.normal(k, x.shape)
              for k, x in zip(keys, leaves)]
    params = jax.tree.unflatten(tree, leaves)
    if tied:
        params["lm_head"]["kernel"] = params["model"]["embed_tokens"]["embedding"].T
    model.params = params
    return model


def write_public_layout(model, config: dict, folder) -> None:
    """The model's parameters as a Hugging Face checkpoint: ``config.json`` and ``model.safetensors``."""
    from safetensors import numpy as safetensors_numpy

    p, out = model.params, {}
    out["model.embed_tokens.weight"] = p["model"]["embed_tokens"]["embedding"]
    out["model.norm.weight"] = p["model"]["norm"]["weight"]
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = p["lm_head"]["kernel"].T
    for i, layer in p["model"]["layers"].items():
        for group in ("self_attn", "mlp"):
            for name, dense in layer[group].items():
                out[f"model.layers.{i}.{group}.{name}.weight"] = dense["kernel"].T
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{i}.{name}.weight"] = layer[name]["weight"]
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()},
                                folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
