"""The Llama-style model, its data pipeline and ``python -m models.train``.

In-process runs use the 8 simulated devices of this test process; runs that must
be separate processes (killed, resumed, two processes over gloo, bad flags at the
command line) share a compilation cache so each program compiles once.
Losses compared across meshes or processes are computed in float32 (``--dtype
float32``) with the float32 tolerance; a resumed run is compared bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
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
from models import hybrid, llama, train
from util import TOL, child_env

ROOT = Path(__file__).resolve().parents[1]
# The smallest run that still crosses every axis: B=2, S=32 on a (dp=1, c=2, u=2, t=2) mesh.
SMALL = ["--model", "tiny", "--seq-len", "32", "--batch", "2", "--warmup", "1", "--eval-every", "0",
         "--no-progress"]
HYBRID = ["--cp-colossal", "2", "--cp-ulysses", "2", "--tp", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A dozen standard-library files: real text, small, the same for every run."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, f in enumerate(data_lib.default_corpus_files()[:12]):
        shutil.copy(f, folder / f"{i:02d}_{f.name}")
    return folder


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> Path:
    """Packed data: 300 documents of lognormal length (median 16 bytes) cut from standard-library text,
    so a 32-token window holds several and the dual-chunk order leaves one CP rank more work."""
    folder = tmp_path_factory.mktemp("short_docs")
    text = b"".join(f.read_bytes() for f in data_lib.default_corpus_files()[:12])
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(16), 1.0, 300).astype(int), 1, 128)
    for i, (a, b) in enumerate(zip(np.cumsum(lengths) - lengths, np.cumsum(lengths))):
        (folder / f"{i:03d}.txt").write_bytes(text[a:b])
    return folder


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory) -> dict:
    base = tmp_path_factory.getbasetemp()
    cache = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one cache for all xdist workers
    return child_env(cpu_only=True, PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(cache / "jax_cache_train"),
                     JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "models.train", *map(str, args)]


def _losses(out: Path) -> dict[int, float]:
    return train.read_metrics(out / "metrics.jsonl")[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_state(step_dir: Path) -> dict:
    """A checkpoint's training state as numpy arrays, whatever devices saved it."""
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(step_dir / "state")
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    return ckptr.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=args))


# ----------------------------------------------------------------------------- model


def test_named_configs_shapes_without_memory():
    """The planning shapes are exact (Llama 3 8B has 8.03e9 parameters) and never allocated."""
    abstract = llama.abstract_model("llama3-8b")
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == llama.param_count(llama.CONFIGS["llama3-8b"]) == 8_030_261_248
    assert llama.param_count(llama.CONFIGS["llama3-70b"]) == 70_553_706_496
    with pytest.raises(ValueError, match=r"model='llama3-7b' is unknown; choose one of"):
        llama.get_config("llama3-7b")


def _batch(mesh, B=2, S=32, seed=0, docs=True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (B, S + 1))
    if docs:
        tokens[:, S // 3] = data_lib.EOD
    fields = data_lib.pack(tokens.reshape(-1).astype(np.uint16), np.arange(B) * (S + 1), S)
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    return {k: jax.device_put(v, sharding) for k, v in fields.items()}


def _loss_and_grads(model, batch):
    fn = nnx.jit(nnx.value_and_grad(llama.next_token_loss, has_aux=True))
    (loss, _), grads = fn(model, batch)
    return float(loss), nnx.to_pure_dict(grads)


def _assert_same_loss_and_grads(got, want, name):
    """``_loss_and_grads`` results equal at the float32 tolerance (gradients: atol scaled by each leaf's size)."""
    tol = TOL[jnp.dtype(jnp.float32)]
    (loss_g, grads_g), (loss_w, grads_w) = got, want
    np.testing.assert_allclose(loss_g, loss_w, **tol)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads_g), jax.tree.leaves(grads_w), strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=f"{name} {path}")


@needs_devices(8)
def test_remat_and_fsdp_change_nothing_but_memory():
    """Remat plus FSDP over dp, and FSDP over dp and the CP axes (weights gathered by explicit all-gathers,
    their gradients reduce-scattered), give the loss and gradients of the plain model (float32)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, tp=2, dp=2, axis_types=AxisType.Auto)
    cfg = llama.CONFIGS["tiny"]
    batch = _batch(mesh, B=4)
    variants = {"plain": {}, "remat+fsdp": dict(remat=True, fsdp=True),
                "fsdp over dp+cp": dict(fsdp=True, fsdp_axes=llama.FSDP_AXES)}
    results, models = {}, {}
    for name, kw in variants.items():
        with jax.set_mesh(mesh):
            models[name] = nnx.jit(lambda: llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0), **kw))()
            results[name] = _loss_and_grads(models[name], batch)
    DC = ("dp", "cp_colossal")  # cp_ulysses has size 1: not among the storage axes
    for name, stored in (("remat+fsdp", ("dp", "dp")), ("fsdp over dp+cp", (DC, DC))):
        m = models[name]
        for w, spec in ((m.blocks[0].mlp.w_gate, P(stored[0], "tp")), (m.blocks[0].attn.q_kernel, P(stored[0], "tp", None)),
                        (m.embed, P("tp", stored[1]))):
            assert w[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), w.ndim), (name, w[...].sharding.spec, spec)
    # The gradient of a weight stored over dp and cp is a reduce-scatter over both (the gather's transpose).
    fn = nnx.jit(nnx.value_and_grad(llama.next_token_loss, has_aux=True))
    hlo = fn.lower(models["fsdp over dp+cp"], batch).compile().as_text()
    assert "reduce-scatter(" in hlo or "reduce-scatter-start(" in hlo
    # The residual stream is split over tp along D: each layer's attention and MLP reduce-scatter their
    # [2, 16, 128] output sums to [2, 16, 64] forward and the input gradients backward (2 x 2 x 2; on CPU
    # the MLP keeps its tokens in one piece); the only whole-width activation sums left are the head's and
    # the embedding's.
    found = re.findall(r"= f32\[([0-9,]*)\][^ ]* (all-reduce|reduce-scatter)(?:-start)?\(", hlo)
    assert found.count(("2,16,64", "reduce-scatter")) == 2 * 2 * 2, found
    assert found.count(("2,16,128", "all-reduce")) <= 2, found
    for name in ("remat+fsdp", "fsdp over dp+cp"):
        _assert_same_loss_and_grads(results[name], results["plain"], name)


@needs_devices(8)
@pytest.mark.parametrize("cap", [None, 5.0])
def test_loss_over_gathered_vocabulary_chunks_equals_the_whole_weight(cap):
    """``fused_cross_entropy(..., gather_axes=...)`` (FSDP stores the head's D split): the vocabulary taken 4
    chunks at a time, each gathered while the one before multiplies and its gradient reduce-scattered a step
    later (the backward two groups of tokens at a time), gives the loss and the gradients (h's, and each
    device's block of the weight's) of the whole weight gathered at once (float32, vocabulary split over tp,
    soft cap or none)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, tp=2, dp=2, axis_types=AxisType.Auto)
    rng = np.random.default_rng(0)
    B, S, D, V = 4, 16, 32, 64
    h = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    weights = jnp.asarray(rng.random((B, S)) > 0.2, jnp.float32)
    axes = ("dp", "cp_colossal")
    tokens = P("dp", ("cp_colossal", "cp_ulysses"))

    def loss(gathered):
        def nll(h, labels, weights, w):
            if gathered:  # 16 tokens x 8 columns of float32 logits a chunk: V/tp = 32 columns in 4 chunks, and
                # the backward's float32 dh (16 x 32) in 2 groups of tokens
                local = llama.fused_cross_entropy(h, w, labels, weights, cap=cap, gather_axes=axes,
                                                  chunk_bytes=2 * 8 * 8 * 4)
            else:
                local = llama.fused_cross_entropy(h, jax.lax.all_gather(w, axes, axis=0, tiled=True), labels,
                                                  weights, cap=cap)
            return jax.lax.psum(local, ("dp", "cp_colossal", "cp_ulysses"))

        specs = (P("dp", ("cp_colossal", "cp_ulysses"), None), tokens, tokens, P(axes, "tp"))
        return lambda h, w: jax.shard_map(nll, mesh=mesh, in_specs=specs, out_specs=P())(h, labels, weights, w)

    want, want_g = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1)))(h, w)
    tol = TOL[jnp.dtype(jnp.float32)]
    for how, f in (("jit", jax.jit), ("eager", lambda f: f)):  # jax.grad under jit, and outside it
        got, got_g = f(jax.value_and_grad(loss(True), argnums=(0, 1)))(h, w)
        np.testing.assert_allclose(got, want, **tol, err_msg=how)
        for a, b, name in zip(got_g, want_g, ("h", "w")):
            np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * float(np.abs(b).max()),
                                       err_msg=f"{how} {name}")
    assert float(np.abs(want_g[1]).min()) > 0  # every column's gradient reached


