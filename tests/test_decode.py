"""Inference: CP prefill into a sequence-sharded KV cache, decode steps, the Linen twin, models.generate.

Every decode output is checked against the training path over the whole sequence (the same
layer: prefill-then-decode must give what one causal pass gives at every position), and the
Llama model's greedy decode on the 8 devices against the same weights on one device.
"""
import dataclasses
import pathlib
import subprocess
import sys

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_cp
from models import generate as gen_lib
from models import llama
from util import child_env

D = 32
TOL = 2e-5  # float32, highest matmul precision
F64_TOL = 1e-12  # float64 (x64): float32 arithmetic anywhere on the path would be ~1e-7 off


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _layer(c, u, t, *, H=8, K=2, seed=0, **kw):
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    m = jax_cp.CPAttention(H, D, num_kv_heads=K, head_dim=8, mesh=mesh, is_causal=True, rope_theta=1e4,
                           rngs=nnx.Rngs(seed), **kw)
    if kw.get("use_sinks"):
        m.sinks[...] = jax.random.normal(jax.random.key(7), (H,))
    return m


def _decode_vs_full(m, *, S, L, steps, T=1, lengths=None, window=None, batch=2, decode_window="same"):
    """Prefill ``S`` tokens (``lengths`` real per sequence), decode ``steps`` x ``T``; returns the largest
    difference to one training-path pass over each sequence's real tokens followed by its new ones.
    ``decode_window``: what the decode steps pass as ``local_window_size`` (``"same"``: ``window``)."""
    n = jax_cp.mesh_dims(m.mesh).cp
    x = jax.random.normal(jax.random.key(1), (batch, L, D))
    m.init_cache((batch, L))
    lens = np.full(batch, S) if lengths is None else np.asarray(lengths)
    y0 = m(x[:, :S], prefill=True, lengths=None if lengths is None else jnp.asarray(lens),
           local_window_size=window)
    decode_window = window if decode_window == "same" else decode_window
    ys = [m(x[:, S + i * T:S + (i + 1) * T], decode=True, local_window_size=decode_window) for i in range(steps)]
    assert [int(i) for i in m.cache_index[...]] == [int(v) + steps * T for v in lens]
    err = 0.0
    for b in range(batch):
        seq = jnp.concatenate([x[b, :lens[b]], x[b, S:S + steps * T]])
        seq = jnp.pad(seq, ((0, (-seq.shape[0]) % (2 * n)), (0, 0)))[None]
        ref = m(jnp.broadcast_to(seq, (batch,) + seq.shape[1:]), local_window_size=window)[0]
        err = max(err, float(jnp.abs(y0[b, :lens[b]] - ref[:lens[b]]).max()))
        for i, y in enumerate(ys):
            at = lens[b] + i * T
            err = max(err, float(jnp.abs(y[b] - ref[at:at + T]).max()))
    return err


@pytest.mark.parametrize("mesh,kw,run", [
    ((1, 4, 2), dict(K=2), dict(lengths=[16, 5])),                         # Ulysses x tp, GQA
    ((4, 1, 2), dict(K=1), dict(lengths=[11, 16])),                        # all-gather x tp, MQA
    ((2, 2, 2), dict(K=2), dict(lengths=[3, 16], T=2)),                    # hybrid x tp, two tokens a step
    ((4, 2, 1), dict(K=2, kv_exchange="ring"), dict(lengths=[9, 2])),      # ring x Ulysses
    ((2, 4, 1), dict(H=16, K=2, overlap_chunks=2, fused_qkv_chunks=2), {}),  # fused chunks, kv heads repeated
    ((4, 1, 2), dict(K=2, use_sinks=True, logits_soft_cap=3.0, use_qk_norm=True), dict(lengths=[7, 13])),
])
def test_decode_matches_the_full_sequence(mesh, kw, run):
    err = _decode_vs_full(_layer(*mesh, **kw), S=16, L=48, steps=5, **run)
    assert err < TOL, err


