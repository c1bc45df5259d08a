"""``--scan-layers``: a model's blocks as one ``lax.scan`` over their stacked parameters (``Llama._scanned``)
give the loop's loss and gradients, with FSDP storage and remat, on Auto and Explicit meshes, for Llama
and the hybrid model (a scan over groups of a DeltaNet and an attention layer, and the layer left over)."""
import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jax_cp
from conftest import needs_devices
from models import hybrid, llama, train
from util import TOL


def _loss(name, layers, mesh, scan_layers, remat):
    """``(loss(state), state)`` of a small float32 model with FSDP storage, built under ``mesh``."""
    cfg = dataclasses.replace(hybrid.get_config(name), num_layers=layers)
    if isinstance(cfg, hybrid.HybridConfig):  # DeltaNet, attention, ...: two groups of two, then a DeltaNet
        cfg = dataclasses.replace(cfg, full_attention_interval=2)
    B, S = 2, 64
    rng = np.random.default_rng(0)
    batch = dict(tokens=rng.integers(0, 256, (B, S)), labels=rng.integers(0, 256, (B, S)),
                 positions=np.tile(np.arange(S), (B, 1)), segment_ids=(np.arange(S) >= 40)[None].repeat(B, 0),
                 weights=np.ones((B, S), np.float32))
    batch = {k: v.astype(np.float32 if k == "weights" else np.int32) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        model = hybrid.model_class(cfg)(cfg, mesh=mesh, dtype=jnp.float32, fsdp=True, remat=remat,
                                        fsdp_axes=("dp", "cp_colossal", "cp_ulysses"), scan_layers=scan_layers,
                                        rngs=nnx.Rngs(0))
        graph, state = nnx.split(model)

    def loss(state):
        return llama.next_token_loss(nnx.merge(graph, state), batch)[0]

    return loss, state


def _loss_and_grads(name, layers, mesh, scan_layers, remat, jit=True):
    loss, state = _loss(name, layers, mesh, scan_layers, remat)
    with jax.set_mesh(mesh):
        if not jit:  # eagerly: jax.grad outside jit
            return jax.value_and_grad(loss)(state), None
        step = jax.jit(jax.value_and_grad(loss))
        text = step.lower(state).as_text()
        return step(state), text


@needs_devices(8)
@pytest.mark.parametrize("name,layers,axis_types,remat", [("tiny", 2, AxisType.Auto, True),
                                                          ("hybrid-tiny", 5, AxisType.Explicit, False)])
def test_scanned_blocks_equal_the_loop(name, layers, axis_types, remat):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=axis_types)
    (loss, grads), looped = _loss_and_grads(name, layers, mesh, False, remat)
    (loss_s, grads_s), scanned = _loss_and_grads(name, layers, mesh, True, remat)
    tol = TOL[jnp.dtype(jnp.float32)]
    np.testing.assert_allclose(float(loss_s), float(loss), **tol)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
        assert a.shape == b.shape  # the gradient tree keeps one entry per layer
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    # groups of blocks (tiny: 2 of one block; the hybrid: 2 of a DeltaNet and an attention, and a DeltaNet
    # after them): the scan's program holds one group's layers, so fewer CP all-to-alls than the loop's
    assert 0 < scanned.count("all_to_all") < looped.count("all_to_all")


