"""The max-logit statistic (``return_max_logits`` / ``record_max_logits``, for QK-clip / MuonClip):
per query head, the largest logit that entered the softmax over the visible pairs, reduced over the
whole mesh; equal to the reference's on every kernel, exchange and mask, without changing the output
or its gradients; the modules sow it; kernels that cannot produce it say so."""
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
from jax_cp import kernels, reference
from util import assert_close, fwd_and_vjp, random_qkv

B, S, H, d = 2, 32, 8, 8


def test_reference_statistic_is_the_largest_visible_logit():
    q, k, v, _ = random_qkv(B, S, H, 2, d, seed=1)
    seg = jnp.arange(S) // 10
    _, got = reference.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg, return_max_logits=True)
    kk = jnp.repeat(k, H // 2, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, kk) * d**-0.5
    visible = (jnp.arange(S)[:, None] >= jnp.arange(S)[None]) & (seg[:, None] == seg[None])
    want = jnp.where(visible, logits, -jnp.inf).max((0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(jnp.max(want)) > float(jnp.where(visible, -jnp.inf, logits).max()) - 10  # a real maximum
    # Every token padding (segment -1): no head sees a key.
    _, none = reference.dot_product_attention(q, k, v, segment_ids=jnp.full((S,), -1), return_max_logits=True)
    assert bool(jnp.all(none == -jnp.inf))


@pytest.mark.parametrize("kernel, dtype", [("blockwise", jnp.float32), ("blockwise", jnp.bfloat16),
                                           ("xla", jnp.float32)])
def test_local_kernels_report_the_maximum(kernel, dtype):
    """Packed documents, a window, a soft cap (the statistic is of the capped logits), GQA, blocks
    that do not divide the lengths; rows with no key (padding) do not count."""
    q, k, v, _ = random_qkv(B, 40, H, 2, d, dtype, seed=2)
    q = q * 3.0
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (B, 40))
    seg = jnp.where(pos < 36, pos // 17, -1)
    meta = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, is_causal=True,
                local_window_size=(9, 0), logits_soft_cap=2.5, return_max_logits=True)
    extra = dict(block_q=12, block_kv=16) if kernel == "blockwise" else {}
    fn = {"blockwise": kernels.blockwise_attention, "xla": kernels.dense_attention}[kernel]
    o, m = jax.jit(lambda q, k, v: fn(q, k, v, **meta, **extra))(q, k, v)
    r_o, r_m = reference.attend(q, k, v, **meta)
    assert m.shape == (H,) and m.dtype == jnp.float32
    assert_close(m, r_m, dtype, "max logits")
    assert_close(o, r_o, dtype, "output")
    assert float(m.max()) < 2.5  # capped


def test_the_statistic_leaves_the_output_and_its_gradients_unchanged():
    """Hybrid ring with dp = 2 (the statistic's pmax spans dp, cp_colossal and cp_ulysses): output and
    gradients with it equal those without it (every exchange's statistic against the reference:
    tests/test_sinks.py::test_every_exchange_with_sinks_soft_cap_and_max_logits)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=3)
    kw = dict(mesh=mesh, kv_exchange="ring", is_causal=True)
    with_stat = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, return_max_logits=True, **kw)
    (out, m), grads = fwd_and_vjp(with_stat, (q, k, v), (ct, jnp.zeros(H)))
    plain, plain_grads = fwd_and_vjp(lambda q, k, v: jax_cp.dot_product_attention(q, k, v, **kw), (q, k, v), ct)
    assert_close(out, plain, jnp.float32, "output")
    for g, pg in zip(grads, plain_grads):
        assert_close(g, pg, jnp.float32, "grads")
    _, r_m = reference.dot_product_attention(q, k, v, is_causal=True, return_max_logits=True)
    assert_close(m, r_m, jnp.float32)


def test_sinks_are_not_logits_of_the_statistic():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, H, d, seed=4)
    sinks = jnp.full((H,), 50.0)  # far above every logit
    _, m = jax.jit(lambda q: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring", sinks=sinks,
                                                          return_max_logits=True))(q)
    _, r_m = reference.dot_product_attention(q, k, v, return_max_logits=True)
    assert_close(m, r_m, jnp.float32)
    assert float(m.max()) < 10.0


def test_nnx_module_sows_the_statistic_inside_a_jitted_train_step():
    """A QK-clip-shaped step: gradients and the sown ``max_logits`` come out of one ``nnx.jit``; the
    value equals the reference layer's (same parameters) and the module's output is unchanged."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    kw = dict(num_kv_heads=2, is_causal=True, record_max_logits=True)
    attn = jax_cp.CPAttention(8, 32, mesh=mesh, overlap_chunks=2, rngs=nnx.Rngs(0), **kw)
    ref = reference.Attention(8, 32, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(1), (2, S, 32))

    @nnx.jit
    def step(model, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return loss, grads, nnx.pop(model, nnx.Intermediate)

    loss, grads, sown = step(attn, x)
    r_loss, _, r_sown = step(ref, x)
    m, r_m = sown["max_logits"].get_value()[0], r_sown["max_logits"].get_value()[0]
    assert m.shape == (8,) and tuple(m.sharding.spec) == ("tp",)
    assert_close(m, r_m, jnp.float32, "max logits")
    assert_close(loss, r_loss, jnp.float32, "loss")
    plain = jax_cp.CPAttention(8, 32, mesh=mesh, overlap_chunks=2, rngs=nnx.Rngs(0),
                               **(kw | dict(record_max_logits=False)))
    assert_close(nnx.jit(lambda m, x: m(x))(plain, x), nnx.jit(lambda m, x: m(x))(attn, x), jnp.float32)


def test_linen_module_sows_into_intermediates():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=4)
    layer = jax_cp.linen.CPAttention(num_heads=8, in_features=32, mesh=mesh, record_max_logits=True)
    x = jax.random.normal(jax.random.key(2), (2, S, 32))
    params = nn.unbox(layer.init(jax.random.key(0), x))["params"]
    y, state = jax.jit(lambda p, x: layer.apply({"params": p}, x, mutable=["intermediates"]))(params, x)
    want_y, want_m = reference.attention_layer(params, x, spec=layer.spec)
    assert_close(state["intermediates"]["max_logits"][0], want_m, jnp.float32)
    assert_close(y, want_y, jnp.float32)


def test_kernels_without_the_statistic_say_so():
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: the max-logit statistic "
                                         r"\(record_max_logits\) is not among the splash kernel's outputs"):
        kernels.select_kernel("splash", platform="tpu", is_causal=True, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=64, max_logits=True)
    assert jax_cp.describe_kernel(platform="tpu", record_max_logits=True) == (
        "blockwise (auto on tpu: the max-logit statistic (record_max_logits) is not among the splash kernel's "
        "outputs)")
    assert jax_cp.describe_kernel(platform="gpu", record_max_logits=True).startswith(
        "pallas_gpu (auto on gpu: jax.nn.dot_product_attention's cuDNN path does not return the max-logit")
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: the max-logit statistic"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="splash", kv_exchange="ring", return_max_logits=True)
    with pytest.raises(ValueError, match=r"record_max_logits=1 must be True or False"):
        jax_cp.CPAttention(8, 32, mesh=mesh, record_max_logits=1, rngs=nnx.Rngs(0))
