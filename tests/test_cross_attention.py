"""Cross attention: queries and keys/values of different lengths (``T != S``), each sequence sharded
over the CP axes, through every exchange (Ulysses, all-gather, ``all_to_all``, the blockwise and the
splash ring, hybrid, tp), with the keys' own positions and documents; both modules take flax's
``inputs_k``/``inputs_v`` (or ``inputs_kv``). Against the reference and jax.nn/flax: forward and
gradients."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_cp
import jax_cp.linen
from jax_cp import load_balance, reference
from util import assert_close, assert_matches, fwd_and_vjp

B, T, S, H, K, d, D = 2, 16, 48, 8, 2, 8, 32


def _qkv(dtype=jnp.float32, seed=0, T=T, S=S):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, T, H, d), (B, S, K, d), (B, S, K, d), (B, T, H, d))
    return tuple(jax.random.normal(key, shape).astype(dtype) for key, shape in zip(keys, shapes))


def _documents(n, cut):
    """Two documents per row: tokens before ``cut`` in 0, the rest in 1 (row 1: the first 4 are padding)."""
    seg = jnp.stack([(jnp.arange(n) >= cut).astype(jnp.int32)] * B)
    return seg.at[1, :4].set(-1)


@pytest.mark.parametrize("layout, kv_exchange, kernel, mask", [
    ((1, 8, 1), "auto", "auto", "causal"),            # Ulysses: keys of their own length cross cp_ulysses
    ((2, 2, 2), "all_gather", "auto", "documents"),   # hybrid x tp, each side's documents
    ((2, 4, 1), "all_to_all", "auto", "memory"),      # keys at positions of their own (a memory)
    ((4, 2, 1), "ring", "auto", "balanced"),          # the ring moves key chunks of S/c, both sides balanced
    ((4, 1, 2), "ring", "auto", "window"),            # ring x tp with a sliding window over positions
    ((2, 2, 1), "ring", "splash", "documents"),       # the splash ring (interpret mode), keys padded apart
    ((2, 2, 2), "all_gather", "splash", "causal"),    # splash off the ring (interpret mode; dp = 1, see test_kernels)
])
def test_every_exchange_with_keys_of_their_own_length(layout, kv_exchange, kernel, mask):
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = _qkv()
    kw, is_causal = {}, mask in ("causal", "balanced", "window")
    if mask == "documents":
        kw = dict(segment_ids=_documents(T, 6), kv_segment_ids=_documents(S, 20))
    if mask == "memory":  # keys are a memory placed before the queries: every query sees all of it
        kw, is_causal = dict(positions=jnp.arange(T) + S, kv_positions=jnp.arange(S)), True
    if mask == "balanced":
        (q, ct), pos = load_balance.reorder((q, ct), mesh)
        (k, v), kv_pos = load_balance.reorder((k, v), mesh)
        kw = dict(positions=pos, kv_positions=kv_pos)
    if mask == "window":
        kw = dict(local_window_size=(5, 0))
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=is_causal, kv_exchange=kv_exchange,
                                                     kernel=kernel, **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=is_causal, **kw)
    assert f(q, k, v).shape == (B, T, H, d)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{layout} {kv_exchange} {kernel} {mask}")


def test_matches_jax_nn_in_bfloat16_with_fewer_keys_than_queries_and_one_kv_head():
    """``S < T`` (jax.nn's causal alignment: query i sees keys j <= i), bfloat16, MQA, hybrid x tp."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, ct = _qkv(jnp.bfloat16, seed=3, T=32, S=16)
    k, v = k[:, :, :1], v[:, :, :1]  # one kv head for all 8 query heads
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, kv_exchange="ring")
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert_matches(f, ref, (q, k, v), ct, jnp.bfloat16, "bf16 S<T")


