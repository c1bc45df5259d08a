"""Attention sinks (``sinks [H]``: one learned logit per query head in every row's softmax
denominator, no value): the reference against the definition, every kernel and exchange against the
reference (forward and gradients, the sinks' included; on the exchanges together with the soft cap
and the max-logit statistic), the ring applying them exactly once, the modules' ``use_sinks``
parameter, and the errors."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
import jax_cp.linen
from jax_cp import kernels, load_balance, reference
from util import assert_close, assert_matches, fwd_and_vjp, random_qkv

B, S, H, d = 2, 32, 8, 8
CAP = 1.5  # below the largest scaled logits of the inputs below (q * 3), so capping matters


def _sinks(h=H, seed=7):
    """Sinks around the scale of the logits, so that they take a visible share of each softmax."""
    return 1.5 * jax.random.normal(jax.random.key(seed), (h,), jnp.float32) + 0.5


def test_reference_sink_is_one_more_logit_with_no_value():
    q, k, v, _ = random_qkv(B, S, H, H, d, seed=1)
    sinks = _sinks()
    got = reference.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) * d**-0.5
    logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -jnp.inf)
    denom = jnp.exp(logits).sum(-1) + jnp.exp(sinks)[None, :, None]
    want = jnp.einsum("bhts,bshd->bthd", jnp.exp(logits) / denom[..., None], v)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    plain = reference.dot_product_attention(q, k, v, is_causal=True)
    assert float(jnp.abs(got - plain).max()) > 0.05  # the sinks matter for these inputs
    # A row that sees no key (its document has no earlier token in the window) stays zero.
    seg = jnp.where(jnp.arange(S) == 0, -1, 0)
    alone = reference.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg, sinks=sinks)
    assert float(jnp.abs(alone[:, 0]).max()) == 0.0


@pytest.mark.parametrize("kernel, dtype", [("blockwise", jnp.float32), ("blockwise", jnp.bfloat16),
                                           ("xla", jnp.float32), ("splash", jnp.float32)])
def test_local_kernels_take_sinks_with_their_gradients(kernel, dtype):
    """Causal over packed documents, GQA, blocks that do not divide the lengths (blockwise)."""
    q, k, v, ct = random_qkv(B, 40, H, 2, d, dtype, seed=2)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (B, 40))
    seg = pos // 17
    meta = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, is_causal=True)
    extra = dict(block_q=12, block_kv=16) if kernel == "blockwise" else {}
    extra |= dict(interpret=True) if kernel == "splash" else {}
    fn = {"blockwise": kernels.blockwise_attention, "xla": kernels.dense_attention,
          "splash": kernels.splash_attention}[kernel]
    assert_matches(lambda q, k, v, s: fn(q, k, v, **meta, **extra, sinks=s),
                   lambda q, k, v, s: reference.attend(q, k, v, **meta, sinks=s),
                   (q, k, v, _sinks().astype(dtype)), ct, dtype, kernel)


def _call(mesh, kv_exchange, **kw):
    return lambda q, k, v, s: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=kv_exchange,
                                                           sinks=s, **kw)


def _ref(**kw):
    return lambda q, k, v, s: reference.dot_product_attention(q, k, v, sinks=s, **kw)


@pytest.mark.parametrize("layout, kv_exchange, mask, K, dtype", [
    ((1, 8, 1), "all_gather", "causal", 2, jnp.float32),        # Ulysses
    ((8, 1, 1), "all_gather", "balanced", 2, jnp.float32),      # all-gather, load-balanced
    ((2, 2, 2), "all_to_all", "packed", 2, jnp.float32),        # hybrid x tp, packed documents
    ((4, 2, 1), "ring", "balanced", 1, jnp.float32),            # hybrid ring, load-balanced, MQA
    ((2, 1, 2), "ring", "window", 2, jnp.float32),              # ring x tp (dp = 2), sliding window
    ((2, 2, 2), "all_gather", "causal", 2, jnp.bfloat16),       # hybrid x tp in bfloat16
    ((4, 1, 1), "ring", "full", 2, jnp.bfloat16),               # ring in bfloat16
])
def test_every_exchange_with_sinks_soft_cap_and_max_logits(layout, kv_exchange, mask, K, dtype):
    """The per-logit features together, against the reference that states each plainly:
    the sinks join each softmax once (not per device or ring step), each logit is capped once, and
    the max-logit statistic is reduced over the whole mesh; forward, the statistic, and the gradients
    of q, k, v and the sinks."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=3)
    q = q * 3.0  # logits well above the cap: capping changes the result
    kw = dict(is_causal=mask != "full", logits_soft_cap=CAP, return_max_logits=True)
    if mask == "balanced":
        (q, k, v, ct), kw["positions"] = load_balance.reorder((q, k, v, ct), mesh)
    if mask == "packed":
        kw["segment_ids"] = jnp.arange(S) // 12
    if mask == "window":
        kw["local_window_size"] = (5, 0)
    args, cts = (q, k, v, _sinks().astype(dtype)), (ct, jnp.zeros(H))
    (out, m), grads = fwd_and_vjp(_call(mesh, kv_exchange, **kw), args, cts)
    (r_out, r_m), r_grads = fwd_and_vjp(_ref(**kw), args, cts)
    what = f"{layout} {kv_exchange} {mask}"
    assert_close(out, r_out, dtype, f"forward {what}")
    assert_close(m, r_m, dtype, f"max logits {what}")
    assert float(m.max()) < CAP
    for name, g, rg in zip(("q", "k", "v", "sinks"), grads, r_grads):
        assert_close(g, rg, dtype, f"d{name} {what}")