@needs_devices(8)
def test_mlp_token_pieces_equal_one_piece(monkeypatch):
    """The MLP's tp collectives in ``TP_CHUNKS`` token pieces (what it runs off CPU; here the platform check
    answers "tpu") give the loss and gradients of the model with one piece, and of one device (float32)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    one = jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto)
    cfg = llama.CONFIGS["tiny"]
    results = {}
    for name, m, platform in (("pieces", mesh, "tpu"), ("one piece", mesh, "cpu"), ("one device", one, "cpu")):
        monkeypatch.setattr(llama, "_platform", lambda _mesh, platform=platform: platform)
        batch = _batch(m, B=2)
        with jax.set_mesh(m):
            model = nnx.jit(lambda m=m: llama.Llama(cfg, mesh=m, dtype=jnp.float32, rngs=nnx.Rngs(0)))()
        results[name] = _loss_and_grads(model, batch)
        if name == "pieces":  # a device's 8 tokens: the attention's sums over tp [2, 8, 64], the MLP's in two
            # pieces of 4 tokens, forward and backward, in each of the 2 layers
            hlo = nnx.jit(nnx.value_and_grad(llama.next_token_loss, has_aux=True)).lower(model, batch).compile()
            found = re.findall(r"= f32\[([0-9,]*)\][^ ]* reduce-scatter(?:-start)?\(", hlo.as_text())
            assert found.count("2,8,64") == 2 * 2 and found.count("2,4,64") == 2 * 2 * llama.TP_CHUNKS, found
    _assert_same_loss_and_grads(results["pieces"], results["one piece"], "pieces")
    _assert_same_loss_and_grads(results["pieces"], results["one device"], "pieces vs one device")


@needs_devices(8)
def test_fsdp_embedding_is_never_gathered():
    """FSDP stores the embedding table split along D: the lookup all-gathers the group's tokens (ints) and
    hands each device its rows by one all-to-all, so no collective materialises the table's tp block
    (float32 [V/tp, D]); loss and gradients equal the plain model's (float32; an untied head)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, tp=2, dp=2, axis_types=AxisType.Auto)
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], tie_embeddings=False)
    batch = _batch(mesh, B=4)
    results = {}
    for name, kw in {"plain": {}, "fsdp": dict(fsdp=True, fsdp_axes=llama.FSDP_AXES)}.items():
        with jax.set_mesh(mesh):
            model = nnx.jit(lambda kw=kw: llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0), **kw))()
        results[name] = _loss_and_grads(model, batch)
    assert model.embed[...].sharding.is_equivalent_to(NamedSharding(mesh, P("tp", ("dp", "cp_colossal"))), 2)
    hlo = nnx.jit(nnx.value_and_grad(llama.next_token_loss, has_aux=True)).lower(model, batch).compile().as_text()
    V, D = cfg.vocab_size, cfg.d_model
    table = re.findall(rf"= f32\[{V // 2},{D}\][^ ]* (?:all-gather|all-reduce)", hlo)
    assert not table, table
    assert re.search(r"= s32\[4,2,16\][^ ]* all-gather", hlo)  # the 2 x 2 group's tokens, [4 devices, B', S']
    _assert_same_loss_and_grads(results["fsdp"], results["plain"], "fsdp")


@needs_devices(8)
def test_causal_across_documents_and_devices():
    """A token's logits do not depend on later tokens, nor on other packed documents."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: llama.Llama(llama.CONFIGS["tiny"], mesh=mesh, dtype=jnp.float32,
                                            rngs=nnx.Rngs(0)))()
    batch = _batch(mesh, B=2)
    fwd = nnx.jit(lambda m, b: m(b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"]))
    changed = dict(batch)
    t = 20  # in the second document (the first ends at 32 // 3 = 10)
    changed["tokens"] = batch["tokens"].at[:, t:].set((batch["tokens"][:, t:] + 1) % 256)
    a, b = np.asarray(fwd(model, batch)), np.asarray(fwd(model, changed))
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-3
    first_doc = dict(batch)
    first_doc["tokens"] = batch["tokens"].at[:, :5].set(7)
    c = np.asarray(fwd(model, first_doc))
    np.testing.assert_array_equal(a[:, 11:], c[:, 11:])  # document 2 never sees document 1


# ----------------------------------------------------------------------------- data


def test_pack_positions_segments_weights():
    stream = np.array([1, 2, data_lib.EOD, 3, 4, 5, data_lib.EOD, 6, 7], np.uint16)
    f = data_lib.pack(stream, np.array([0, 1]), 6)
    np.testing.assert_array_equal(f["tokens"][0], [1, 2, data_lib.EOD, 3, 4, 5])
    np.testing.assert_array_equal(f["labels"][0], [2, data_lib.EOD, 3, 4, 5, data_lib.EOD])
    np.testing.assert_array_equal(f["segment_ids"][0], [1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(f["positions"][0], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(f["weights"][0], [1, 1, 0, 1, 1, 1])  # EOD -> next document: not a target
    np.testing.assert_array_equal(f["positions"][1], [0, 1, 0, 1, 2, 3])  # restarts at the window start
    assert tuple(f) == data_lib.FIELDS and {k: v.dtype for k, v in f.items()} == data_lib.FIELD_DTYPES


def test_prefix_lm_spans_and_weights():
    """Each document's first quarter (at least one token) is its prompt: one span id per document, and
    no loss on a label that is still prompt."""
    stream = np.array([1, 2, 3, 4, 5, 6, 7, data_lib.EOD, 8, 9, 10, data_lib.EOD, 11], np.uint16)
    f = data_lib.prefix_lm(data_lib.pack(stream, np.array([0]), 12), 0.25)
    np.testing.assert_array_equal(f["segment_ids"][0], [1] * 8 + [2] * 4)
    np.testing.assert_array_equal(f["span_ids"][0], [2, 2, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0])
    np.testing.assert_array_equal(f["weights"][0], [0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0])  # EOD: 0 as before
    with pytest.raises(ValueError, match=r"fraction=1.5 must be in \(0, 1\)"):
        data_lib.prefix_lm(f, 1.5)


@needs_devices(8)
def test_prefix_lm_trains_like_one_device(short_docs, tmp_path):
    """``--prefix-lm``: on a (2,2,2) mesh in the dispatch order (span ids reordered with the tokens)
    the losses equal one device's, and differ from plain next-token training; steps run the dispatch
    plan's Attended exchange, whose blocks follow the spans too."""
    common = dict(model="tiny", seq_len=128, batch=2, steps=3, warmup=1, dtype="float32", data=str(short_docs),
                  checkpoint_every=0, eval_batches=0, progress=False)
    cp = train.run(train.TrainConfig(cp_colossal=2, cp_ulysses=2, tp=2, prefix_lm=0.3, out=str(tmp_path / "cp"),
                                     **common))
    one = train.run(train.TrainConfig(prefix_lm=0.3, out=str(tmp_path / "one"), **common), devices=jax.devices()[:1])
    plain = train.run(train.TrainConfig(out=str(tmp_path / "plain"), **common), devices=jax.devices()[:1])
    steps = sorted(one["losses"])
    np.testing.assert_allclose([cp["losses"][s] for s in steps], [one["losses"][s] for s in steps],
                               **TOL[jnp.dtype(jnp.float32)])
    assert abs(plain["losses"][1] - one["losses"][1]) > 1e-3
    assert any(name.startswith("attended(") for name in cp["kv_exchange_steps"]), cp["kv_exchange_steps"]