def test_decode_with_a_window_crossing_every_device():
    # 8 CP ranks, 24 decode steps: the new tokens go round-robin over every device, the window hides
    # the oldest keys (prompt ends mid-chunk: 13 of 16).
    m = _layer(8, 1, 1)
    assert _decode_vs_full(m, S=16, L=48, steps=24, lengths=[13, 16], window=6) < TOL
    pos = np.asarray(m.cached_positions[...])
    assert sorted(pos[0][pos[0] < jax_cp._decode.EMPTY].tolist()) == list(range(13 + 24))
    where = [divmod(int(np.flatnonzero(pos[0] == p)[0]), 6) for p in range(13, 13 + 24)]  # (rank, local slot)
    assert where == [((16 + i) % 8, (16 + i) // 8) for i in range(24)]  # decode token i: global slot 16 + i


def test_cache_is_sharded_over_the_sequence_and_kv_heads():
    m = _layer(2, 2, 2, K=2)
    m.init_cache((2, 32))
    k = m.cached_key[...]
    assert k.shape == (2, 32, 2, 8)
    assert k.sharding.shard_shape(k.shape) == (2, 8, 1, 8)  # L / (c*u), K / t
    mqa = _layer(2, 2, 2, K=1)
    mqa.init_cache((2, 32))
    assert mqa.cached_key[...].shape == (2, 32, 2, 8)  # the one kv head held by each tp rank


def test_linen_twin_decodes_as_the_nnx_module():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    m = jax_cp.linen.CPAttention(num_heads=8, in_features=D, num_kv_heads=2, mesh=mesh, is_causal=True,
                                 rope_theta=1e4)
    B, L, S = 2, 32, 16
    x = jax.random.normal(jax.random.key(1), (B, L, D))
    v = m.init(jax.random.key(0), jnp.zeros((B, L, D)), decode=True)
    assert v["cache"]["cached_key"].shape == (B, L, 2, 4)
    full = m.apply({"params": v["params"]}, x)
    y, cache = m.apply(v, x[:, :S], prefill=True, mutable=["cache"])
    errs = [jnp.abs(y - full[:, :S]).max()]
    for i in range(3):
        y, cache = m.apply({"params": v["params"], **cache}, x[:, S + i:S + i + 1], decode=True, mutable=["cache"])
        errs.append(jnp.abs(y[:, 0] - full[:, S + i]).max())
    assert max(float(e) for e in errs) < TOL


@pytest.mark.parametrize("call,match", [
    (lambda m, x: m(x[:, :4], decode=True), "decode needs a cache: call init_cache"),
    (lambda m, x: (m.init_cache((2, 16)), m(x[:1, :8], prefill=True)), r"batch=1 does not match the cache's batch=2"),
    (lambda m, x: (m.init_cache((2, 8)), m(x[:, :16], prefill=True)), r"seq_len=16 is longer than the cache's "
                                                                      "max_length=8"),
    (lambda m, x: (m.init_cache((2, 8)), m(x[:, :8], prefill=True), m(x[:, :1], decode=True)),
     r"decoding 1 more token\(s\) would overfill the cache: 8 of its max_length=8 slots are already written; "
     r"init_cache with max_length >= 12 \(the prompt and every token to decode, a multiple of "
     r"cp_colossal\*cp_ulysses=4\)"),
    (lambda m, x: m.init_cache((2, 10)), r"max_length=10 is not divisible by cp_colossal\*cp_ulysses=4"),
    (lambda m, x: (m.init_cache((2, 16)), m(x[:, :8], prefill=True, lengths=jnp.array([0, 8]))),
     r"lengths=\[0, 8\] must lie in \[1, seq_len=8\]"),
    (lambda m, x: (m.init_cache((2, 16)), m(x[:, :1], decode=True, positions=jnp.zeros((2, 1), jnp.int32))),
     "decode steps take their positions from the cache"),
    (lambda m, x: (m.init_cache((2, 16)), m(x[:, :8], x[:, :8], prefill=True)), "cross attention"),
])
def test_bad_inference_input_is_a_value_error(call, match):
    m = _layer(2, 2, 1)
    x = jnp.ones((2, 16, D))
    with pytest.raises(ValueError, match=match):
        call(m, x)


def test_nnx_view_switches_a_model_to_decode():
    m = _layer(2, 2, 2)
    x = jax.random.normal(jax.random.key(3), (2, 17, D))
    full = m(jnp.pad(x, ((0, 0), (0, 7), (0, 0))))
    m.init_cache((2, 24))
    m(x[:, :16], prefill=True)
    decoding = nnx.view(m, decode=True)  # flax's way: the static attribute, the same variables
    y = decoding(x[:, 16:17])
    assert decoding.decode and not m.decode and int(m.cache_index[...][0]) == 17
    assert float(jnp.abs(y[:, 0] - full[:, 16]).max()) < TOL
    fresh = nnx.view(_layer(2, 2, 2), decode=True, batch_size=2, max_length=24)
    assert fresh.cached_key.shape == (2, 24, 2, 8)
    with pytest.raises(ValueError, match=r"needs batch_size= and max_length="):
        nnx.view(_layer(2, 2, 2), decode=True)


def test_non_causal_layer_decodes_causally_as_flax():
    # flax decodes with a non-causal module (decode is causal by construction): the prefill is the
    # layer's own (bidirectional) forward; each decode token sees the prompt and the tokens before it,
    # which is what the causal layer with the same weights gives at that position.
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    m, causal = (jax_cp.CPAttention(8, D, num_kv_heads=2, mesh=mesh, is_causal=c, rope_theta=1e4, rngs=nnx.Rngs(0))
                 for c in (False, True))
    x = jax.random.normal(jax.random.key(4), (2, 24, D))
    m.init_cache((2, 24))
    y0 = m(x[:, :16], prefill=True)
    ys = [m(x[:, 16 + i:17 + i], decode=True) for i in range(3)]
    assert float(jnp.abs(y0 - m(x[:, :16])).max()) < TOL
    full = causal(x)
    assert max(float(jnp.abs(y[:, 0] - full[:, 16 + i]).max()) for i, y in enumerate(ys)) < TOL


def test_packed_prompt_prefill_and_decode_follow_the_training_path():
    # A packed prompt (two documents, per-document positions, then -1 padding): the prefill equals the
    # training path with the same segment ids, and decode continues the last document: each new token
    # equals the training path over the row with the new tokens appended to that document.
    for (c, u, t), kw in (((4, 2, 1), {}), ((2, 2, 2), dict(kv_exchange="ring"))):
        m = _layer(c, u, t, **kw)
        n, B, S, steps = jax_cp.mesh_dims(m.mesh).cp, 2, 16, 3
        x = jax.random.normal(jax.random.key(5), (B, S + steps, D))
        lens = [(6, 7), (5, 11)]  # documents per row; row 0 is padded after 13 tokens
        seg = np.full((B, S), -1, np.int32)
        pos = np.zeros((B, S), np.int32)
        for b, ls in enumerate(lens):
            seg[b, :sum(ls)] = np.repeat(np.arange(len(ls)), ls)
            pos[b, :sum(ls)] = np.concatenate([np.arange(L) for L in ls])
        m.init_cache((B, 32))
        y0 = m(x[:, :S], prefill=True, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
        ref0 = m(x[:, :S], segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
        assert float(jnp.abs(y0 - ref0).max()) < TOL
        assert [int(i) for i in m.cache_index[...]] == [ls[-1] for ls in lens]  # the last document's length
        ys = [m(x[:, S + i:S + i + 1], decode=True) for i in range(steps)]
        for b, ls in enumerate(lens):
            real = sum(ls)
            row = jnp.concatenate([x[b, :real], x[b, S:S + steps]])
            row_seg = np.concatenate([seg[b, :real], np.full(steps, len(ls) - 1)])
            row_pos = np.concatenate([pos[b, :real], ls[-1] + np.arange(steps)])
            pad = (-row.shape[0]) % (2 * n)
            row = jnp.pad(row, ((0, pad), (0, 0)))[None].repeat(B, 0)
            row_seg, row_pos = (jnp.asarray(np.pad(a, (0, pad), constant_values=v))[None].repeat(B, 0)
                                for a, v in ((row_seg, -1), (row_pos, 0)))
            ref = m(row, segment_ids=row_seg, positions=row_pos)[0]
            err = max(float(jnp.abs(y[b, 0] - ref[real + i]).max()) for i, y in enumerate(ys))
            assert err < TOL, ((c, u, t), b, err)


def test_right_padding_by_segment_ids_is_not_cached():
    # Segment id -1 marks padding at prefill as in training: the cache counts 9 real tokens, not 16,
    # and the next token attends to those 9 only (the same as lengths=9).
    m, by_len = _layer(4, 2, 1), _layer(4, 2, 1)
    x = jax.random.normal(jax.random.key(6), (2, 17, D))
    seg = jnp.asarray(np.where(np.arange(16) < 9, 0, -1)[None].repeat(2, 0).astype(np.int32))
    for layer, kw in ((m, dict(segment_ids=seg)), (by_len, dict(lengths=jnp.array([9, 9])))):
        layer.init_cache((2, 24))
        layer(x[:, :16], prefill=True, **kw)
    assert [int(i) for i in m.cache_index[...]] == [9, 9]
    y, y_len = m(x[:, 16:17], decode=True), by_len(x[:, 16:17], decode=True)
    assert float(jnp.abs(y - y_len).max()) < TOL
    ref = m(jnp.concatenate([x[:, :9], x[:, 16:17], jnp.zeros((2, 6, D))], axis=1))  # 9 real + the new one
    assert float(jnp.abs(y[:, 0] - ref[:, 9]).max()) < TOL


def test_prefill_lengths_count_indices_whatever_positions_the_pads_carry():
    # Pads that repeat the last real position (Gemma's, Hugging Face's right padding) are padding by
    # index, as jax.nn's lengths: the prompt and the decode steps equal those of pads at later positions.
    gemma, later = _layer(2, 2, 2), _layer(2, 2, 2, seed=0)
    x = jax.random.normal(jax.random.key(8), (2, 20, D))
    lengths = jnp.array([16, 10])
    idx = jnp.arange(16)[None]
    pos_gemma = jnp.minimum(idx, lengths[:, None] - 1)  # pads repeat position length - 1
    outs = []
    for layer, pos in ((gemma, pos_gemma), (later, jnp.broadcast_to(idx, (2, 16)))):
        layer.init_cache((2, 24))
        y = layer(x[:, :16], prefill=True, positions=pos, lengths=lengths)
        outs.append((y, [layer(x[:, 16 + i:17 + i], decode=True) for i in range(3)]))
    (y0, d0), (y1, d1) = outs
    real = (idx < lengths[:, None])[..., None]
    assert float(jnp.abs(jnp.where(real, y0 - y1, 0)).max()) < TOL
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(d0, d1)) < TOL
    assert [int(i) for i in gemma.cache_index[...]] == [19, 13]  # three decoded after 16 and 10 real


def test_decode_keeps_the_prefills_window():
    # A decode step that leaves out the prefill's per-call window still attends within it.
    m = _layer(8, 1, 1)
    assert _decode_vs_full(m, S=16, L=48, steps=6, lengths=[13, 16], window=6, decode_window=None) < TOL
    assert int(m.cache_window[...]) == 6
    with pytest.raises(ValueError, match=r"local_window_size=4 differs from the window the prefill used \(6\)"):
        m(jnp.ones((2, 1, D)), decode=True, local_window_size=4)
    m.init_cache((2, 16))
    m(jnp.ones((2, 8, D)), prefill=True)
    with pytest.raises(ValueError, match=r"local_window_size=3 differs from the window the prefill used \(None\)"):
        m(jnp.ones((2, 1, D)), decode=True, local_window_size=3)
    step = nnx.jit(lambda m, x: m(x, decode=True, local_window_size=3))
    with pytest.raises(Exception, match="local_window_size=3 differs from the window the prefill used"):
        jax.block_until_ready(step(m, jnp.ones((2, 1, D))))


def test_jitted_step_past_max_length_is_an_error():
    # Under jit the slot count is traced: the step fails when it runs instead of returning NaN.
    m = _layer(2, 2, 1)
    m.init_cache((2, 8))
    m(jnp.ones((2, 4, D)), prefill=True)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for _ in range(2):  # fill the cache: fine
        assert bool(jnp.isfinite(step(m, jnp.ones((2, 2, D)))).all())
    with pytest.raises(Exception, match=r"decoding 2 more token\(s\) would overfill the cache: 8 of its "
                                        r"max_length=8 slots are already written; init_cache with max_length >= 12"):
        jax.block_until_ready(step(m, jnp.ones((2, 2, D))))


OVERFILL_UNDER_JIT = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from flax import nnx
import jax_cp

mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
m = jax_cp.CPAttention(8, 32, num_kv_heads=2, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
m.init_cache((2, 8))
m(jnp.ones((2, 4, 32)), prefill=True)
step = nnx.jit(lambda m, x: m(x, decode=True))
print("fits:", bool(jnp.isfinite(step(m, jnp.ones((2, 2, 32)))).all()))  # 6 of 8 slots
jax.block_until_ready(step(m, jnp.ones((2, 3, 32))))  # 9 of 8: the step fails, uncaught
"""


def test_jitted_overfill_prints_one_message_and_exits_quietly():
    # 8 devices each stop the step; the user reads the error once: not per device, not again at exit.
    out = subprocess.run([sys.executable, "-c", OVERFILL_UNDER_JIT], env=child_env(), capture_output=True, text=True,
                         timeout=300, cwd=pathlib.Path(jax_cp.__file__).parents[1])
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "fits: True" in out.stdout, text[-3000:]
    assert text.count("would overfill the cache") == 1, text
    line = next(l for l in text.splitlines() if "would overfill the cache" in l)
    assert line == ("ValueError: decoding 3 more token(s) would overfill the cache: 6 of its max_length=8 slots are "
                    "already written; init_cache with max_length >= 12 (the prompt and every token to decode, a "
                    "multiple of cp_colossal*cp_ulysses=4)."), line
    assert "Exception ignored" not in text and "callback failed" not in text, text


def _float64_nnx(mesh, kw, x, S, steps):
    """A float64 layer's full forward over ``x``, and its prefill of ``S`` tokens then ``steps`` one-token
    decode steps (concatenated)."""
    m = _layer(*mesh, dtype=jnp.float64, param_dtype=jnp.float64, **kw)
    full = m(x)
    m.init_cache(x.shape[:2])
    ys = [m(x[:, :S], prefill=True)] + [m(x[:, i:i + 1], decode=True) for i in range(S, S + steps)]
    assert m.cached_key[...].dtype == jnp.float64
    return full, jnp.concatenate(ys, axis=1)


def _float64_linen(mesh, kw, x, S, steps):
    """As ``_float64_nnx`` for the Linen twin in flax's x64 decode setup: float32 parameters, no dtype,
    float64 inputs (the layer computes in float64 and keeps a float64 cache)."""
    m = jax_cp.linen.CPAttention(num_heads=8, in_features=D, num_kv_heads=2, head_dim=8,
                                 mesh=jax_cp.make_mesh(cp_colossal=mesh[0], cp_ulysses=mesh[1], tp=mesh[2]),
                                 is_causal=True, rope_theta=1e4, **kw)
    v = m.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype), decode=True)
    assert v["cache"]["cached_key"].dtype == jnp.float64
    full = m.apply({"params": v["params"]}, x)
    y, cache = m.apply(v, x[:, :S], prefill=True, mutable=["cache"])
    ys = [y]
    for i in range(S, S + steps):
        y, cache = m.apply({"params": v["params"], **cache}, x[:, i:i + 1], decode=True, mutable=["cache"])
        ys.append(y)
    return full, jnp.concatenate(ys, axis=1)


@pytest.mark.parametrize("mesh,kw,linen", [
    ((8, 1, 1), {}, False),                                                      # all-gather
    ((2, 2, 2), dict(kv_exchange="ring"), False),                                # ring x Ulysses x tp
    ((2, 4, 1), {}, False),                                                      # hybrid
    ((4, 1, 2), dict(use_sinks=True, logits_soft_cap=3.0, use_qk_norm=True), False),  # tp, sinks, soft cap
    ((2, 4, 1), {}, True),
    ((2, 2, 2), {}, True),
])
def test_float64_decode_is_computed_in_float64(mesh, kw, linen):
    # Under x64, prefill then decode token by token equals the layer's own float64 forward at every
    # position: the cache, the cache attention, the merge over the CP axes and the sinks stay float64.
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (2, 32, D), jnp.float64)
        full, y = (_float64_linen if linen else _float64_nnx)(mesh, kw, x, S=16, steps=4)
        assert y.dtype == full.dtype == jnp.float64
        scale = max(1.0, float(jnp.abs(full).max()))
        err = float(jnp.abs(y - full[:, :y.shape[1]]).max())
        assert err < F64_TOL * scale, (mesh, kw, linen, err)


@pytest.mark.parametrize("linen", [False, True])
def test_module_mask_gets_the_functions_value_error(linen):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    x, mask = jnp.ones((2, 8, D)), jnp.ones((2, 1, 8, 8), bool)
    match = "mask= is not supported.*is_causal=, local_window_size=, segment_ids=.*positions="
    with pytest.raises(ValueError, match=match):
        jax_cp.dot_product_attention(jnp.ones((2, 8, 4, 8)), jnp.ones((2, 8, 4, 8)), jnp.ones((2, 8, 4, 8)),
                                     mask=mask, mesh=mesh)
    with pytest.raises(ValueError, match=match):
        if linen:
            m = jax_cp.linen.CPAttention(num_heads=4, in_features=D, mesh=mesh)
            m.init(jax.random.key(0), x, mask=mask)
        else:
            jax_cp.CPAttention(4, D, mesh=mesh, rngs=nnx.Rngs(0))(x, mask=mask)


# ----------------------------------------------------------------------------- the model and generate

CFG = llama.LlamaConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                        d_ff=64, rope_theta=10_000.0, use_qk_norm=True, tie_embeddings=True)


def _model(mesh):
    return llama.Llama(CFG, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))


def _copy_params(src, dst):
    """``dst`` gets ``src``'s parameter values (each on ``dst``'s own sharding)."""
    state = nnx.state(dst, nnx.Param)
    values = jax.tree.map(lambda d, s: jax.device_put(np.asarray(s), d.sharding), state, nnx.state(src, nnx.Param))
    nnx.update(dst, values)


def _greedy(model, prompts, lengths, steps, max_length):
    g = gen_lib.Generator(model, batch=prompts.shape[0], prompt_len=prompts.shape[1], max_length=max_length)
    logits, tokens = [], []
    step = jax.jit(lambda p, c, t: _logits_step(g, p, c, t), donate_argnums=1)
    pre = jax.jit(lambda p, c, t, l: _logits_prefill(g, p, c, t, l), donate_argnums=1)
    out, g.cache = pre(g.params, g.cache, jnp.asarray(prompts), jnp.asarray(lengths))
    last = out[np.arange(len(lengths)), np.asarray(lengths) - 1]
    for _ in range(steps):
        tok = jnp.argmax(last, -1).astype(jnp.int32)
        tokens.append(np.asarray(tok))
        logits.append(np.asarray(last))
        last, g.cache = step(g.params, g.cache, tok)
    return np.stack(tokens, 1), np.stack(logits, 1), np.asarray(out)


def _logits_prefill(g, params, cache, tokens, lengths):
    m = nnx.merge(g.graphdef, params, cache)
    return m(tokens, prefill=True, lengths=lengths), nnx.state(m, nnx.Cache)


def _logits_step(g, params, cache, tok):
    m = nnx.merge(g.graphdef, params, cache)
    return m(tok[:, None], decode=True)[:, 0], nnx.state(m, nnx.Cache)


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 2), (4, 1, 1)])
def test_model_greedy_decode_matches_one_device(layout):
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    one = jax_cp.make_mesh(devices=jax.devices()[:1])
    model, ref = _model(mesh), _model(one)
    _copy_params(model, ref)
    B = jax_cp.mesh_dims(mesh).dp * 2
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, (B, 12)).astype(np.int32)
    lengths = np.array([12, 7] * (B // 2), np.int32)  # one prompt ends mid-chunk
    toks, logits, prefill_logits = _greedy(model, prompts, lengths, 10, 32)
    toks1, logits1, _ = _greedy(ref, prompts, lengths, 10, 32)
    np.testing.assert_array_equal(toks, toks1)
    np.testing.assert_allclose(logits, logits1, atol=1e-4, rtol=1e-4)
    # Prefill-then-decode equals one training-path pass over the whole sequence, at every position.
    for b in range(2):
        seq = np.concatenate([prompts[b, :lengths[b]], toks[b, :-1]])
        seq = np.pad(seq, (0, (-len(seq)) % 8))[None].repeat(B, 0)
        full = np.asarray(model(jnp.asarray(seq), positions=jnp.arange(seq.shape[1])))[0]
        np.testing.assert_allclose(prefill_logits[b, :lengths[b]], full[:lengths[b]], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(logits[b], full[lengths[b] - 1:lengths[b] + 9], atol=1e-4, rtol=1e-4)


def test_model_prefill_honours_a_packed_prompt():
    # The Llama model hands the prompt's segment ids to every layer at prefill: its logits equal the
    # training path's on the same packed row, and the next token continues the last document.
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    model = _model(mesh)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 16)), jnp.int32)
    seg = jnp.asarray(np.repeat([0, 1], [7, 9])[None].repeat(2, 0), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(7), np.arange(9)])[None].repeat(2, 0), jnp.int32)
    model.init_cache(2, 24)
    pre = model(tokens, prefill=True, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(pre, model(tokens, segment_ids=seg, positions=pos), atol=1e-4, rtol=1e-4)
    nxt = jnp.asarray([[3], [5]], jnp.int32)
    step = model(nxt, decode=True)[:, 0]
    alone = jnp.concatenate([tokens[:, 7:], nxt, jnp.zeros((2, 6), jnp.int32)], axis=1)  # the last document
    ref = model(alone, positions=jnp.arange(16), segment_ids=jnp.asarray(np.where(np.arange(16) < 10, 0, -1)))
    np.testing.assert_allclose(step, ref[:, 9], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pass segment_ids to the prefill call"):
        model(nxt, decode=True, segment_ids=jnp.zeros((2, 1), jnp.int32))


def test_decode_step_holds_the_cache_once():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    cfg = dataclasses.replace(CFG, d_model=64, head_dim=64, d_ff=128)  # a real head dim: the cache dominates
    model = llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    g = gen_lib.Generator(model, batch=2, prompt_len=8, max_length=2048)
    compiled = g._step.lower(g.params, g.cache, jnp.zeros((2,), jnp.int32), jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    shards = [a.addressable_shards[0].data for a in jax.tree.leaves(g.cache)]
    cache_bytes = sum(s.nbytes for s in shards)  # per device: 2 layers x K, V [2, 512, 1, 64] f32 + positions
    assert cache_bytes > 1_000_000
    assert mem.alias_size_in_bytes >= cache_bytes  # every cache buffer is updated in place
    key_bytes = min(s.nbytes for s in shards if s.ndim == 4)  # one layer's keys: any copy would exceed it
    assert mem.temp_size_in_bytes < key_bytes, (mem.temp_size_in_bytes, key_bytes)
    kv_shape = "f32[" + ",".join(map(str, shards[0].shape)) + "]" if shards[0].ndim == 4 else None
    copies = [l for l in compiled.as_text().splitlines() if " copy(" in l and kv_shape and f"= {kv_shape}" in l]
    assert not copies, copies[:3]


def test_generate_from_a_checkpoint_streams_the_greedy_text(tmp_path, capsys):
    import orbax.checkpoint as ocp
    from models import train

    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    cfg = train.TrainConfig(model="tiny", cp_colossal=2, cp_ulysses=2, tp=2, seq_len=16, batch=1, steps=2,
                            warmup=1, dtype="float32", out=str(tmp_path))
    tx, _ = train.make_optimizer(cfg)
    with jax.set_mesh(mesh):
        model, opt = nnx.jit(train._init_fn(cfg, mesh, tx))()
    with ocp.CheckpointManager(cfg.ckpt_dir.absolute(), item_names=("state", "meta")) as mngr:
        train._save(mngr, 1, nnx.state((model, opt)), cfg)
        mngr.wait_until_finished()
    gen_lib.main(["--checkpoint", str(tmp_path), "--prompt", "def f", "--max-new-tokens", "6",
                  "--cp-colossal", "2", "--cp-ulysses", "2", "--tp", "2", "--no-stop-at-eod"])
    out, err = capsys.readouterr()
    assert "prefill 5 tokens" in err and "6 new tokens" in err, err
    # The same greedy continuation from one pass of the training path per token.
    seq = list(b"def f")
    for _ in range(6):
        x = np.pad(np.array(seq, np.int32), (0, (-len(seq)) % 8))[None]
        logits = model(jnp.asarray(x), positions=jnp.arange(x.shape[1]))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    assert out.startswith("def f")
    expect = bytes(b for b in seq[5:] if b < 256).decode("utf-8", errors="replace")
    assert out[len("def f"):].rstrip("\n") == expect


def test_generate_flags_are_checked():
    with pytest.raises(SystemExit):
        gen_lib.parse_args(["--prompt", "x"])  # no checkpoint, no plan
    with pytest.raises(ValueError, match="no models.train checkpoint there"):
        gen_lib.checkpoint_dir("/nonexistent")


def test_planned_tpu_decode_step_holds_the_sharded_cache_once():
    pytest.importorskip("libtpu", reason="the planner compiles with the libtpu wheel's TPU compiler")
    runs = {}
    for cache_len in (16384, 65536):
        cfg = gen_lib.GenerateConfig(plan="v5e:2x4", model="tiny", cache_len=cache_len, cp_colossal=2, cp_ulysses=2,
                                     tp=2)
        runs[cache_len] = gen_lib.plan_decode(cfg)
    c = llama.get_config("tiny")  # 2 layers, 2 kv heads of 16, bfloat16 cache; one sequence (dp=1)
    for cache_len, (a, per_chip) in runs.items():
        slots = cache_len // 4
        # K and V (bf16), positions, then cache_index, cache_slots and cache_window (int32 each)
        assert per_chip == c.num_layers * (2 * slots * (c.num_kv_heads // 2) * c.head_dim * 2 + slots * 4 + 4 * 3)
        assert a.memory.aliased >= per_chip, a.memory  # every cache buffer updated in place
        merges = [x for x in a.schedule.collectives if x.axes == ("cp_colossal", "cp_ulysses")]
        assert {x.kind for x in merges} == {"all-reduce"} and len(merges) == 2 * c.num_layers  # pmax + psum a layer
        assert all(x.bytes <= 1024 for x in merges)  # [B, T, H] partials: small next to the cache
    # The cache is never copied: a 4x longer cache adds less to the step's temporaries (the [S, H] scores)
    # than one layer's keys grew, which one copy of any layer's cache would add at least.
    grown = runs[65536][0].memory.temporaries - runs[16384][0].memory.temporaries
    keys_grown = (65536 - 16384) // 4 * (c.num_kv_heads // 2) * c.head_dim * 2
    assert 0 <= grown < keys_grown, (grown, keys_grown)


def test_both_cache_attention_forms_match_the_reference():
    from jax_cp._decode import EMPTY, attend_cache

    q, k, v = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 2, 8, 16), (2, 24, 2, 16),
                                                                              (2, 24, 2, 16)]))
    k_pos = jnp.asarray(np.where(np.arange(24) < 20, np.arange(24), EMPTY)[None].repeat(2, 0))
    q_pos = jnp.asarray([[18, 19], [9, 10]])
    spec = jax_cp.AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=16, is_causal=True, local_window_size=(6, 0),
                                logits_soft_cap=4.0)
    ref_o, ref_lse = jax_cp.kernels.dense_attention(
        q, k, v, q_positions=q_pos, kv_positions=k_pos, is_causal=True, local_window_size=(6, 0),
        logits_soft_cap=4.0, return_residual=True)
    for form in ("dot", "reduce"):
        o, lse = attend_cache(q, k, v, q_pos, k_pos, spec, form=form)
        np.testing.assert_allclose(o, ref_o, atol=TOL, rtol=TOL)
        np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=TOL)


def test_serving_weights_are_cast_once_and_change_no_output():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    model = llama.Llama(CFG, mesh=mesh, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    params = gen_lib.serving_params(nnx.state(model, nnx.Param), jnp.bfloat16)
    dtypes = {"/".join(map(str, k)): v.dtype for k, v in nnx.to_flat_state(params)}
    assert dtypes["blocks/0/attn/q_kernel"] == dtypes["blocks/1/mlp/w_down"] == jnp.bfloat16
    assert dtypes["embed"] == dtypes["blocks/0/attn/q_norm"] == dtypes["final_norm/scale"] == jnp.float32
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 16)), jnp.int32)
    before = model(tokens, positions=jnp.arange(16))
    nnx.update(model, params)
    np.testing.assert_allclose(np.asarray(model(tokens, positions=jnp.arange(16))), np.asarray(before), atol=1e-6)
