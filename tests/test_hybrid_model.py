"""The hybrid model (``models.hybrid``: gated DeltaNet layers, attention every fourth): its layers and
caches, ``models.train --model hybrid-tiny`` on a (2, 2, 2) mesh with FSDP and dispatch-planned packed
rows equal to one device, and ``models.generate`` from the checkpoint it wrote equal to the training
path's greedy continuation. Losses are compared in float32 with the float32 tolerance.
"""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from conftest import needs_devices
from models import data as data_lib
from models import generate as gen_lib
from models import hybrid, train
from util import TOL


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Packed data: 200 documents of lognormal length (median 16 bytes) cut from standard-library text."""
    folder = tmp_path_factory.mktemp("short_docs")
    text = b"".join(f.read_bytes() for f in data_lib.default_corpus_files()[:8])
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(16), 1.0, 200).astype(int), 1, 128)
    for i, (a, b) in enumerate(zip(np.cumsum(lengths) - lengths, np.cumsum(lengths))):
        (folder / f"{i:03d}.txt").write_bytes(text[a:b])
    return folder


@needs_devices(8)
def test_three_linear_layers_per_attention_layer_and_their_caches():
    """``hybrid-tiny``: DeltaNet, DeltaNet, DeltaNet, attention; ``init_cache`` gives each kind its cache
    (the recurrent state split over tp by heads, the KV cache along the sequence)."""
    cfg = hybrid.get_config("hybrid-tiny")
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    model = hybrid.Hybrid(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    kinds = [type(block.attn).__name__ for block in model.blocks]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "GatedDeltaNet", "CPAttention"]
    model.init_cache(2, 16)
    state, kv = model.blocks[0].attn.recurrent_state[...], model.blocks[3].attn.cached_key[...]
    assert state.shape == (2, 4, 16, 16) and state.sharding.spec == jax.sharding.PartitionSpec("dp", "tp", None, None)
    assert kv.shape[:2] == (2, 16)
    model.use_kv_exchange(jax_cp.exchanges.AllGather())  # reaches the attention layer only
    assert model.blocks[3].attn.spec.kv_exchange == jax_cp.exchanges.AllGather()
    model.use_linear_pieces(4)  # reaches the DeltaNet layers only
    assert [block.attn.spec.max_pieces for block in model.blocks[:3]] == [4, 4, 4]
    with pytest.raises(ValueError, match=r"num_v_heads=3 is not a multiple of num_k_heads=2"):
        hybrid.HybridConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "linear_num_value_heads": 3})


@needs_devices(8)
def test_hybrid_trains_like_one_device_and_generates(short_docs, tmp_path, capsys):
    """3 steps of ``--model hybrid-tiny`` on a (2, 2, 2) mesh with ``--fsdp`` and the dispatch order of
    packed rows (the DeltaNet layers follow each row's own order through positions and segment ids)
    give one device's losses; then ``models.generate`` prefills and decodes from the checkpoint on the
    mesh, and its greedy text is the training path's argmax continuation, one pass per token."""
    common = dict(model="hybrid-tiny", seq_len=64, batch=2, steps=3, warmup=1, dtype="float32", data=str(short_docs),
                  eval_batches=0, progress=False)
    cp = train.run(train.TrainConfig(cp_colossal=2, cp_ulysses=2, tp=2, fsdp=True, checkpoint_every=3,
                                     out=str(tmp_path / "cp"), **common))
    one = train.run(train.TrainConfig(checkpoint_every=0, out=str(tmp_path / "one"), **common),
                    devices=jax.devices()[:1])
    assert cp["balance"] == "dispatch" and cp["mesh"] == {"dp": 1, "c": 2, "u": 2, "t": 2}
    np.testing.assert_allclose([cp["losses"][s] for s in (1, 2, 3)], [one["losses"][s] for s in (1, 2, 3)],
                               **TOL[jnp.dtype(jnp.float32)])
    assert one["losses"][3] < one["losses"][1]
    # each step held the state slots its batch's order needed (a power of two), not a bound for any order
    records = [json.loads(line) for line in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    pieces = [r["linear_pieces"] for r in records if r["event"] == "train"]
    assert len(pieces) == 3 and all(p & (p - 1) == 0 and p <= 16 for p in pieces), pieces

    mesh_flags = ["--cp-colossal", "2", "--cp-ulysses", "2", "--tp", "2"]
    gen_lib.main(["--checkpoint", str(tmp_path / "cp"), "--prompt", "def f", "--max-new-tokens", "6", *mesh_flags,
                  "--no-stop-at-eod"])
    out, err = capsys.readouterr()
    assert "hybrid-tiny (step 3)" in err and "prefill 5 tokens" in err and "6 new tokens" in err, err
    model, _ = gen_lib.load_model(str(tmp_path / "cp"), jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2))
    seq = list(b"def f")
    for _ in range(6):
        x = np.pad(np.array(seq, np.int32), (0, (-len(seq)) % 8))[None]
        seq.append(int(jnp.argmax(model(jnp.asarray(x), positions=jnp.arange(x.shape[1]))[0, len(seq) - 1])))
    expect = bytes(b for b in seq[5:] if b < 256).decode("utf-8", errors="replace")
    assert out.startswith("def f") and out[len("def f"):].rstrip("\n") == expect


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt5"], r"--model='gpt5' is unknown; choose one of \['llama3-70b', 'llama3-8b', 'tiny'\] \(Llama\) "
                          r"or \['hybrid-tiny'\] \(hybrid"),
    (["--model", "hybrid-tiny", "--prefix-lm", "0.3"], r"--prefix-lm=0.3 needs bidirectional prompts, which the "
                                                       r"recurrent layers of --model=hybrid-tiny cannot see"),
])
def test_bad_flags_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def test_a_batch_needing_more_state_slots_than_the_model_holds_is_a_value_error():
    """The trainer counts each batch's state slots on the host (``global_batch``) and refuses an order
    that needs more than the linear layers hold, naming linear_max_pieces, before the step would
    return NaN; the library's default (``None``: min(S/ranks, 16)) is checked the same way."""
    cfg = dataclasses.replace(hybrid.get_config("hybrid-tiny"), linear_max_pieces=2)
    dims = jax_cp.MeshDims(dp=1, c=2, u=2, t=2)
    train.check_linear_slots(cfg, (2, 2), 64, dims)  # fits
    with pytest.raises(ValueError, match=r"linear_max_pieces=2 gives 2 state slots per cp_colossal rank \(state "
                                         r"passing\), but this batch's order needs 3: .* linear_max_pieces=3 or more"):
        train.check_linear_slots(cfg, (3, 2), 64, dims)
    with pytest.raises(ValueError, match=r"per CP device \(convolution halo\), but this batch's order needs 5"):
        train.check_linear_slots(cfg, (2, 5), 64, dims)
    default = dataclasses.replace(cfg, linear_max_pieces=None)
    train.check_linear_slots(default, (16, 16), 64, dims)
    with pytest.raises(ValueError, match=r"linear_max_pieces=None gives 16 state slots per cp_colossal rank"):
        train.check_linear_slots(default, (17, 3), 64, dims)
    train.check_linear_slots(hybrid.get_config("tiny"), (99, 99), 64, dims)  # no linear layers: nothing to check