@needs_devices(8)
def test_global_batch_is_the_balanced_order_of_the_windows(corpus):
    """Per-process assembly gives the load-balanced order of the same rows; the order depends on seed and step."""
    c = data_lib.load_corpus(corpus)
    assert c.num_docs == 12 and len(c.eval) > 0 and len(c.train) > 0
    windows = data_lib.Windows(c.train, 32, seed=3)
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, axis_types=AxisType.Auto)
    order = np.asarray(jax_cp.load_balance.positions(32, mesh))
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    got = data_lib.make_global_batch(windows, 5, 4, sharding, order=order)
    want = windows.rows(5, 4, np.arange(4))
    for k in data_lib.FIELDS:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k][:, order], err_msg=k)
        assert got[k].sharding.is_equivalent_to(sharding, 2)
    again = data_lib.Windows(c.train, 32, seed=3).rows(5, 4, np.arange(4))
    np.testing.assert_array_equal(again["tokens"], want["tokens"])
    other = data_lib.Windows(c.train, 32, seed=4).rows(5, 4, np.arange(4))
    assert not np.array_equal(other["tokens"], want["tokens"])


def _short_windows(short_docs, seq_len=32) -> data_lib.Windows:
    return data_lib.Windows(data_lib.load_corpus(short_docs).train, seq_len, seed=0)


@needs_devices(8)
def test_global_batch_in_the_dispatch_order_of_each_row(short_docs, monkeypatch):
    """A per-row order ``[B, S]`` (a dispatch plan's ``perm``) puts each row's columns in its own order:
    the batch equals the natural rows reordered by the ``Dispatch``. The trainer plans each dp shard on
    its own and builds the batch in those plans' order. A process holding one dp shard and some
    sequence columns (the multi-process path, with the process's indices substituted) plans its shard
    as the whole batch's planning does and builds exactly its slice of the global batch."""
    windows = _short_windows(short_docs)
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, axis_types=AxisType.Auto)
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    B, S = 4, 32
    natural = windows.rows(5, B, np.arange(B))
    dispatch = jax_cp.load_balance.plan(natural["segment_ids"], mesh, positions=natural["positions"])
    assert len({r.tobytes() for r in dispatch.perm}) == B, "each row should have its own order"
    want, positions = dispatch.reorder(natural)
    np.testing.assert_array_equal(want["positions"], positions)
    got = data_lib.make_global_batch(windows, 5, B, sharding, order=dispatch.perm)
    for k in data_lib.FIELDS:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
        assert got[k].sharding.is_equivalent_to(sharding, 2) and got[k].dtype == data_lib.FIELD_DTYPES[k]

    plans = data_lib.plan_rows(natural, mesh, np.arange(B), B)
    assert [d.perm.shape for d in plans] == [(2, S), (2, S)]
    shard_want = [d.reorder({k: natural[k][2 * i : 2 * i + 2] for k in natural})[0] for i, d in enumerate(plans)]
    dual = np.asarray(jax_cp.load_balance.positions(S, mesh))
    setup = train.Setup(mesh, windows, windows, "dispatch", dual, sharding)
    trained, balance = train.global_batch(setup, windows, 5, B)
    for k in data_lib.FIELDS:
        np.testing.assert_array_equal(np.asarray(trained[k]), np.concatenate([w[k] for w in shard_want]), err_msg=k)
    fixed = jax_cp.load_balance.fixed(natural["segment_ids"], mesh, positions=natural["positions"])
    np.testing.assert_array_equal(fixed.perm, np.broadcast_to(dual, (B, S)))
    # the state slots a hybrid model's linear layers need for the batch as built (train.check_linear_slots)
    slots = tuple(jax_cp.linear.needed_pieces(np.asarray(trained["positions"]), np.asarray(trained["segment_ids"]),
                                                  ranks) for ranks in (2, 4))
    assert balance == {"imbalance": max(d.imbalance() for d in plans), "imbalance_dual_chunk": fixed.imbalance(),
                       "kv_exchange": None, "slots": slots}  # kv_exchange: the setup asks for none per batch

    rows, cols = np.array([2, 3]), np.arange(8, 24)  # dp shard 1; the columns of CP devices 1 and 2
    monkeypatch.setattr(data_lib, "_process_indices", lambda sharding, shape: (rows, cols))
    built = []
    monkeypatch.setattr(jax, "make_array_from_process_local_data", lambda sharding, local, shape: built.append(local))
    local = windows.rows(5, B, rows)
    (mine,) = data_lib.plan_rows(local, mesh, rows, B)
    np.testing.assert_array_equal(mine.perm, plans[1].perm)
    data_lib.place(local, sharding, B, order=mine.perm)
    for k, piece in zip(data_lib.FIELDS, built, strict=True):
        np.testing.assert_array_equal(piece, shard_want[1][k][:, cols], err_msg=k)
    with pytest.raises(ValueError, match=r"rows=\[1, 2\] are not whole dp shards of 2 rows \(batch=4, dp=2\)"):
        data_lib.plan_rows(windows.rows(5, B, np.array([1, 2])), mesh, np.array([1, 2]), B)


def test_dispatch_chunks_reach_each_batch_plan(short_docs, tmp_path):
    """``--dispatch-chunks`` (hybrid models: 4 by default, whose linear layers pass a state per chunk that
    continues a document elsewhere; else the plan's 8) sets the chunks per colossal rank of each batch's
    plan: the batch comes in that plan's order. An odd or too small value is refused."""
    windows = _short_windows(short_docs)
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, axis_types=AxisType.Auto)
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    B, S = 4, 32
    natural = windows.rows(5, B, np.arange(B))
    dual = np.asarray(jax_cp.load_balance.positions(S, mesh))
    for chunks in (4, 8):
        plans = data_lib.plan_rows(natural, mesh, np.arange(B), B, chunks_per_rank=chunks)
        assert [d.chunks.shape for d in plans] == [(2, 2 * chunks)] * 2  # c = 2 ranks of `chunks` each
        want = [d.reorder({k: natural[k][2 * i : 2 * i + 2] for k in natural})[0] for i, d in enumerate(plans)]
        setup = train.Setup(mesh, windows, windows, "dispatch", dual, sharding, dispatch_chunks=chunks)
        got, _ = train.global_batch(setup, windows, 5, B)
        for k in data_lib.FIELDS:
            np.testing.assert_array_equal(np.asarray(got[k]), np.concatenate([w[k] for w in want]), err_msg=k)
    assert not np.array_equal(*(np.concatenate([d.perm for d in data_lib.plan_rows(natural, mesh, np.arange(B), B,
                                                                                    chunks_per_rank=n)])
                                for n in (4, 8))), "4 and 8 chunks a rank should order these rows differently"
    run = dict(cp_colossal=2, cp_ulysses=2, tp=2, seq_len=S, data=str(short_docs), out=str(tmp_path))
    assert train.setup(train.TrainConfig(model="hybrid-tiny", **run)).dispatch_chunks == 4
    assert train.setup(train.TrainConfig(model="hybrid-tiny", dispatch_chunks=8, **run)).dispatch_chunks == 8
    assert train.setup(train.TrainConfig(model="tiny", **run)).dispatch_chunks is None  # the plan's own 8
    for bad in (3, 0):
        with pytest.raises(ValueError, match=rf"--dispatch-chunks={bad} must be an even integer >= 2"):
            train.TrainConfig(model="hybrid-tiny", dispatch_chunks=bad, **run)