def test_the_ring_adds_the_sink_once_not_once_per_step():
    """With c = 4 ring steps, a sink joined per step would weigh like ``sink + log 4``; the ring's
    result is the single sink's, and differs from the per-step one by far more than the tolerance."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d, seed=4)
    sinks = _sinks()
    got = jax.jit(_call(mesh, "ring", is_causal=False))(q, k, v, sinks)
    assert_close(got, _ref(is_causal=False)(q, k, v, sinks), jnp.float32)
    per_step = _ref(is_causal=False)(q, k, v, sinks + jnp.log(4.0))
    assert float(jnp.abs(got - per_step).max()) > 1e-2


def test_ring_with_splash_takes_sinks():
    """The splash ring (interpret mode): sinks folded into the merged softmax after the last step."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=5)
    f = _call(mesh, "ring", is_causal=True, kernel="splash")
    assert_matches(f, _ref(is_causal=True), (q, k, v, _sinks()), ct, jnp.float32, "splash ring")


def _layer_grads(module, x, ct):
    """Output and the gradient of ``<out, ct>`` w.r.t. every parameter (a dict by name)."""
    graph, params = nnx.split(module, nnx.Param)

    @jax.jit
    def run(params, x):
        def loss(params):
            y = nnx.merge(graph, params)(x)
            return jnp.sum(y * ct), y
        (_, y), g = jax.value_and_grad(loss, has_aux=True)(params)
        return y, {name: g[name][...] for name in g}

    return run(params, x)


def test_module_sinks_are_a_sharded_parameter_with_gradients():
    """NNX ``CPAttention(use_sinks=True)`` on a hybrid x tp mesh in two head chunks (each chunk's
    sinks reach the heads its devices hold) against the reference layer with the same parameters."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(8, 32, num_kv_heads=2, mesh=mesh, is_causal=True, use_sinks=True,
                              overlap_chunks=2, kv_exchange="ring", rngs=nnx.Rngs(0))
    assert attn.sinks[...].shape == (8,) and float(jnp.abs(attn.sinks[...]).max()) == 0.0  # zeros at init
    assert tuple(attn.sinks[...].sharding.spec) == ("tp",)
    attn.sinks[...] = jax.device_put(_sinks(), attn.sinks[...].sharding)
    ref = reference.Attention(8, 32, num_kv_heads=2, is_causal=True, use_sinks=True, rngs=nnx.Rngs(0))
    nnx.update(ref, nnx.state(attn, nnx.Param))
    x = jax.random.normal(jax.random.key(1), (2, S, 32))
    ct = jax.random.normal(jax.random.key(2), (2, S, 32))
    y, g = _layer_grads(attn, x, ct)
    y_ref, g_ref = _layer_grads(ref, x, ct)
    assert_close(y, y_ref, jnp.float32, "forward")
    assert set(g) == set(g_ref) and "sinks" in g
    for name in g:
        assert_close(g[name], g_ref[name], jnp.float32, name)
    assert float(jnp.abs(g["sinks"]).max()) > 1e-3


def test_linen_module_has_the_sinks_parameter():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    layer = jax_cp.linen.CPAttention(num_heads=8, in_features=32, mesh=mesh, use_sinks=True)
    x = jnp.ones((2, S, 32))
    variables = layer.init(jax.random.key(0), x)
    assert nn.get_partition_spec(variables)["params"]["sinks"] == jax.sharding.PartitionSpec("tp")
    params = dict(nn.unbox(variables)["params"], sinks=_sinks())
    want = reference.attention_layer(params, x, spec=layer.spec)
    assert_close(jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x), want, jnp.float32)


def test_bad_sinks_are_refused_by_name():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    msg = r"sinks \(shape=\(4,\), dtype=float32\) must be a floating array of shape \(num_heads,\)=\(8,\)"
    with pytest.raises(ValueError, match=msg):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, sinks=jnp.zeros(4))
    with pytest.raises(ValueError, match=r"sinks \(shape=\(8,\), dtype=int32\) must be a floating array"):
        kernels.blockwise_attention(q, k, v, q_positions=jnp.zeros((B, S), jnp.int32),
                                    kv_positions=jnp.zeros((B, S), jnp.int32), sinks=jnp.zeros(8, jnp.int32))
    with pytest.raises(ValueError, match=r"use_sinks='yes' must be True or False"):
        jax_cp.CPAttention(8, 32, mesh=mesh, use_sinks="yes", rngs=nnx.Rngs(0))


def test_cudnn_cannot_take_sinks_and_auto_says_so():
    with pytest.raises(ValueError, match=r"kernel='cudnn' cannot serve this call: attention sinks are not an option"):
        kernels.select_kernel("cudnn", platform="gpu", is_causal=False, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=64, sinks=True)
    assert jax_cp.describe_kernel(platform="gpu", use_sinks=True) == (
        "pallas_gpu (auto on gpu: attention sinks are not an option of jax.nn.dot_product_attention's cuDNN path)")
    assert jax_cp.describe_kernel(platform="tpu", use_sinks=True) == "splash (auto on tpu)"
    assert jax_cp.describe_kernel(platform="tpu", use_sinks=True, kv_exchange="ring") == "splash (auto on tpu)"