@needs_devices(8)
def test_scanned_blocks_equal_the_loop_eagerly():
    """The scan run eagerly (the gradient outside jit), tiny with FSDP and remat on (2, 2, 2): the jitted
    loop's loss and gradients (float32 tolerances; the model's residual stream is float32 or bfloat16,
    so there is no float64 path). The loop is jitted to keep the test short: eager dispatch is slow."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    (loss, grads), _ = _loss_and_grads("tiny", 2, mesh, False, True)
    (loss_s, grads_s), _ = _loss_and_grads("tiny", 2, mesh, True, True, jit=False)
    tol = TOL[jnp.dtype(jnp.float32)]
    np.testing.assert_allclose(float(loss_s), float(loss), **tol)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


def test_layer_period_is_the_shortest_repeating_pattern():
    a, b = "attention", "sliding"
    assert llama.layer_period([a, a, a, a]) == 1
    assert llama.layer_period([b, b, a, b, b, a]) == 3  # Gemma 3's 5:1 is the same with 6
    assert llama.layer_period([a, b, b, b]) == 4  # no repeating pattern: one group
    assert llama.layer_period([b, a, b, b]) == 3  # one group of three, then a layer
    assert llama.layer_period([b, b, a, b, b, a, b, b]) == 3  # two groups, then two layers one by one


def test_the_scanned_step_plans_one_layer_in_a_loop():
    """``models.train``'s default step (the blocks scanned) planned for v5e:2x4: the CP all-to-alls of the
    layers are scheduled in the scan's body, once per iteration (the 2 layers of tiny), asynchronous
    with compute inside; the step fits and its estimate counts the body's trips. 8K tokens: at 2K the bf16
    dK/dV all-to-all of a layer's first chunk is small enough that jax 0.12's schedule leaves it empty."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    from models import train

    cfg = train.TrainConfig(model="tiny", seq_len=8192, batch=2, cp_colossal=2, cp_ulysses=2, tp=2,
                            kv_exchange="all_to_all", overlap_chunks=2, kernel="blockwise")
    assert cfg.scan_layers
    a = train.plan_train_step(cfg, "v5e:2x4")
    a2a = [c for c in a.schedule.collectives if c.kind == "all-to-all" and c.bytes > 0]
    assert a2a and all(c.in_loop and c.iterations == 2 for c in a2a), [(c.in_loop, c.iterations) for c in a2a]
    both = ("cp_colossal", "cp_ulysses")
    dkdv = [c for c in a2a if c.phase == "bwd" and c.axes == both]
    assert len(dkdv) == 2 and all(c.is_async and c.overlapped for c in dkdv)  # one layer x 2 chunks
    assert a.memory.fits and a.estimate.step_s > 0