# ----------------------------------------------------------------------------- training


class _CountCompiles(logging.Handler):
    """Counts the compiles of a function named ``train_step`` while ``jax.log_compiles`` is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += bool(re.match(r"Compiling (jit\()?train_step\b", record.getMessage()))


@needs_devices(8)
def test_dispatch_plan_balances_packed_rows_and_trains_like_dual_chunk(short_docs, tmp_path):
    """On packed rows, per step: the dispatch plan leaves the slowest CP rank <= 1.05x the mean attention
    work and the dual-chunk order more, both logged; the step compiles once though every batch has its
    own order; and the losses (train and held-out, float32) are the dual-chunk order's: each label
    travels with its token, and attention takes the reordered per-document positions."""
    common = dict(model="tiny", seq_len=32, batch=2, steps=4, warmup=1, dtype="float32", data=str(short_docs),
                  cp_colossal=2, cp_ulysses=2, tp=2, checkpoint_every=0, eval_batches=1, eval_every=0,
                  progress=False)
    counter = _CountCompiles()
    logging.getLogger("jax").addHandler(counter)
    try:
        with jax.log_compiles():
            planned = train.run(train.TrainConfig(out=str(tmp_path / "dispatch"), **common))
    finally:
        logging.getLogger("jax").removeHandler(counter)
    assert counter.count == 1, f"the step compiled {counter.count} times"
    assert planned["step_compiles"] == 1  # what the run's closing line reports
    dual = train.run(train.TrainConfig(balance="dual-chunk", out=str(tmp_path / "dual"), **common))
    records = {name: [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                      if r["event"] == "train"] for name in ("dispatch", "dual")}
    planned_imb = [r["imbalance"] for r in records["dispatch"]]
    dual_imb = [r["imbalance_dual_chunk"] for r in records["dispatch"]]
    assert len(planned_imb) == 4 and max(planned_imb) <= 1.05, planned_imb
    assert np.mean(dual_imb) > np.mean(planned_imb) and max(dual_imb) > 1.05, (dual_imb, planned_imb)
    assert [r["imbalance"] for r in records["dual"]] == [r["imbalance_dual_chunk"] for r in records["dual"]] == dual_imb
    assert planned["balance"] == "dispatch" and planned["imbalance_mean"] == pytest.approx(np.mean(planned_imb))
    assert planned["imbalance_dual_chunk_mean"] == pytest.approx(np.mean(dual_imb))
    tol = TOL[jnp.dtype(jnp.float32)]
    steps = sorted(dual["losses"])
    np.testing.assert_allclose([planned["losses"][s] for s in steps], [dual["losses"][s] for s in steps], **tol)
    np.testing.assert_allclose(planned["eval_loss"], dual["eval_loss"], **tol)


@needs_devices(8)
def test_dispatch_steps_run_the_batch_attended_exchange(short_docs, tmp_path):
    """Dispatch order with kv_exchange auto: a step whose batch's plan leaves each rank needing only some of
    the other's K/V blocks runs that plan's Attended exchange (the trainer logs the value it chose), and
    its loss equals the all-gather's on the same batch and parameters (the steps before it run the same
    program in both runs); the step compiles once per exchange value and the closing line counts them."""
    common = dict(model="tiny", seq_len=128, batch=2, steps=3, warmup=1, seed=2, dtype="float32",
                  data=str(short_docs), cp_colossal=2, cp_ulysses=2, tp=2, checkpoint_every=0, eval_batches=0,
                  progress=False)
    cfg = train.TrainConfig(out=str(tmp_path / "attended"), **common)
    s = train.setup(cfg)
    wanted = [train.global_batch(s, s.train_windows, step, 2)[1]["kv_exchange"] for step in range(3)]
    assert any(isinstance(w, jax_cp.exchanges.Attended) for w in wanted), wanted  # None: every key (auto)
    for step, want in enumerate(wanted):
        if want is None:
            continue
        batch, _ = train.global_batch(s, s.train_windows, step, 2)
        need = jax_cp.exchanges.attended.needed_blocks(np.asarray(batch["positions"]),
                                                       np.asarray(batch["segment_ids"]), 2, want.block, is_causal=True,
                                                       query_block=want.query_block)
        per_device = need.sum(axis=0)  # [receiver, sender]: both rows on every device (dp = 1)
        assert 0 < max(per_device.sum(0).max(), per_device.sum(1).max()) <= want.capacity
        assert want.received_tokens() < 2 * 128 // 2  # less than the all-gather brings each device
    counter = _CountCompiles()
    logging.getLogger("jax").addHandler(counter)
    try:
        with jax.log_compiles():
            attended = train.run(cfg)
    finally:
        logging.getLogger("jax").removeHandler(counter)
    gathered = train.run(train.TrainConfig(kv_exchange="all_gather", out=str(tmp_path / "gathered"), **common))
    records = map(json.loads, (tmp_path / "attended" / "metrics.jsonl").read_text().splitlines())
    logged = [r["kv_exchange"] for r in records if r["event"] == "train"]
    names = ["auto" if w is None else str(w) for w in wanted]
    assert logged == names and attended["kv_exchange_steps"] == {n: names.count(n) for n in names}
    assert counter.count == attended["step_compiles"] == len(set(wanted))
    assert gathered["kv_exchange_steps"] == {"all_gather": 3} and gathered["step_compiles"] == 1
    assert "Attended exchange per batch" in train._exchange_line(attended)
    assert "--kv-exchange all_gather" in train._exchange_line(gathered)
    np.testing.assert_allclose([attended["losses"][i] for i in (1, 2, 3)], [gathered["losses"][i] for i in (1, 2, 3)],
                               **TOL[jnp.dtype(jnp.float32)])


@needs_devices(8)
def test_at_most_four_exchanges_a_run(short_docs):
    """Over 100 packed batches the plans want a handful of exchange values (the ragged transport's
    capacities are powers of two); wanting more (``ppermute`` buffers), the trainer still runs at most
    ``MAX_EXCHANGES`` = 4 (so 4 compiled steps), each holding every block its batch needs."""
    cfg = train.TrainConfig(model="tiny", seq_len=128, batch=2, cp_colossal=2, cp_ulysses=2, tp=2,
                            data=str(short_docs), checkpoint_every=0)
    s = train.setup(cfg)
    batches = [train.global_batch(s, s.train_windows, step, 2)[1]["kv_exchange"] for step in range(100)]
    assert len(set(batches)) <= train.MAX_EXCHANGES == 4, set(batches)
    wanted = [None if ex is None else jax_cp.exchanges.Attended(block=ex.block, sizes=(1 + i % 5,))  # five values
              for i, ex in enumerate(batches)]
    cap = train._ExchangeCap()
    chosen = [cap(ex) for ex in wanted]
    assert len(set(wanted)) > train.MAX_EXCHANGES >= len(set(chosen)) and None in chosen, set(wanted)
    for want, got in zip(wanted, chosen):
        serves = want is None or got is None or got.holds(want)
        assert serves and (got is None) >= (want is None), (want, got)


@needs_devices(8)
def test_cp_equals_no_cp(corpus, tmp_path):
    """Same seed and data: 5 steps on a (cp_colossal=2, cp_ulysses=2, tp=2) mesh, load-balanced, with
    two head chunks per layer (the first with Q, K and V in one all-to-all), and on one device give
    the same losses (float32 compute)."""
    common = dict(model="tiny", seq_len=32, batch=2, steps=5, warmup=1, dtype="float32", data=str(corpus),
                  checkpoint_every=0, eval_batches=0, progress=False)
    cp = train.run(train.TrainConfig(cp_colossal=2, cp_ulysses=2, tp=2, overlap_chunks=2, fused_qkv_chunks=1,
                                     out=str(tmp_path / "cp"), **common))
    one = train.run(train.TrainConfig(out=str(tmp_path / "one"), **common), devices=jax.devices()[:1])
    assert cp["mesh"] == {"dp": 1, "c": 2, "u": 2, "t": 2} and one["mesh"] == {"dp": 1, "c": 1, "u": 1, "t": 1}
    steps = sorted(one["losses"])
    assert steps == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([cp["losses"][s] for s in steps], [one["losses"][s] for s in steps],
                               **TOL[jnp.dtype(jnp.float32)])
    assert one["losses"][5] < one["losses"][1]
    assert (tmp_path / "cp" / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(corpus, cache_env, tmp_path):
    """SIGKILL after a checkpoint (and a save cut short), then --resume: same losses and parameters, bit for bit."""
    args = [*SMALL, *HYBRID, "--devices", "8", "--steps", "6", "--checkpoint-every", "2", "--data", corpus]
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(_cli(*args, "--out", full), env=cache_env, cwd=ROOT, check=True, timeout=300,
                   capture_output=True)
    proc = subprocess.Popen(_cli(*args, "--out", cut, "--debug-step-sleep", "1"), env=cache_env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (cut / "checkpoints" / "2").is_dir():  # renamed into place only once complete
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    done = sorted(int(p.name) for p in (cut / "checkpoints").iterdir() if p.name.isdigit())
    assert done and done[-1] < 6, done
    # What a kill during the next save leaves behind: a temporary directory, never the step's own name.
    partial = cut / "checkpoints" / f"{done[-1] + 2}.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True, exist_ok=True)
    (partial / "state" / "truncated").write_bytes(b"\0" * 7)
    res = subprocess.run(_cli(*args, "--out", cut, "--resume"), env=cache_env, cwd=ROOT, timeout=300,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    starts = [r for r in (cut / "metrics.jsonl").read_text().splitlines() if '"start"' in r]
    assert f'"step": {done[-1]},' in starts[-1]
    assert _losses(cut) == _losses(full) and sorted(_losses(full)) == [1, 2, 3, 4, 5, 6]
    a, b = _load_state(full / "checkpoints" / "6"), _load_state(cut / "checkpoints" / "6")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=str(path))


TWO = [*SMALL, *HYBRID, "--steps", "4", "--dtype", "float32"]


def _two_processes(args, out, env, extra=()):
    port = _free_port()
    common = [*args, "--devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
              "--heartbeat-timeout", "10", "--out", out, *extra]
    return [subprocess.Popen(_cli(*common, "--process-id", i), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in (0, 1)]


@pytest.mark.slow
@needs_devices(8)
def test_two_processes_equal_one(short_docs, cache_env, tmp_path):
    """2 processes x 4 CPU devices (gloo over loopback) train exactly like 1 process x 8 devices, on packed
    rows: each process holds half of every row's columns and plans the rows as the one process does."""
    args = [*TWO, "--checkpoint-every", "2", "--data", short_docs]
    procs = _two_processes(args, tmp_path / "two", cache_env)
    one = train.run(train.parse_args([*map(str, args), "--out", str(tmp_path / "one"), "--checkpoint-every", "0",
                                      "--eval-batches", "0"]))
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        if jax.__version_info__ >= (0, 12, 1):  # a program loaded from the cache hangs in its first collective
            assert "persistent compilation cache off" in out, out[-3000:]
    two = _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one["losses"][s] for s in sorted(two)],
                               **TOL[jnp.dtype(jnp.float32)])
    assert (tmp_path / "two" / "checkpoints" / "4").is_dir()  # both processes wrote one shared checkpoint


