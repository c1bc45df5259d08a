"""GatedDeltaNet (NNX) on the mesh equals its single-device reference (the recurrence, token by token):
the output and every gradient, on packed rows in the natural, dual-chunk and dispatch orders; prefill
then decode equals one pass over the whole sequence, token for token; bad input is a ValueError.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from conftest import needs_devices
from jax_cp import linear
from util import assert_close, fwd_and_vjp

B, S, D = 2, 32, 32
SHAPES = dict(num_k_heads=2, head_k_dim=8, num_v_heads=4, head_v_dim=8, chunk_size=4)
F32 = jnp.float32


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _mesh(c, u, t, dp=1, axis_types=AxisType.Auto):
    return jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, devices=jax.devices()[:dp * c * u * t],
                            axis_types=axis_types)


def _layer(mesh, seed=0, **kw):
    return linear.GatedDeltaNet(D, mesh=mesh, rngs=nnx.Rngs(seed), **(SHAPES | kw))


def _packed(seed=0):
    """Two rows of three documents each (different cuts), per-document positions, in natural order."""
    seg = np.zeros((B, S), np.int32)
    for b, cuts in enumerate(([5, 19], [12, 13])):
        seg[b, cuts[0]:], seg[b, cuts[1]:] = 1, 2
    pos = np.concatenate([[np.arange(S) - np.searchsorted(seg[b], seg[b], side="left")] for b in range(B)])
    x = np.asarray(jax.random.normal(jax.random.key(seed), (B, S, D), F32))
    return x, pos.astype(np.int32), seg


def _ordered(order, mesh, x, pos, seg):
    """The row in ``order``: natural, the dual-chunk order or a dispatch plan's (each row its own)."""
    if order == "natural":
        return x, pos, seg
    if order == "dual-chunk":
        (x, pos, seg), _ = jax_cp.load_balance.reorder((x, pos, seg), mesh)  # the rows' own positions
        return np.asarray(x), np.asarray(pos), np.asarray(seg)
    plan = jax_cp.load_balance.plan(seg, mesh, positions=pos)
    assert len({r.tobytes() for r in plan.perm}) == B or jax_cp.mesh_dims(mesh).c == 1
    (x, seg), pos = plan.reorder((x, seg))
    return x, pos, seg


def _split(model, method=None):
    graphdef, state = nnx.split(model)

    def f(state, x, **kw):
        m = nnx.merge(graphdef, state)
        return (m.reference if method == "reference" else m)(x, **kw)

    return f, state


AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
LAYOUTS = [((1, 1, 1, 1), "natural", AUTO), ((2, 2, 2, 1), "dispatch", AUTO), ((4, 2, 1, 1), "dual-chunk", AUTO),
           ((1, 2, 2, 2), "natural", AUTO), ((2, 1, 2, 2), "dispatch", AUTO),
           ((2, 2, 2, 1), "dual-chunk", EXPLICIT)]  # (cp_colossal, cp_ulysses, tp, dp), order, mesh axes


@needs_devices(8)
@pytest.mark.parametrize("cut,order,axes", LAYOUTS, ids=[f"{c}-{o}-{a.name}" for c, o, a in LAYOUTS])
def test_layer_matches_the_recurrence(cut, order, axes):
    """Packed rows (three documents each) in ``order``: output, dx and every parameter's gradient equal
    the reference's (float32), which runs the recurrence token by token in document order."""
    mesh = _mesh(*cut, axis_types=axes)
    with jax.set_mesh(mesh):
        _check_against_reference(mesh, cut, order)