@pytest.mark.parametrize("kv_exchange", ["ring", "all_to_all"])
def test_cross_attention_composes_with_the_attention_features(kv_exchange):
    """Sinks, soft cap, the max-logit statistic, an MLA value head dim and jax.nn's per-side lengths
    (as segment ids of each side in the reference) together, on hybrid x tp (2,2,2)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, _, ct = _qkv(seed=7)
    v = jax.random.normal(jax.random.key(8), (B, S, K, 4))
    ct = ct[..., :4]
    sinks = jax.random.normal(jax.random.key(9), (H,))
    q_len, kv_len = jnp.array([T, 11]), jnp.array([S, 30])
    pad = lambda n, lengths: jnp.where(jnp.arange(n)[None] < lengths[:, None], 0, -1)
    kw = dict(logits_soft_cap=5.0, return_max_logits=True)
    f = lambda q, k, v, sinks: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, sinks=sinks, kv_exchange=kv_exchange, query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len, **kw)
    ref = lambda q, k, v, sinks: reference.dot_product_attention(
        q, k, v, sinks=sinks, segment_ids=pad(T, q_len), kv_segment_ids=pad(S, kv_len), **kw)
    (out, max_logits), (r_out, r_max) = jax.jit(f)(q, k, v, sinks), ref(q, k, v, sinks)
    assert out.shape == (B, T, H, 4)
    assert_close(max_logits, r_max, jnp.float32, "max_logits")
    assert_matches(lambda *a: f(*a)[0], lambda *a: ref(*a)[0], (q, k, v, sinks), ct, jnp.float32, kv_exchange)


def _grads(module, *inputs, **kw):
    graph, params = nnx.split(module, nnx.Param)

    def loss(params, inputs):
        return jnp.sum(nnx.merge(graph, params)(*inputs, **kw) ** 2)

    value, (g_params, g_inputs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, inputs)
    return value, {name: g_params[name][...] for name in g_params}, g_inputs


@pytest.mark.parametrize("call", ["inputs_kv", "inputs_k_and_v"])
def test_module_cross_attention_matches_the_reference(call):
    """NNX ``CPAttention(x, memory)``: K/V projected from the memory on its own devices' tokens, RoPE
    at each side's positions, QK-norm, bias, GQA and two head chunks on 2x2x2 (all-gather) / 4x2x1
    (ring, K and V from inputs of their own); fused Q/K/V chunks resolve to none."""
    layout, knobs = ((2, 2, 2), dict(kv_exchange="all_gather")) if call == "inputs_kv" else \
        ((4, 2, 1), dict(kv_exchange="ring"))
    mesh = jax_cp.make_mesh(cp_colossal=layout[0], cp_ulysses=layout[1], tp=layout[2])
    kw = dict(num_kv_heads=K, is_causal=True, use_qk_norm=True, rope_theta=10_000.0, use_bias=True)
    attn = jax_cp.CPAttention(H, D, mesh=mesh, overlap_chunks=2, rngs=nnx.Rngs(0), **kw, **knobs)
    ref = reference.Attention(H, D, rngs=nnx.Rngs(0), **kw)
    xs = jax.random.normal(jax.random.key(1), (3, B, S, D))
    x, memory, values = xs[0, :, :T], xs[1], xs[2]
    meta = dict(positions=jnp.arange(T) + S, kv_positions=jnp.arange(S))
    inputs, call_kw = ((x, memory), {}) if call == "inputs_kv" else ((x, memory, values), {})
    loss, grads, g_inputs = _grads(attn, *inputs, **call_kw, **meta)
    r_loss, r_grads, r_inputs = _grads(ref, *inputs, **call_kw, **meta)
    assert_close(loss, r_loss, jnp.float32, "loss")
    for name in r_grads:
        assert_close(grads[name], r_grads[name], jnp.float32, name)
    for i, (g, rg) in enumerate(zip(g_inputs, r_inputs)):
        assert_close(g, rg, jnp.float32, f"input {i}")
    y_kv = attn(x, inputs_kv=memory, **meta)  # flax Linen's keyword form: one input for keys and values
    assert_close(y_kv, attn(x, memory, **meta), jnp.float32, "inputs_kv=")


def test_module_cross_attention_matches_flax_multi_head_attention():
    """The same weights in flax's ``nnx.MultiHeadAttention(inputs_q, inputs_k, inputs_v)``: output and
    input gradients, full attention, Ulysses x tp (1,4,2)."""
    mesh = jax_cp.make_mesh(cp_ulysses=4, tp=2)
    attn = jax_cp.CPAttention(H, D, mesh=mesh, rngs=nnx.Rngs(0))
    flax_mha = nnx.MultiHeadAttention(H, D, use_bias=False, decode=False, rngs=nnx.Rngs(1))
    for ours, theirs in (("q_kernel", "query"), ("k_kernel", "key"), ("v_kernel", "value"), ("o_kernel", "out")):
        getattr(flax_mha, theirs).kernel[...] = jax.device_get(getattr(attn, ours)[...])
    xs = jax.random.normal(jax.random.key(4), (3, B, S, D))
    args, ct = (xs[0, :, :T], xs[1], xs[2]), jax.random.normal(jax.random.key(5), (B, T, D))
    out, grads = fwd_and_vjp(lambda *a: attn(*a), args, ct)
    want, want_grads = fwd_and_vjp(lambda *a: flax_mha(*a), args, ct)
    assert_close(out, want, jnp.float32, "output")
    for i, (g, wg) in enumerate(zip(grads, want_grads)):
        assert_close(g, wg, jnp.float32, f"input {i}")


def test_linen_cross_attention():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    layer = jax_cp.linen.CPAttention(num_heads=H, in_features=D, num_kv_heads=K, mesh=mesh, is_causal=True)
    xs = jax.random.normal(jax.random.key(6), (2, B, S, D))
    x, memory = xs[0, :, :T], xs[1]
    params = nn.unbox(layer.init(jax.random.key(0), x, memory))["params"]
    want = reference.attention_layer(params, x, spec=layer.spec, inputs_k=memory)
    got = jax.jit(lambda p, x, m: layer.apply({"params": p}, x, inputs_kv=m))(params, x, memory)
    assert_close(got, want, jnp.float32)


def test_cross_attention_errors_name_the_argument():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match=r"the key/value sequence length=42 is not divisible by "
                                         r"cp_colossal\*cp_ulysses=2\*2=4"):
        jax_cp.dot_product_attention(q, k[:, :42], v[:, :42], mesh=mesh)
    with pytest.raises(ValueError, match=r"pass kv_segment_ids= of shape \(batch, 48\) too"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, segment_ids=_documents(T, 6))
    with pytest.raises(ValueError, match=r"kv_segment_ids is given but segment_ids is not"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_segment_ids=_documents(S, 6))
    with pytest.raises(ValueError, match=r"kv_positions.shape=\(16,\) must be \(seq_len,\)=\(48,\)"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_positions=jnp.arange(16))
    attn = jax_cp.CPAttention(H, D, mesh=mesh, overlap_chunks=2, fused_qkv_chunks=1, rngs=nnx.Rngs(0))
    x, memory = jnp.ones((B, T, D)), jnp.ones((B, S, D))
    with pytest.raises(ValueError, match=r"fused_qkv_chunks=1 sends Q, K and V of the same tokens in one all-to-all, "
                                         r"but cross attention"):
        attn(x, memory)
    with pytest.raises(ValueError, match=r"inputs_k.shape=\(1, 48, 32\) must be \(batch=2, seq_len, in_features=32\)"):
        attn(x, memory[:1])
    with pytest.raises(ValueError, match=r"inputs_v.shape=\(2, 16, 32\) must equal inputs_k.shape=\(2, 48, 32\)"):
        attn(x, memory, x)
    with pytest.raises(ValueError, match=r"pass it or inputs_k/inputs_v, not both"):
        attn(x, memory, inputs_kv=memory)