def test_each_batch_gets_the_state_slots_its_order_needs():
    """``linear_max_pieces=None`` (hybrid-tiny's): the trainer gives each step the slots its batch's order
    needs, rounded up to a power of two (a static argument: one program per value); a fixed value is
    checked and kept; no linear layers or no CP: nothing to size."""
    cfg, dims = hybrid.get_config("hybrid-tiny"), jax_cp.MeshDims(dp=1, c=2, u=2, t=2)
    assert cfg.linear_max_pieces is None
    assert [train.linear_pieces(cfg, (need, 1), 64, dims) for need in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert train.linear_pieces(cfg, (2, 3), 64, dims) == 4  # the convolution halo's count too
    # the layer's own rule (jax_cp.linear.sized_pieces), which also bounds them by a rank's tokens
    assert jax_cp.linear.sized_pieces(5) == 8 and jax_cp.linear.sized_pieces(5, 6) == 6
    assert train.linear_pieces(cfg, None, 64, dims) is None
    assert train.linear_pieces(hybrid.get_config("tiny"), (9, 9), 64, dims) is None
    fixed = dataclasses.replace(cfg, linear_max_pieces=4)
    assert train.linear_pieces(fixed, (3, 4), 64, dims) is None  # the model's own 4
    with pytest.raises(ValueError, match=r"linear_max_pieces=4 gives 4 state slots .* needs 5"):
        train.linear_pieces(fixed, (5, 1), 64, dims)
    # --linear-pieces fixes them for a hybrid model, and is refused for a model without linear layers
    run = dict(model="hybrid-tiny", cp_colossal=2, cp_ulysses=2, tp=2)
    assert train.model_config(train.TrainConfig(**run, linear_pieces=8)).linear_max_pieces == 8
    with pytest.raises(ValueError, match=r"--linear-pieces=8 sizes the linear layers of a hybrid model; "
                                         r"--model tiny has none: drop it"):
        train.model_config(train.TrainConfig(**{**run, "model": "tiny"}, linear_pieces=8))
    with pytest.raises(ValueError, match=r"--linear-pieces=0 must be a positive integer"):
        train.TrainConfig(**run, linear_pieces=0)