def _check_against_reference(mesh, cut, order, dtype=F32):
    model = _layer(mesh, dtype=dtype)
    x, pos, seg = _ordered(order, mesh, *_packed())
    x = x.astype(dtype)
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    pos, seg = (jax.device_put(a, sharding) for a in (pos, seg))
    x = jax.device_put(x, NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses"), None)))
    f, state = _split(model)
    ref, _ = _split(model, "reference")
    ct = jax.random.normal(jax.random.key(3), (B, S, D), F32).astype(dtype)  # laid out as each output's
    ct, r_ct = jax.device_put(ct, x.sharding), jax.device_put(ct, NamedSharding(mesh, P()))
    out, (g_state, g_x) = fwd_and_vjp(lambda s, x: f(s, x, positions=pos, segment_ids=seg), (state, x), ct)
    r_out, (r_state, r_x) = fwd_and_vjp(lambda s, x: ref(s, x, positions=pos, segment_ids=seg), (state, x), r_ct)
    assert out.sharding.is_equivalent_to(x.sharding, 3) and out.dtype == g_x.dtype == dtype
    assert_close(out, r_out, dtype, f"output {cut} {order}")
    assert_close(g_x, r_x, dtype, f"dx {cut} {order}")
    g, r = nnx.to_pure_dict(g_state), nnx.to_pure_dict(r_state)
    assert set(g) == set(r) == set(model.spec.param_shapes())
    for name in g:
        assert float(jnp.abs(r[name]).max()) > 0, name  # every parameter reaches the output
        assert g[name].dtype == F32, name
        assert_close(g[name], r[name], dtype, f"d{name} {cut} {order}")


@needs_devices(8)
def test_bfloat16_layer_matches_the_recurrence():
    """Matmuls in bfloat16 (float32 parameters, the recurrence in float32) on a (2, 2, 2) mesh: the output
    and dx in bfloat16, every parameter gradient in float32, equal to the reference's (bfloat16 tolerance)."""
    _check_against_reference(_mesh(2, 2, 2), (2, 2, 2), "dual-chunk", jnp.bfloat16)


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _qwen3_next_in_numpy(params, x_SD, spec):
    """Hugging Face's ``Qwen3NextGatedDeltaNet`` on one document, in float64 NumPy, written from its
    definition (the conv as ``Conv1d(padding=W-1)``, ``repeat_interleave`` of the key heads, the
    recurrence of ``torch_recurrent_gated_delta_rule`` with its ``[K, V]`` state)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x, S = np.asarray(x_SD, np.float64), x_SD.shape[0]
    proj = {n: np.einsum("sd,dhe->she", x, p[f"{n}_kernel"]) for n in "qkvz"}

    def conv(a, w):
        W = w.shape[0]
        padded = np.concatenate([np.zeros((W - 1,) + a.shape[1:]), a])
        out = sum(w[i] * padded[i:i + S] for i in range(W))
        return out * _sigmoid(out)

    q, k, v = (conv(proj[n], p[f"{n}_conv"]) for n in "qkv")
    q, k = (a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6) for a in (q, k))
    r = spec.num_v_heads // spec.num_k_heads
    q, k = np.repeat(q, r, axis=1) * spec.head_k_dim ** -0.5, np.repeat(k, r, axis=1)
    beta = _sigmoid(x @ p["b_kernel"])
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(x @ p["a_kernel"] + p["dt_bias"]))
    state, o = np.zeros((spec.num_v_heads, spec.head_k_dim, spec.head_v_dim)), []
    for t in range(S):
        state = state * np.exp(g[t])[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        o.append((state * q[t][:, :, None]).sum(1))
    o = np.stack(o)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + spec.norm_eps) * p["norm"] * proj["z"] * _sigmoid(proj["z"])
    return np.einsum("shv,hve->se", o, p["o_kernel"])


@needs_devices(8)
def test_layer_is_qwen3_next_gated_deltanet():
    """The semantics, checked independently of the library's reference: one document through the layer
    on a (2, 2, 2) mesh equals Hugging Face's definition written in NumPy (float64)."""
    model = _layer(_mesh(2, 2, 2))
    x = jax.random.normal(jax.random.key(5), (1, 16, D), F32)
    params = {n: getattr(model, n)[...] for n in model.spec.param_shapes()}
    want = _qwen3_next_in_numpy(params, x[0], model.spec)
    assert_close(model(x)[0], want, F32, "layer vs NumPy")
    assert_close(model.reference(x)[0], want, F32, "reference vs NumPy")


def _one_pass(model, seq_LD, S):
    """The training path over one sequence (padded to ``S``), both rows the same."""
    seq = jnp.pad(seq_LD, ((0, S - seq_LD.shape[0]), (0, 0)))[None]
    return model(jnp.broadcast_to(seq, (B,) + seq.shape[1:]))[0]


@needs_devices(8)
@pytest.mark.parametrize("cut", [(2, 2, 2, 1), (1, 1, 1, 2)], ids=["2x2x2", "dp2"])
def test_prefill_then_decode_equals_one_pass(cut):
    """A padded prompt (16 and 9 real tokens) prefilled on the mesh, then 5 tokens one at a time and 2 in
    one step: every output equals one training-path pass over the real tokens and the new ones."""
    model = _layer(_mesh(*cut))
    x = jax.random.normal(jax.random.key(2), (B, 32, D), F32)
    lengths = np.array([16, 9])
    model.init_cache((B, 32))
    y0 = model(x[:, :16], prefill=True, lengths=jnp.asarray(lengths, jnp.int32))
    ys = [model(x[:, 16 + i:17 + i], decode=True) for i in range(5)] + [model(x[:, 21:23], decode=True)]
    np.testing.assert_array_equal(model.cache_index[...], lengths + 7)
    assert model.recurrent_state[...].sharding.spec == P("dp", "tp", None, None)
    assert model.conv_state[...].sharding.spec == P("dp", None, "tp")
    for b in range(B):
        full = _one_pass(model, jnp.concatenate([x[b, :lengths[b]], x[b, 16:23]]), 32)
        assert_close(y0[b, :lengths[b]], full[:lengths[b]], F32, f"prefill row {b}")
        got = jnp.concatenate([y[b] for y in ys])
        assert_close(got, full[lengths[b]:lengths[b] + 7], F32, f"decode row {b}")


@needs_devices(8)
def test_decode_continues_the_last_document_of_a_packed_prompt():
    """A packed prompt (documents of 7 and 9 tokens, in the dual-chunk order of the mesh): the prefill's
    outputs are the training path's on the same row, and decode continues the last document alone."""
    mesh = _mesh(2, 2, 2)
    model = _layer(mesh)
    x = jax.random.normal(jax.random.key(4), (B, 16, D), F32)
    seg = np.repeat([0, 1], [7, 9])[None].repeat(B, 0).astype(np.int32)
    pos = np.concatenate([np.arange(7), np.arange(9)])[None].repeat(B, 0).astype(np.int32)
    (xr, pr, sr), _ = jax_cp.load_balance.reorder((x, pos, seg), mesh)
    model.init_cache((B, 16))
    pre = model(xr, prefill=True, positions=pr, segment_ids=sr)
    assert_close(pre, model(xr, positions=pr, segment_ids=sr), F32, "prefill")
    np.testing.assert_array_equal(model.cache_index[...], [9, 9])
    new = jax.random.normal(jax.random.key(6), (B, 3, D), F32)
    steps = jnp.concatenate([model(new[:, i:i + 1], decode=True) for i in range(3)], axis=1)
    alone = jnp.concatenate([x[:, 7:], new, jnp.zeros((B, 4, D))], axis=1)  # the last document, then padding
    assert_close(steps, model(alone)[:, 9:12], F32, "decode")


@needs_devices(8)
def test_parameters_are_born_sharded_and_fsdp_stores_them_apart():
    """Heads over tp (the output kernel by rows); a ``sharding`` entry stores a weight over dp as well,
    and the call gathers it: the same output as the tp layout."""
    mesh = _mesh(1, 2, 2, dp=2)
    plain = _layer(mesh)
    assert plain.q_kernel[...].sharding.spec == P(None, "tp", None)
    assert plain.o_kernel[...].sharding.spec == P("tp", None, None)
    assert plain.A_log[...].sharding.spec == P("tp")
    assert nnx.get_partition_spec(nnx.state(plain))["v_conv"].get_value() == P(None, "tp", None)
    fsdp = _layer(mesh, sharding={"q_kernel": P("dp", "tp", None), "o_kernel": P("tp", None, "dp")})
    assert fsdp.q_kernel[...].sharding.spec == P("dp", "tp", None)
    x, pos, seg = _packed()
    np.testing.assert_array_equal(fsdp.q_kernel[...], plain.q_kernel[...])
    assert_close(fsdp(x, positions=pos, segment_ids=seg), plain(x, positions=pos, segment_ids=seg), F32, "fsdp")


BAD = [
    (dict(num_v_heads=3), r"num_v_heads=3 is not a multiple of num_k_heads=2; each key head serves"),
    (dict(head_k_dim=0), r"head_k_dim=0 must be a positive integer"),
    (dict(conv_width=1.5), r"conv_width=1.5 must be a positive integer"),
    (dict(norm_eps=0.0), r"norm_eps=0.0 must be a number > 0"),
    (dict(max_pieces=0), r"max_pieces=0 must be a positive integer"),
    (dict(sharding={"w_q": P()}), r"sharding names \['w_q'\], which are not parameters of the layer"),
]


@needs_devices(8)
@pytest.mark.parametrize("kw,message", BAD, ids=[m.split("=")[0] for _, m in BAD])
def test_bad_arguments_name_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        _layer(_mesh(1, 1, 1), **kw)


@needs_devices(8)
def test_bad_calls_name_the_fix():
    with pytest.raises(ValueError, match=r"num_k_heads=2 is not divisible by tp=4; the layer splits its heads over tp"):
        _layer(_mesh(1, 1, 4))
    model = _layer(_mesh(1, 1, 1, dp=2))
    x = jnp.ones((B, 8, D))
    with pytest.raises(ValueError, match=r"span_ids= cannot be honoured by a linear-attention layer"):
        model(x, span_ids=jnp.ones((B, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"need a cache: call init_cache\(\(batch_size, max_length\)\)"):
        model(x[:, :1], decode=True)
    with pytest.raises(ValueError, match=r"batch=3 must be a positive int divisible by dp=2"):
        model.init_cache((3, 8))
    model.init_cache((B, 8))
    with pytest.raises(ValueError, match=r"the input's batch=4 does not match the cache's batch=2"):
        model(jnp.ones((4, 1, D)), decode=True)
    with pytest.raises(ValueError, match=r"decode=True continues each row from its cache"):
        model(x[:, :1], decode=True, positions=jnp.zeros((B, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"lengths=\[0, 4\] must lie in \[1, seq_len=8\]"):
        model(x, prefill=True, lengths=jnp.asarray([0, 4]))
    with pytest.raises(ValueError, match=r"prompt rows \[1\] have no real token"):
        model(x, prefill=True, segment_ids=jnp.asarray([[0] * 8, [-1] * 8]))


@needs_devices(8)
def test_linen_twin_matches_nnx():
    """``jax_cp.linear.linen.GatedDeltaNet`` with the NNX layer's parameters: the same output on packed
    rows, and the same prefill and decode through its ``"cache"`` collection."""
    import flax.linen as nn

    mesh = _mesh(2, 2, 2)
    layer = _layer(mesh)
    twin = linear.linen.GatedDeltaNet(D, mesh=mesh, **SHAPES)
    x, pos, seg = _packed()
    variables = twin.init(jax.random.key(0), x, positions=pos, segment_ids=seg)
    assert nn.get_partition_spec(variables)["params"]["q_kernel"] == P(None, "tp", None)
    params = {n: getattr(layer, n)[...] for n in layer.spec.param_shapes()}
    assert set(params) == set(variables["params"])
    y = twin.apply({"params": params}, x, positions=pos, segment_ids=seg)
    assert_close(y, layer(x, positions=pos, segment_ids=seg), F32, "linen forward")
    cache = twin.init(jax.random.key(0), jnp.zeros((B, 16, D)), decode=True)["cache"]
    layer.init_cache((B, 16))
    y0, state = twin.apply({"params": params, "cache": cache}, x[:, :16], prefill=True, mutable=["cache"])
    y1, _ = twin.apply({"params": params, **state}, x[:, 16:17], decode=True, mutable=["cache"])
    assert_close(y0, layer(x[:, :16], prefill=True), F32, "linen prefill")
    assert_close(y1, layer(x[:, 16:17], decode=True), F32, "linen decode")