@pytest.mark.slow
def test_a_dead_process_fails_the_other(corpus, cache_env, tmp_path):
    """SIGKILL one of two processes mid-run: the other exits non-zero in bounded time, it does not hang."""
    args = [*TWO, "--checkpoint-every", "0", "--eval-batches", "0", "--data", corpus]  # the step compiled above
    procs = _two_processes(args, tmp_path / "run", cache_env, extra=["--debug-step-sleep", "2"])
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0][-2000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = procs[0].communicate(timeout=90)  # heartbeat timeout 10 s; a hang fails here
    procs[1].communicate()
    assert procs[0].returncode != 0
    assert time.monotonic() - t0 < 90
    assert re.search(r"another task died|unhealthy|heartbeat|[Cc]onnection (closed|reset)", out), out[-3000:]


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "30", *HYBRID], r"--seq-len=30 is not divisible by cp_colossal\*cp_ulysses=2\*2=4"),
    (["--seq-len", "36", *HYBRID], r"--seq-len=36 is not divisible by 2\*cp_colossal\*cp_ulysses=8"),
    (["--model", "gpt5"], r"--model='gpt5' is unknown; choose one of \['llama3-70b', 'llama3-8b', 'tiny'\]"),
    (["--data", "/nonexistent/corpus"], r"--data /nonexistent/corpus: no such file or folder"),
    (["--warmup", "400"], r"--warmup=400 must be smaller than --steps=300"),
    (["--tp", "0"], r"--tp=0 must be a positive integer"),
    (["--overlap-chunks", "0"], r"--overlap-chunks=0 must be a positive integer"),
    (["--coordinator", "localhost:1"], r"multi-process runs need all of --coordinator"),
    (["--plan", "v5e:2x4", "--devices", "8"], r"--plan v5e:2x4 compiles one step for the topology's own devices "
                                              r"in this one process and trains nothing; drop --devices, --resume"),
    (["--plan", "v5e:2x4", "--resume"], r"--plan v5e:2x4 compiles one step .* drop --devices, --resume"),
    (["--logits-soft-cap", "0"], r"--logits-soft-cap=0.0 must be > 0 \(or left out: no cap\)"),
    (["--prefix-lm", "1"], r"--prefix-lm=1.0 must be in \(0, 1\)"),
    (["--balance", "zigzag"], r"argument --balance: invalid choice: 'zigzag' \(choose from '?dispatch'?, "
                              r"'?dual-chunk'?\)"),
    (["--fsdp", "--fsdp-axes", "dp,tp"], r"--fsdp-axes=dp,tp: fsdp_axes=\('dp', 'tp'\) must be distinct names among "
                                         r"\('dp', 'cp_colossal', 'cp_ulysses'\)"),
])
def test_bad_flags_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m models.train: error: "), err
    assert re.search(message, err), err