@needs_devices(8)
def test_a_bfloat16_residual_stream_is_what_the_scan_carries():
    """``residual_dtype=bfloat16`` (``--residual-dtype``): the scan carries the residual in bfloat16 (half of
    what remat keeps a layer), and the loss and gradients on (2, 2, 2) equal one device's with the same
    stream, at bfloat16 tolerances; any other dtype is a ValueError naming the choices."""
    cfg = hybrid.get_config("tiny")
    B, S = 2, 64
    rng = np.random.default_rng(1)
    batch = {k: rng.integers(0, 256, (B, S)).astype(np.int32) for k in ("tokens", "labels")}
    batch |= dict(positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)), segment_ids=np.zeros((B, S), np.int32),
                  weights=np.ones((B, S), np.float32))
    out = {}
    for name, devices, layout in (("cp", 8, dict(cp_colossal=2, cp_ulysses=2, tp=2)), ("one", 1, {})):
        mesh = jax_cp.make_mesh(devices=jax.devices()[:devices], axis_types=AxisType.Auto, **layout)
        with jax.set_mesh(mesh):
            model = llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, remat=True, scan_layers=True,
                                residual_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            graph, state = nnx.split(model)

            def loss(state):
                return llama.next_token_loss(nnx.merge(graph, state), batch)[0]

            if name == "cp":
                scans = [e for e in jax.make_jaxpr(loss)(state).jaxpr.eqns if e.primitive.name == "scan"]
                stream = [a.dtype for e in scans for a in e.params["jaxpr"].in_avals if a.shape == (B, S, cfg.d_model)]
                assert stream and all(d == jnp.bfloat16 for d in stream), stream  # the carried residual stream
            out[name] = jax.jit(jax.value_and_grad(loss))(state)
    tol = TOL[jnp.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(float(out["cp"][0]), float(out["one"][0]), **tol)
    for a, b in zip(jax.tree.leaves(out["cp"][1]), jax.tree.leaves(out["one"][1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    with pytest.raises(ValueError, match=r"residual_dtype=float16 must be float32 or bfloat16"):
        llama.Llama(cfg, mesh=jax_cp.make_mesh(devices=jax.devices()[:1]), residual_dtype=jnp.float16,
                    rngs=nnx.Rngs(0))
    # The trainer's --residual-dtype auto (the default) follows the compute dtype: bfloat16 for a bfloat16 run.
    assert train.TrainConfig().residual_dtype == "auto"
    assert [train.residual_dtype(train.TrainConfig(dtype=d, residual_dtype=r)) for d, r in (
        ("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "float32"), ("float32", "bfloat16"))] == [
        "bfloat16", "float32", "float32", "bfloat16"]


def test_the_scanned_step_sums_its_layer_outputs_over_tp_in_bfloat16(monkeypatch):
    """Scanned, FSDP, remat, two head chunks, v5p, a float32 residual stream: every reduce-scatter over tp in
    the scan's body (the attention's and the MLP's outputs, the residual stream split over tp; the MLP in one
    piece here) moves bfloat16 ``[B, S/cp, D]``. Unfenced, the TPU compiler widens the attention's two-chunk
    sum to float32 before its reduce-scatter (the residual add after it is float32): twice the bytes;
    ``CPAttention`` fences the sum's dtype."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    monkeypatch.setattr(llama, "TP_CHUNKS", 1)
    cfg = train.TrainConfig(model="tiny", seq_len=2048, batch=2, cp_colossal=2, cp_ulysses=2, tp=2, fsdp=True,
                            remat=True, remat_policy="full", kv_exchange="auto", overlap_chunks=2,
                            kernel="blockwise", residual_dtype="float32")
    a = train.plan_train_step(cfg, "v5p:2x2x2")
    rs = [c for c in a.schedule.collectives if c.axes == ("tp",) and c.kind == "reduce-scatter" and c.in_loop]
    d_model = llama.get_config("tiny").d_model
    assert len(rs) >= 4 and {c.bytes for c in rs} == {2 * cfg.batch * cfg.seq_len // 4 * d_model}, \
        [(c.bytes, c.phase, c.op_name) for c in rs]


def test_the_mlp_hides_its_tp_collectives_under_its_token_pieces():
    """Scanned, FSDP, remat, v5p: the MLP runs its tp all-gather and reduce-scatter in ``TP_CHUNKS`` = 2
    token pieces (half of ``[B, S/cp, D]``, bfloat16), and the TPU schedule puts matmuls of one piece
    inside the other's collectives (with the tokens in one piece, no tp collective of the scan's body has a
    matmul inside); no collective of the body gathers the mask metadata."""
    pytest.importorskip("libtpu", reason="plans compile with the libtpu wheel's TPU compiler")
    cfg = train.TrainConfig(model="tiny", seq_len=2048, batch=2, cp_colossal=2, cp_ulysses=2, tp=2, fsdp=True,
                            remat=True, remat_policy="full", kv_exchange="auto", overlap_chunks=2,
                            kernel="blockwise")
    a = train.plan_train_step(cfg, "v5p:2x2x2")
    half = 2 * cfg.batch * cfg.seq_len // 4 * llama.get_config("tiny").d_model // llama.TP_CHUNKS
    pieces = [c for c in a.schedule.collectives if c.axes == ("tp",) and c.in_loop and c.bytes == half
              and c.kind in ("all-gather", "reduce-scatter")]
    assert {c.kind for c in pieces} == {"all-gather", "reduce-scatter"}, pieces
    assert sum(c.overlapped for c in pieces) >= 3, [(c.kind, c.phase, c.overlapped) for c in pieces]
    # The mask metadata (positions, segment ids: whole rows on every device) are gathered once for the step,
    # outside the loop: every all-gather in the loop's body is one the model issues (an FSDP weight's, tp's).
    # Gathered in the layers instead, each rematerialised layer of the backward gathers them again (16 MiB twice
    # a layer at 4M tokens on Ironwood's 128 devices).
    gathers = [c for c in a.schedule.collectives if c.in_loop and c.kind == "all-gather"]
    assert gathers and all(c.op_name.endswith("shard_map/all_gather") for c in gathers), \
        [(c.bytes, c.phase, c.op_name) for c in gathers if not c.op_name.endswith("shard_map/all_gather")]


def _as_full_remat(scan_layers: bool, remat: str, capsys) -> dict:
    """Tiny on (2, 2, 2) with ``remat`` gives full remat's loss and gradients (float32 tolerances); returns
    what the backward pass reads from the forward under each (``print_saved_residuals``' lines, counted)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    (loss, grads), _ = _loss_and_grads("tiny", 2, mesh, scan_layers, True)
    (loss_r, grads_r), _ = _loss_and_grads("tiny", 2, mesh, scan_layers, remat)
    tol = TOL[jnp.dtype(jnp.float32)]
    np.testing.assert_allclose(float(loss_r), float(loss), **tol)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    kept = {}
    for r in (True, remat):
        f, state = _loss("tiny", 2, mesh, scan_layers, r)
        with jax.set_mesh(mesh):
            jax.ad_checkpoint.print_saved_residuals(f, state)
        kept[r] = collections.Counter(capsys.readouterr().out.splitlines())
    return kept


@needs_devices(8)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_keeping_the_attention_equals_full_remat(scan_layers, capsys):
    """``remat="attention"`` (``--remat-policy attention``) keeps each block's attention output and
    log-sum-exp (named ``jax_cp.ATTENTION_RESIDUALS`` inside the kernels) from the forward pass: tiny on
    (2, 2, 2), scanned and looped, gives full remat's loss and gradients (float32 tolerances), and what the
    backward pass reads from the forward (``jax.ad_checkpoint.print_saved_residuals``) is full remat's and
    exactly those two arrays of every layer, B*S*H*d and B*S*H elements (stacked by the scan)."""
    kept = _as_full_remat(scan_layers, "attention", capsys)
    assert not kept[True] - kept["attention"]
    extra = kept["attention"] - kept[True]
    sizes = sorted(math.prod(map(int, line.split("[")[1].split("]")[0].split(","))) * n for line, n in extra.items())
    B, S, H, d, L = 2, 64, 8, 16, 2
    assert sizes == [B * S * H * L, B * S * H * d * L]  # each layer's pair (the scan's stacked): elements


def _saved_elements(lines: collections.Counter) -> tuple[int, int]:
    """``(device, host)`` elements of ``print_saved_residuals``'s lines (``f32<host>[...]``: host memory)."""
    out = [0, 0]
    for line, n in lines.items():
        shape = line.split("[")[1].split("]")[0]
        out["<host>" in line.split("[")[0]] += math.prod(int(x) for x in shape.split(",") if x) * n
    return out[0], out[1]


@needs_devices(8)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_offload_keeps_block_inputs_in_host_memory(scan_layers, capsys):
    """``remat="offload"`` (``--remat-policy offload``): full remat's loss and gradients (tiny on (2, 2, 2),
    scanned and looped), with what the backward pass reads from the forward moved, exactly every block's
    input (L x B x S x D elements), from device memory to ``pinned_host``; nothing else changes."""
    kept = {k: _saved_elements(v) for k, v in _as_full_remat(scan_layers, "offload", capsys).items()}
    B, S, D, L = 2, 64, 128, 2
    assert kept[True][1] == 0
    assert kept["offload"][1] == L * B * S * D
    assert kept[True][0] - kept["offload"][0] == L * B * S * D


def test_remat_policy_names_its_choices():
    with pytest.raises(ValueError, match=r"remat='everything' must be False, True, 'full', 'attention' or 'offload'"):
        llama.remat_policy("everything")
    assert [llama.remat_policy(r) for r in (False, True, "full", "attention", "offload")] == [
        None, "full", "full", "attention", "offload"]
    with pytest.raises(ValueError, match=r"--remat-policy=attention says what remat keeps; add --remat"):
        train.TrainConfig(remat_policy="attention")
    with pytest.raises(ValueError, match=r"--remat-policy='none' must be one of \('auto', 'full', 'attention', "
                                         r"'offload'\)"):
        train.TrainConfig(remat=True, remat_policy="none")


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_place_metadata_places_whole_rows_once(axis_types):
    """``jax_cp.place_metadata`` (what ``Llama.features`` calls before its layers): ``[B, S]`` metadata
    ``P(dp, None)``, ``[S]`` ones whole, ``None`` passed through, values unchanged, on either axis type."""
    mesh = jax_cp.make_mesh(dp=2, cp_colossal=2, cp_ulysses=2, axis_types=axis_types)
    P = jax.sharding.PartitionSpec
    pos = np.tile(np.arange(16, dtype=np.int32), (2, 1))
    seg = (np.arange(16) >= 5).astype(np.int32)
    with jax.set_mesh(mesh):
        row_sharded = jax.device_put(pos, jax.sharding.NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses"))))
        placed_pos, none, placed_seg = jax.jit(lambda p, s: jax_cp.place_metadata(mesh, p, None, s))(row_sharded, seg)
    assert none is None
    assert placed_pos.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("dp", None)), 2)
    assert placed_seg.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P()), 1)
    np.testing.assert_array_equal(np.asarray(placed_pos), pos)
    np.testing.assert_array_equal(np.asarray(placed_seg), seg)
    assert jax_cp.place_metadata(None, pos, None) == (pos, None)


def test_place_metadata_refuses_what_is_not_mask_metadata():
    mesh = jax_cp.make_mesh(dp=2, cp_colossal=4)
    with pytest.raises(ValueError, match=r"arrays\[1\].shape=\(2, 16, 1\): mask metadata are \[B, S\] or \[S\]"):
        jax_cp.place_metadata(mesh, np.zeros((2, 16), np.int32), np.zeros((2, 16, 1), np.int32))
    with pytest.raises(ValueError, match=r"arrays\[0\].dtype=float32: mask metadata are integers"):
        jax_cp.place_metadata(mesh, np.zeros((2, 16), np.float32))
