"""Fine-tuning a Hugging Face checkpoint at a longer context (``models.train --init-from``) and sampling from
the result (``models.generate --checkpoint``).

The checkpoint: a random tiny Llama (tied embeddings) trained for 16 positions, with a byte-level BPE
tokenizer built here with the ``tokenizers`` package. It is fine-tuned at 4x its context (64 tokens,
``--rope-scaling linear:4``) on the (2, 2, 2) mesh with packed rows in dispatch-plan order; the first
step's loss is the loaded checkpoint's own on that batch, the loss falls, and the result is saved
in the public layout with the tokenizer, from which ``models.generate`` samples greedily: each new
token is the argmax of a full forward pass over the text so far.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from conftest import needs_devices
from models import data as data_lib
from models import generate, hf, llama, train
from test_hf_families import random_checkpoint
from util import assert_close

tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (pip install -e '.[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install -e '.[hf]')")

EOS = "<|endoftext|>"
MESH = ["--cp-colossal", "2", "--cp-ulysses", "2", "--tp", "2"]


def build_tokenizer(texts: list[str], vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on ``texts``, ``EOS`` its id 0."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_corpus")
    for i, f in enumerate(data_lib.default_corpus_files()[:6]):
        shutil.copy(f, folder / f"{i:02d}_{f.name}")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus) -> Path:
    folder = tmp_path_factory.mktemp("hf_small")
    tok = build_tokenizer([f.read_text(errors="replace") for f in sorted(corpus.iterdir())])
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, rms_norm_eps=1e-5, rope_theta=10_000.0, max_position_embeddings=16,
                  tie_word_embeddings=True, hidden_act="silu", eos_token_id=tok.token_to_id(EOS),
                  bos_token_id=tok.token_to_id(EOS))
    random_checkpoint(config, folder, seed=3)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _args(checkpoint, corpus, out, *extra):
    return train.parse_args([
        "--init-from", str(checkpoint), "--rope-scaling", "linear:4", "--seq-len", "64", "--batch", "2", "--steps",
        "8", "--warmup", "1", "--lr", "1e-2", "--dtype", "float32", "--eval-batches", "0", "--checkpoint-every",
        "0", "--no-progress", "--no-xla-flags", "--data", str(corpus), "--out", str(out), *MESH, *extra])


@needs_devices(8)
def test_finetune_at_four_times_the_context_and_generate(checkpoint, corpus, tmp_path):
    cfg = _args(checkpoint, corpus, tmp_path / "run")
    summary = train.run(cfg)
    losses = summary["losses"]
    assert losses[max(losses)] < losses[1] - 0.5, losses  # the loss falls
    assert summary["step_compiles"] <= train.MAX_EXCHANGES
    # Step 1's loss is the checkpoint's own on that batch, with the stretched RoPE.
    s = train.setup(cfg)
    batch, _ = train.global_batch(s, s.train_windows, 0, cfg.batch)
    with jax.set_mesh(s.mesh):
        model = llama.Llama(train.model_config(cfg), mesh=s.mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
        hf.read_params(model, checkpoint)
        loss, _ = nnx.jit(llama.next_token_loss)(model, batch)
    assert_close(losses[1], loss, jnp.float32, "first step's loss")
    # Saved in the public layout, the RoPE extension and the tokenizer with it.
    out = tmp_path / "run" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["max_position_embeddings"] == 64 and (out / "tokenizer.json").is_file()
    _generate_greedily(out)


def _generate_greedily(folder: Path):
    """``models.generate`` on the fine-tuned folder: its greedy tokens are full-forward argmaxes."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    model, meta = generate.load_model(str(folder), mesh)
    assert model.dtype == jnp.bfloat16 and meta["tokenizer"] is not None
    model, _ = hf.load(folder, mesh, dtype=jnp.float32)  # float32, for an exact comparison below
    gcfg = generate.GenerateConfig(checkpoint=str(folder), prompt="def f(x):", max_new_tokens=6,
                                   stop_at_eod=False)
    text = io.StringIO()
    r = generate.generate(gcfg, model, out=text, tokenizer=meta["tokenizer"], eod=meta["eod"])
    prompt = meta["tokenizer"].encode(gcfg.prompt).ids
    assert len(r["tokens"]) == 6 and text.getvalue() == gcfg.prompt + meta["tokenizer"].decode(r["tokens"]) + "\n"
    seq = np.asarray(prompt + r["tokens"][:-1], np.int32)
    S = -(-len(seq) // 8) * 8  # padded to a multiple of the CP degree
    tokens = np.zeros((1, S), np.int32)
    tokens[0, :len(seq)] = seq
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    positions = jax.device_put(np.arange(S, dtype=np.int32)[None], sharding)
    model, _ = hf.load(folder, mesh, dtype=jnp.float32)  # without the cache the sampler donated
    with jax.set_mesh(mesh):
        logits = nnx.jit(lambda m, t, p: m(t, positions=p))(model, jax.device_put(tokens, sharding), positions)
    greedy = np.argmax(np.asarray(logits)[0, len(prompt) - 1:len(seq)], axis=-1)
    np.testing.assert_array_equal(greedy, r["tokens"])


def test_finetune_flags_are_checked(checkpoint, corpus, tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--rope-scaling", "linear:4"])
    with pytest.raises(ValueError, match=r"--rope-scaling 'linear:x' must be linear:FACTOR or llama3:FACTOR"):
        hf.finetune_config(checkpoint, "linear:x")
    cfg, config = hf.finetune_config(checkpoint, "llama3:4")
    assert cfg.rope_theta == jax_cp.RoPE(theta=10_000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=16)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["max_position_embeddings"] == 64
    scaled = json.loads((checkpoint / "config.json").read_text()) | {"rope_scaling": config["rope_scaling"]}
    with pytest.raises(ValueError, match=r"already Llama 3 scaled"):
        hf.extend_context(scaled, "linear:2")


def test_plan_reads_only_the_config(checkpoint, tmp_path, capsys):
    """``--plan TOPOLOGY --init-from PATH`` compiles the checkpoint's model from its ``config.json`` alone: a
    folder holding nothing else (no weights, no tokenizer, no ``--data``) plans, and the report names it."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder / "config.json")
    out_dir = tmp_path / "never-written"
    train.main(["--plan", "v5e:2x4", "--init-from", str(folder), "--rope-scaling", "linear:4", "--seq-len", "256",
                "--batch", "2", *MESH, "--kernel", "blockwise", "--out", str(out_dir)])
    out = capsys.readouterr().out
    for needle in (f"one training step of config-only (--init-from {folder}: its config.json, no weights read) "
                   "on v5e:2x4", "train step config-only", "memory: total (peak)", "fits HBM budget"):
        assert needle in out, out
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"] and not out_dir.exists()