def test_fsdp_auto_shards_what_is_worth_sharding():
    """--fsdp auto (the default) stores parameters and moments sharded over dp and the CP axes where,
    replicated, they would take FSDP_AUTO_BYTES or more a device; --fsdp and --no-fsdp decide alone."""
    dims = jax_cp.MeshDims(dp=1, c=4, u=4, t=4)
    big = train.TrainConfig(model="llama3-8b", seq_len=32768, batch=4, cp_colossal=4, cp_ulysses=4, tp=4)
    fsdp, why = train.fsdp_choice(big, dims)
    params = llama.param_count(llama.CONFIGS["llama3-8b"])
    assert fsdp and f"take {12 * params / 4 / 2**30:.2f} GiB a device replicated over dp,cp_colossal,cp_ulysses " \
        f"(16 devices), {12 * params / 4 / 16 / 2**30:.2f} GiB sharded" in why, why
    tiny = train.TrainConfig(cp_colossal=2, cp_ulysses=2, tp=2)
    fsdp, why = train.fsdp_choice(tiny, jax_cp.MeshDims(dp=1, c=2, u=2, t=2))
    assert not fsdp and "under 256 MiB: replicated" in why, why
    assert train.fsdp_choice(big, jax_cp.MeshDims(dp=1, c=1, u=1, t=4)) == (
        False, "auto: the --fsdp-axes dp,cp_colossal,cp_ulysses have one device")
    assert train.parse_args(["--fsdp"]).fsdp is True and train.parse_args(["--no-fsdp"]).fsdp is False
    assert train.parse_args([]).fsdp == "auto"
    assert train.fsdp_choice(dataclasses.replace(big, fsdp=False), dims) == (False, "--no-fsdp")
    with pytest.raises(ValueError, match=r"fsdp='yes' must be True \(--fsdp\), False \(--no-fsdp\) or 'auto'"):
        train.TrainConfig(fsdp="yes")


def test_attention_flags_reach_every_layer():
    """--logits-soft-cap and --use-sinks set the model's attention (every layer's spec); unset, the
    model's own configuration stands."""
    cfg = train.parse_args(["--logits-soft-cap", "30", "--use-sinks"])
    spec = train.model_config(cfg).attention
    assert (cfg.logits_soft_cap, cfg.use_sinks, spec.logits_soft_cap, spec.use_sinks) == (30.0, True, 30.0, True)
    plain = train.model_config(train.parse_args([])).attention
    assert (plain.logits_soft_cap, plain.use_sinks) == (None, False)


@needs_devices(8)
@pytest.mark.parametrize("argv,message", [
    (["--cp-colossal", "2", "--cp-ulysses", "2", "--tp", "3"], r"cp_colossal\*cp_ulysses\*tp=12 does not divide the 8"),
    (["--dp", "4", "--tp", "2", "--batch", "6"], r"--batch=6 is not divisible by dp=4"),
    (["--kv-exchange", "carrier_pigeon"], r"kv_exchange='carrier_pigeon' must be one of"),
    (["--overlap-chunks", "2", "--fused-qkv-chunks", "3"], r"fused_qkv_chunks=3 must be an integer from 0 to "
                                                           r"overlap_chunks=2"),
    (["--model", "llama3-70b"], r"--model='llama3-70b' does not fit a CPU; train --model tiny here"),
])
def test_flags_that_need_the_devices(argv, message, capsys):
    """Checked after JAX starts (device count, head divisibility), still one line and exit code 2."""
    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--no-progress", "--out", "/nonexistent/never-written"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m models.train: error: "), err
    assert re.search(message, err), err


def test_cli_degrees_not_matching_devices():
    """The real command line: a wrong mesh for --devices exits 2 with one line, no traceback."""
    res = subprocess.run(_cli("--devices", "4", *HYBRID), cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=child_env(cpu_only=True))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "python -m models.train: error: cp_colossal*cp_ulysses*tp=8 does not divide the 4 devices; "
        "choose degrees whose product divides 4."
    ], res.stderr


# ----------------------------------------------------------------------------- planning


PLAN = dict(model="tiny", seq_len=2048, batch=2, cp_colossal=2, cp_ulysses=2, tp=2, kv_exchange="all_to_all",
            overlap_chunks=2, kernel="blockwise", scan_layers=False)  # unrolled: every layer's collectives
# (the scanned default's plan: tests/test_scan_layers.py)


