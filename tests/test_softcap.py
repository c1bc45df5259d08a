"""Logit soft-capping (``logits_soft_cap=c``: ``c * tanh(logits / c)`` before the mask) on every
kernel and exchange, forward and gradients, against the reference; the reference against a plain
formula; the errors."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import kernels, reference
from util import assert_close, assert_matches, random_qkv

B, S, H, d = 2, 32, 8, 8
CAP = 1.5  # well below the largest scaled logits of these inputs (about 4-5), so capping changes the result


def _plain(q, k, v, cap, scale):
    """Soft-capped causal attention written from the definition (MHA, float32)."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    logits = cap * jnp.tanh(logits / cap)
    logits = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), logits, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)


def test_reference_caps_the_logits_and_capping_matters():
    q, k, v, _ = random_qkv(B, S, H, H, d, seed=3)
    q = q * 3.0  # large logits: the cap bites
    got = reference.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=CAP)
    np.testing.assert_allclose(got, _plain(q, k, v, CAP, d**-0.5), atol=2e-6, rtol=2e-6)
    uncapped = reference.dot_product_attention(q, k, v, is_causal=True)
    assert float(jnp.abs(got - uncapped).max()) > 0.1


@pytest.mark.parametrize("kernel, dtype", [("blockwise", jnp.float32), ("blockwise", jnp.bfloat16),
                                           ("xla", jnp.float32), ("splash", jnp.float32)])
def test_local_kernels_cap_with_exact_gradients(kernel, dtype):
    """Causal with packed documents, GQA, blocks that do not divide the lengths (blockwise)."""
    q, k, v, ct = random_qkv(B, 40, H, 2, d, dtype, seed=4)
    q = q * 3.0
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (B, 40))
    seg = pos // 17
    meta = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, is_causal=True,
                logits_soft_cap=CAP)
    extra = dict(block_q=12, block_kv=16) if kernel == "blockwise" else {}
    extra |= dict(interpret=True) if kernel == "splash" else {}
    fn = {"blockwise": kernels.blockwise_attention, "xla": kernels.dense_attention,
          "splash": kernels.splash_attention}[kernel]
    assert_matches(lambda q, k, v: fn(q, k, v, **meta, **extra),
                   lambda q, k, v: reference.attend(q, k, v, **meta), (q, k, v), ct, dtype, kernel)


# On every exchange (all-gather, all_to_all, ring; Ulysses, hybrid, tp; causal, balanced, packed,
# windowed) the cap is checked with the sinks and the max-logit statistic in one call:
# tests/test_sinks.py::test_every_exchange_with_sinks_soft_cap_and_max_logits.


def test_ring_with_splash_caps():
    """The splash ring (interpret mode): the cap rides in the kernel's static settings, every step."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=6)
    q = q * 3.0
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, kv_exchange="ring",
                                                     kernel="splash", logits_soft_cap=CAP)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=CAP)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, "splash ring")


def test_module_caps_like_the_reference_layer():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(8, 32, num_kv_heads=2, mesh=mesh, is_causal=True, logits_soft_cap=2.0,
                              rngs=nnx.Rngs(0))
    x = 4.0 * jax.random.normal(jax.random.key(1), (2, S, 32))
    params = {name: getattr(attn, name)[...] for name in ("q_kernel", "k_kernel", "v_kernel", "o_kernel")}
    want = reference.attention_layer(params, x, spec=attn.spec)
    assert_close(nnx.jit(lambda m, x: m(x))(attn, x), want, jnp.float32)
    uncapped = reference.attention_layer(params, x, spec=attn.spec.replace(logits_soft_cap=None))
    assert float(jnp.abs(want - uncapped).max()) > 1e-3


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "50", True])
def test_bad_caps_are_refused_by_name(value):
    msg = rf"logits_soft_cap={value!r} must be a positive number \(e\.g\. 50\.0, Gemma 2's\) or None"
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    with pytest.raises(ValueError, match=msg):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, logits_soft_cap=value)
    with pytest.raises(ValueError, match=msg):
        jax_cp.CPAttention(8, 32, mesh=mesh, logits_soft_cap=value, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=msg):
        kernels.blockwise_attention(q, k, v, q_positions=jnp.zeros((B, S), jnp.int32),
                                    kv_positions=jnp.zeros((B, S), jnp.int32), logits_soft_cap=value)


def test_cudnn_cannot_cap_and_auto_says_so():
    with pytest.raises(ValueError, match=r"kernel='cudnn' cannot serve this call: logits_soft_cap is not an option"):
        kernels.select_kernel("cudnn", platform="gpu", is_causal=False, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=64, soft_cap=True)
    assert jax_cp.describe_kernel(platform="gpu", logits_soft_cap=30.0) == (
        "pallas_gpu (auto on gpu: logits_soft_cap is not an option of jax.nn.dot_product_attention's cuDNN path)")
    assert jax_cp.describe_kernel(platform="gpu") == "cudnn (auto on gpu)"
    assert jax_cp.describe_kernel(platform="tpu", logits_soft_cap=30.0) == "splash (auto on tpu)"
