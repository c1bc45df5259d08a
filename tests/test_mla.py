"""MLA-shaped heads: a value head dim (``v_head_dim``) other than the query/key head dim, through every
exchange (the Ulysses all-to-all and the K/V collectives move the right sizes), the blockwise and
splash kernels, and both modules (``v_kernel [D, K, dv]``, ``o_kernel [H, dv, E]``), against the
reference: forward and gradients."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_cp
import jax_cp.linen
from jax_cp import kernels, load_balance, reference
from util import assert_close, assert_matches

B, S, H, K, d, dv = 2, 32, 8, 2, 16, 8


def _qkv(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((B, S, H, d), (B, S, K, d), (B, S, K, dv), (B, S, H, dv))
    return tuple(jax.random.normal(key, shape) for key, shape in zip(keys, shapes))


@pytest.mark.parametrize("layout, kv_exchange, kernel, balanced", [
    ((2, 2, 2), "all_gather", "auto", False),   # hybrid x tp: K and V joined in one all-gather
    ((2, 4, 1), "all_to_all", "auto", True),    # K and V joined in one all-to-all over both CP axes
    ((4, 2, 1), "ring", "auto", True),          # the ring moves K and V chunks of their own sizes
    ((2, 2, 1), "ring", "splash", False),       # the splash ring (interpret mode)
])
def test_every_exchange_with_a_value_head_dim_of_its_own(layout, kv_exchange, kernel, balanced):
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = _qkv()
    pos = None
    if balanced:
        (q, k, v, ct), pos = load_balance.reorder((q, k, v, ct), mesh)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos,
                                                     kv_exchange=kv_exchange, kernel=kernel)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, positions=pos)
    assert f(q, k, v).shape == (B, S, H, dv)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{layout} {kv_exchange} {kernel}")


def _param_grads(module, x):
    graph, params = nnx.split(module, nnx.Param)
    loss = lambda params: jnp.sum(nnx.merge(graph, params)(x) ** 2)
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, {name: grads[name][...] for name in grads}


@pytest.mark.parametrize("knobs", [dict(overlap_chunks=2, fused_qkv_chunks=2, kv_exchange="all_gather"),
                                   dict(overlap_chunks=2, fused_qkv_chunks=0, kv_exchange="ring")])
def test_module_with_value_head_dim_and_out_features(knobs):
    """Q, K and V of different head dims share one Ulysses all-to-all (fused chunks), or K and V
    ride the ring; QK-norm and RoPE on q and k only; the output projects to ``out_features``."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    kw = dict(num_kv_heads=K, head_dim=d, v_head_dim=dv, out_features=24, is_causal=True, use_qk_norm=True,
              rope_theta=10_000.0, use_bias=True)
    attn = jax_cp.CPAttention(H, 32, mesh=mesh, rngs=nnx.Rngs(0), **kw, **knobs)
    assert attn.v_kernel[...].shape == (32, K, dv) and attn.o_kernel[...].shape == (H, dv, 24)
    ref = reference.Attention(H, 32, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(1), (B, S, 32))
    loss, grads = _param_grads(attn, x)
    r_loss, r_grads = _param_grads(ref, x)
    assert_close(loss, r_loss, jnp.float32, "loss")
    assert set(grads) == set(r_grads)
    for name in grads:
        assert_close(grads[name], r_grads[name], jnp.float32, name)


def test_linen_module_with_value_head_dim():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=4)
    layer = jax_cp.linen.CPAttention(num_heads=H, in_features=32, head_dim=d, v_head_dim=dv, mesh=mesh)
    x = jax.random.normal(jax.random.key(2), (B, S, 32))
    params = nn.unbox(layer.init(jax.random.key(0), x))["params"]
    assert params["v_kernel"].shape == (32, H, dv) and params["o_kernel"].shape == (H, dv, 32)
    want = reference.attention_layer(params, x, spec=layer.spec)
    assert_close(jax.jit(lambda p, x: layer.apply({"params": p}, x))(params, x), want, jnp.float32)


def test_value_head_dim_errors_and_cudnn():
    with pytest.raises(ValueError, match=r"v_head_dim=0 must be a positive integer"):
        jax_cp.AttentionSpec(num_heads=H, head_dim=d, v_head_dim=0)
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match=r"key.shape=\(2, 32, 2, 16\) and value.shape=\(2, 16, 2, 8\) must match but "
                                         r"for the head dim"):
        jax_cp.dot_product_attention(q, k, v[:, :16], mesh=mesh)
    with pytest.raises(ValueError, match=r"kernel='cudnn' cannot serve this call: a value head dim \(8\) other than"):
        kernels.select_kernel("cudnn", platform="gpu", is_causal=False, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=16, v_head_dim=8)