def test_plan_one_training_step_for_a_tpu_topology(monkeypatch, capsys):
    """plan_train_step: the whole step (2 layers, AdamW, clipping) compiled for v5e:2x4 ahead of time;
    nothing allocated. Arguments hold at least every parameter, moment and batch shard, and the state
    is donated as in training (aliased: counted once in the peak); each layer's exchanges appear
    forward and backward, and tp's backward activation collectives run inside matmuls (v5e's all-reduce
    continuation fusion, a recommended flag; on a second compile without it, none does). dK/dV travel
    in bf16 (one kv head's K and V a chunk): at this toy size three of the four dK/dV all-to-alls have
    compute inside, with the flag or without. Then the CLI on the same step (``_check_plan_cli``,
    handed this compile instead of a second one)."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    from jax_cp import plan

    cfg = train.TrainConfig(**PLAN)
    a = train.plan_train_step(cfg, "v5e:2x4")
    mesh = plan.topology_mesh("v5e:2x4", cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    with jax.set_mesh(mesh):
        params = nnx.state(llama.abstract_model("tiny", mesh), nnx.Param)
    shard_bytes = sum(np.prod(NamedSharding(mesh, x.sharding.spec).shard_shape(x.shape)) * x.dtype.itemsize
                      for x in jax.tree.leaves(params))
    batch_bytes = 5 * 2 * 2048 // 4 * 4  # five [B, S] int32/float32 fields, S split over cp (4)
    m = a.memory
    assert m.arguments >= 3 * shard_bytes + batch_bytes and m.total >= m.arguments and m.fits
    assert m.aliased >= 3 * shard_bytes  # parameters and both AdamW moments alias the new state
    assert a.flops > 0 and a.estimate.step_s > 0
    assert not a.kernel_calls and a.executed_flops is None  # blockwise: the compiler counts every FLOP
    cp = {ph: a.schedule.select(ph) for ph in ("fwd", "bwd")}
    both = ("cp_colossal", "cp_ulysses")
    a2a = {ph: [c.axes for c in cs if c.kind == "all-to-all"] for ph, cs in cp.items()}
    assert a2a["fwd"].count(("cp_ulysses",)) == 2 * 2 * 2  # layers x chunks x (Q, output)
    assert a2a["bwd"].count(("cp_ulysses",)) == 2 * 2 * 2  # layers x chunks x (output gradient, Q gradient)
    assert a2a["bwd"].count(both) == 2 * 2  # layers x chunks: dK/dV over both CP axes
    assert both in a2a["fwd"] and not any(c.kind == "reduce-scatter" for ph in cp for c in cp[ph])
    assert 0 < a.overlap("fwd") < a.overlap("bwd") <= 1
    tp_bwd = _tp_sums(a, "bwd")
    assert tp_bwd and any(c.overlapped for c in tp_bwd), [(c.bytes, c.is_async) for c in tp_bwd]
    fused_sums = "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true"
    flags = plan.recommended_xla_flags("tpu", chip="v5e")
    assert fused_sums in flags
    plain = train.plan_train_step(cfg, "v5e:2x4", xla_flags=tuple(f for f in flags if f != fused_sums))
    for step in (a, plain):
        dkdv = [c for c in step.schedule.select("bwd") if c.kind == "all-to-all" and c.axes == both]
        assert [c.bytes for c in dkdv] == [2 * 2048 * 2 * 16 * 2] * 4  # B S (K, V) d, bf16: layers x chunks
        # one of the first layer's two (the last of the backward pass) has no compute beside it in this
        # 2-layer step (float32 dK/dV, twice the bytes, were all placed under matmuls)
        assert sum(c.overlapped for c in dkdv) == 3, [c.compute_inside for c in dkdv]
    assert not any(c.overlapped for c in plain.schedule.collectives if c.kind == "all-reduce")
    _check_plan_cli(a, monkeypatch, capsys)


def test_planned_step_overlaps_the_gradient_sums_on_v5p():
    """The tiny step planned for v5p:2x2x2 with the recommended flags: the gradient sums of the weights
    replicated over the CP axes (all-reduces over cp_colossal and cp_ulysses that no matmul consumes)
    run asynchronously, offloaded to the SparseCores, and the largest has matmuls of the backward
    scheduled between the update that hands it its data and its done. The layers' tp collectives are
    all-gathers and reduce-scatters (the residual stream is split over tp), and the backward's all-gathers
    have matmuls inside (the forward ones do not: each feeds the next matmul at once; the TPU runs the
    reduce-scatters synchronously). (libtpu 0.0.52 runs
    every all-reduce synchronously on the TensorCore otherwise: benchmarks/RESULTS.md, "A whole
    training step".)"""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    from jax_cp import plan

    flags = plan.recommended_xla_flags("tpu", chip="v5p")
    assert "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true" in flags
    cfg = train.TrainConfig(**{**PLAN, "kv_exchange": "auto", "overlap_chunks": "auto", "fsdp": False})
    assert train.xla_flags_for(cfg, "v5p") == flags  # replicated: without the FSDP flags
    a = train.plan_train_step(cfg, "v5p:2x2x2")
    grads = [c for c in a.schedule.collectives if c.kind == "all-reduce" and c.phase == "bwd" and c.bytes > 0
             and c.axes == ("cp_colossal", "cp_ulysses") and not c.feeds_compute]
    assert len(grads) >= 2 and all(c.is_async for c in grads), [(c.bytes, c.is_async) for c in grads]
    largest = max(grads, key=lambda c: c.bytes)
    assert largest.overlapped and largest.flops_inside, largest
    hidden = sum(c.bytes for c in grads if c.overlapped) / sum(c.bytes for c in grads)
    assert hidden >= 0.5, [(c.bytes, c.compute_inside) for c in grads]
    # The residual stream is split over tp: each layer all-gathers its input and reduce-scatters its output
    # (no all-reduce over tp in a layer): the attention once, the MLP in TP_CHUNKS token pieces; the
    # backward's all-gathers (the reduce-scatters' transposes) all have matmuls inside.
    tp = _tp_sums(a, "bwd")
    per_layer = 1 + llama.TP_CHUNKS
    layer_ag = [c for c in tp if c.kind == "all-gather" and c.op_name.endswith("shard_map/all_gather")]
    assert len(layer_ag) == 2 * per_layer and all(c.overlapped for c in layer_ag), [
        (c.bytes, c.overlapped) for c in tp]
    layer_rs = [c for c in tp if c.kind == "reduce-scatter" and c.op_name.endswith("shard_map/reduce_scatter")]
    assert len(layer_rs) == 2 * per_layer
    # the vocabulary head's input gradient: its sum over tp (TPU's all-reduce-scatter fusion, read as a reduce-scatter)
    head = [c for c in tp if c not in layer_rs and c.kind in ("all-reduce", "reduce-scatter")]
    assert len(head) <= 1 and all(c.op_name.endswith("psum_invariant") for c in head), tp


def _tp_sums(analysis, phase):
    """tp's activation collectives of ``phase`` in a planned step (all-reduces, all-gathers and
    reduce-scatters over tp of 64 KiB or more)."""
    return [c for c in analysis.schedule.select(phase, cp_only=False)
            if c.kind in ("all-reduce", "all-gather", "reduce-scatter") and c.axes == ("tp",) and c.bytes >= 2**16]


def _check_plan_cli(analysis, monkeypatch, capsys):
    """``python -m models.train --plan TOPOLOGY``: the report instead of a run; a bad topology is one
    line. When the CLI asks for the step ``TrainConfig(**PLAN)`` describes on v5e:2x4, it is handed
    that step's compiled ``analysis``; any other request (the bad ones) runs the real planner."""
    asked, real = [], train.plan_train_step

    def planned(cfg, topology=None, **kw):
        asked.append(cfg)
        same = cfg.plan == "v5e:2x4" and all(getattr(cfg, k) == v for k, v in PLAN.items())
        return analysis if same and topology is None and not kw else real(cfg, topology, **kw)

    monkeypatch.setattr(train, "plan_train_step", planned)
    flags = [f"--{k.replace('_', '-')}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no-'}{k.replace('_', '-')}"
             for k, v in PLAN.items()]
    train.main(["--plan", "v5e:2x4", *flags, "--out", "/nonexistent/never-written"])
    assert len(asked) == 1 and all(getattr(asked[0], k) == v for k, v in PLAN.items()), asked
    out = capsys.readouterr().out
    for needle in ("one training step of tiny on v5e:2x4 (TPU v5 lite)", "kv_exchange=all_to_all overlap_chunks=2",
                   "memory: total (peak)", "fits HBM budget 16.00 GiB", "overlap fraction bwd",
                   "train step tiny", "cp_colossal,cp_ulysses"):
        assert needle in out, out
    # grouped collectives: the 2 layers x 2 chunks dK/dV all-to-alls on one line, all 4 asynchronous
    assert re.search(r"\* bwd\s+all-to-all\s+cp_colossal,cp_ulysses\s+\S+ \S+\s+4\s+4\s+\d+\n", out), out
    assert not Path("/nonexistent/never-written").exists()
    for argv, message in [(["--plan", "v5e:3x3", *flags], "not a TPU topology libtpu knows"),
                          (["--plan", "v5p:4x4x4", "--cp-colossal", "8", "--tp", "8"],
                           "cp_colossal=8, cp_ulysses=1, tp=8 (dp=1) does not map onto the v5p:4x4x4 torus"),
                          (["--plan", "v5e:2x4", "--cp-colossal", "2", "--batch", "3"],
                           "--batch=3 is not divisible by dp=4; use a multiple of 4.")]:
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@needs_devices(8)
def test_soft_capped_model_with_sinks_trains_like_one_device():
    """``LlamaConfig(logits_soft_cap=..., use_sinks=True)`` reaches every layer: 3 Adam steps on a
    (2,2,2) mesh give the one-device losses (float32), the loss falls, the cap changes the loss, and
    the sinks are trained (they leave zero)."""
    import dataclasses

    import optax

    cfg = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=1, logits_soft_cap=0.5, use_sinks=True)
    assert cfg.attention.logits_soft_cap == 0.5 and cfg.attention.use_sinks
    trained_sinks = []

    def losses(mesh, cfg):
        batch = _batch(mesh, B=2)
        with jax.set_mesh(mesh):
            model = nnx.jit(lambda: llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0)))()
            opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

            @nnx.jit
            def step(model, opt, batch):
                (loss, _), grads = nnx.value_and_grad(llama.next_token_loss, has_aux=True)(model, batch)
                opt.update(model, grads)
                return loss

            out = [float(step(model, opt, batch)) for _ in range(3)]
            trained_sinks.append(np.asarray(model.blocks[0].attn.sinks[...]))
            return out

    cp = losses(jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto), cfg)
    one = losses(jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto), cfg)
    np.testing.assert_allclose(cp, one, **TOL[jnp.dtype(jnp.float32)])
    assert cp[-1] < cp[0]
    uncapped = losses(jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto),
                      dataclasses.replace(cfg, logits_soft_cap=None))
    assert abs(uncapped[1] - one[1]) > 1e-4
    np.testing.assert_allclose(trained_sinks[0], trained_sinks[1], **TOL[jnp.dtype(jnp.float32)])
    assert np.abs(trained_sinks[0]).max() > 1e-3


def test_splash_flops_count_the_visible_pairs():
    """The planned step's splash FLOPs: per attention layer, 2 d per visible (query, key) pair, head
    and matmul (forward 2, remat 2, backward 7), the pairs counted here from jax_cp.visibility (a causal
    layer and a sliding one), split over dp, cp_colossal and tp * cp_ulysses; linear layers add none."""
    import dataclasses
    import types

    S, W, d = 16, 5, 8
    causal = int(jax_cp.visibility(1, S, is_causal=True).sum())
    sliding = int(jax_cp.visibility(1, S, is_causal=True, local_window_size=(W - 1, 0)).sum())
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=2, num_heads=4, head_dim=d, sliding_window=W,
                              sliding_layers=(False, True))
    dims = jax_cp.MeshDims(dp=2, c=2, u=2, t=1)
    run = types.SimpleNamespace(seq_len=S, batch=4, remat=True, remat_policy="full")
    per_pair = 11 * 2 * d * (4 / 2) * (4 / 2) / 2  # matmuls, 2d, rows per dp shard, heads per device, / c
    assert train.splash_flops(run, cfg, dims) == pytest.approx(per_pair * (causal + sliding))
    for remat, policy in ((False, "full"), (True, "attention")):  # no rerun of the forward kernels
        other = types.SimpleNamespace(seq_len=S, batch=4, remat=remat, remat_policy=policy)
        assert train.splash_flops(other, cfg, dims) == pytest.approx(per_pair * 9 / 11 * (causal + sliding))
    hybrid_cfg = hybrid.get_config("hybrid-tiny")  # layers 0-2 linear, 3 attention
    one = train.splash_flops(run, dataclasses.replace(hybrid_cfg, num_layers=4), dims)
    assert one == pytest.approx(11 * 2 * hybrid_cfg.head_dim * 2 * hybrid_cfg.num_heads / 2 / 2 * causal)


def test_planned_step_with_splash_counts_its_kernels():
    """The same step with splash kernels (v5e:2x4): the compiler gives Pallas kernels no FLOPs, so the
    estimate's compute adds train.splash_flops to the compiler's count."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    from jax_cp import plan

    cfg = train.TrainConfig(**(PLAN | dict(kernel="splash", kv_exchange="auto", overlap_chunks="auto")))
    a = train.plan_train_step(cfg, "v5e:2x4")
    assert a.kernel_calls, a.kernel  # splash ran
    dims = jax_cp.MeshDims(dp=1, c=2, u=2, t=2)
    assert a.executed_flops == a.flops + train.splash_flops(cfg, train.model_config(cfg), dims) > a.flops
    assert a.estimate.compute_s == pytest.approx(a.executed_flops / plan.chip_for("v5e:2x4").device_flops)


def test_planned_step_keeping_the_attention_runs_each_forward_kernel_once():
    """``--remat-policy attention`` on the same splash step (v5e:2x4, remat), which ``auto`` (the default)
    takes here (the step fits the chip): the compiled program runs each layer's forward kernels once, where
    full remat runs them twice (the rerun in the backward pass), and the backward kernels as often; the
    planner's executed FLOPs lose the rerun's."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    auto = train.TrainConfig(**(PLAN | dict(kernel="splash", kv_exchange="auto", overlap_chunks="auto", remat=True)))
    assert auto.remat_policy == "auto"
    full = dataclasses.replace(auto, remat_policy="full")
    a, b = train.plan_train_step(full, "v5e:2x4"), train.plan_train_step(auto, "v5e:2x4")
    assert a.label.endswith("remat=full") and b.label.endswith("remat=attention"), (a.label, b.label)
    calls = lambda p: {name.rsplit("_", 1)[1]: n for name, n in p.kernel_calls}
    assert calls(a)["fwd"] == 2 * calls(b)["fwd"] > 0
    assert (calls(a)["dq"], calls(a)["dkv"]) == (calls(b)["dq"], calls(b)["dkv"]) != (0, 0)
    dims = jax_cp.MeshDims(dp=1, c=2, u=2, t=2)
    rerun = train.splash_flops(full, train.model_config(full), dims) * 2 / 11  # 2 of the 11 kernel matmuls
    assert a.executed_flops - b.executed_flops == pytest.approx(rerun, rel=1e-3)


def test_auto_remat_takes_the_first_policy_whose_step_fits(monkeypatch):
    """``--remat-policy auto``: attention, full, offload in turn, the first whose step fits (``resolve_remat``
    with any ``fits``; ``plan_train_step`` with the planner's analysis against the chip's budget, or the
    compiler's out-of-HBM refusal); full where the device states no limit (a CPU, ``_step_fits``); a
    policy named, or no ``--remat``, as given."""
    cfg = train.TrainConfig(model="tiny", remat=True)
    for fitting, chosen in (({"attention", "full", "offload"}, "attention"), ({"full", "offload"}, "full"),
                            ({"offload"}, "offload"), (set(), "offload")):
        asked = []
        c, why = train.resolve_remat(cfg, lambda c: asked.append(c.remat_policy) or c.remat_policy in fitting)
        assert c.remat_policy == chosen and asked == list(train.AUTO_REMAT[:asked.index(chosen) + 1]), (asked, why)
        assert ("none of" in why) == (not fitting), why
    c, why = train.resolve_remat(cfg, lambda c: None)
    assert c.remat_policy == "full" and "no memory limit" in why
    for given in (dataclasses.replace(cfg, remat_policy="attention"), train.TrainConfig(model="tiny")):
        assert train.resolve_remat(given, lambda c: pytest.fail("asked"))[0] is given
    mesh = jax_cp.make_mesh(cp_colossal=2, axis_types=AxisType.Auto, devices=jax.devices()[:2])
    assert train._memory_limit(mesh) is None and train._step_fits(cfg, mesh) is None  # a CPU states no limit
    small = dataclasses.replace(cfg, seq_len=64, batch=2, cp_colossal=2, remat_policy="full")
    for limit, fits in ((2**40, True), (2**10, False)):  # the compiled step's memory against a device's limit
        monkeypatch.setattr(train, "_memory_limit", lambda mesh: limit)
        assert train._step_fits(small, mesh) is fits

    from jax_cp import plan

    memory = lambda total: types.SimpleNamespace(memory=plan.Memory(  # noqa: E731
        arguments=total, outputs=0, temporaries=0, aliased=0, code=0, peak=0, budget=100))
    planned = {"attention": memory(120), "full": memory(90), "offload": memory(50)}
    compiled, refused = [], {"attention"}

    def plan_one(c, topology, budget, flags):
        compiled.append(c.remat_policy)
        if c.remat_policy in refused:  # as the TPU compiler refuses a program over HBM
            raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {c.remat_policy} ran out of memory in hbm")
        return planned[c.remat_policy]

    monkeypatch.setattr(train, "_plan_one", plan_one)
    assert train.plan_train_step(cfg, "v5e:2x4") is planned["full"] and compiled == ["attention", "full"]
    compiled.clear()
    planned["full"] = memory(110)
    assert train.plan_train_step(cfg, "v5e:2x4") is planned["offload"] and compiled == ["attention", "full", "offload"]
    compiled.clear()
    refused.add("offload")  # none fits: the last policy's refusal, compiled once
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED: offload ran out"):
        train.plan_train_step(cfg, "v5e:2x4")
    assert compiled == ["attention", "full", "offload"]
    assert train.planned_remat("train step tiny remat=offload") == "offload"
    assert train.planned_remat("train step tiny") is None
