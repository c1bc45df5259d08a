"""CPAttention (NNX and Linen) equals the single-device reference module: output and all gradients."""
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from jax_cp import reference
from util import MESHES, assert_close, fwd_and_vjp

B, S, D, H, d = 2, 16, 32, 8, 8


def _split(model):
    gd, state = nnx.split(model)
    return (lambda state, x, **kw: nnx.merge(gd, state)(x, **kw)), state


def compare_with_reference(cp, ref_kwargs, x, dtype, what="", **call):
    """Copies cp's parameters into a reference module and compares output and every gradient."""
    ref = reference.Attention(H, D, head_dim=d, rngs=nnx.Rngs(99), dtype=cp.dtype, **ref_kwargs)
    f, state = _split(cp)
    fr, rstate = _split(ref)
    nnx.replace_by_pure_dict(rstate, jax.tree.map(np.asarray, nnx.to_pure_dict(state)))
    ct = jax.random.normal(jax.random.key(7), x.shape, jnp.float32).astype(dtype)
    out, (g_state, g_x) = fwd_and_vjp(lambda s, x: f(s, x, **call), (state, x), ct)
    r_out, (r_state, r_x) = fwd_and_vjp(lambda s, x: fr(s, x, **call), (rstate, x), ct)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, r_out, dtype, f"output {what}")
    assert_close(g_x, r_x, dtype, f"dx {what}")
    g, r = nnx.to_pure_dict(g_state), nnx.to_pure_dict(r_state)
    assert set(g) == set(r) and {"q_kernel", "k_kernel", "v_kernel", "o_kernel"} <= set(g)
    for name in g:
        assert_close(g[name], r[name], dtype, f"d{name} {what}")


def _cases():
    kv = itertools.cycle((8, 2, 1))
    extras = itertools.cycle([
        dict(use_qk_norm=True, rope_theta=10_000.0), dict(), dict(use_bias=True, rope_theta=500.0),
        dict(use_qk_norm=True, use_bias=True),
    ])
    dtypes = itertools.cycle((jnp.float32, jnp.float32, jnp.bfloat16))
    exchanges = itertools.cycle(("all_to_all", "all_gather"))
    fuses = itertools.cycle((True, False))
    for i, (c, u, t) in enumerate(MESHES):
        local = H // (t * u)
        chunks = (1, 2, local)[i % 3] if local % 2 == 0 or i % 3 != 1 else 1
        ex = next(exchanges) if c > 1 else "all_gather"
        # Q, K, V in one Ulysses all-to-all: every chunk, or the first of several
        fused = (chunks if next(fuses) or chunks == 1 else 1) if u > 1 and ex != "all_to_all" else 0
        yield (c, u, t), next(kv), chunks, next(extras), next(dtypes), bool(i % 2), ex, fused


# Hybrid kv_exchange="all_to_all" with several chunks: the chunk-to-chunk gradient ties
# (tie_cotangents) on the path the TPU overlap table measures.
A2A_CHUNKED = [((2, 2, 2), 2, 2, dict(use_qk_norm=True, rope_theta=10_000.0), jnp.float32, True, "all_to_all", 0),
               ((2, 2, 1), 1, 4, dict(use_bias=True), jnp.bfloat16, False, "all_to_all", 0)]


@pytest.mark.parametrize("cut,K,chunks,extra,dtype,causal,kv_exchange,fused", list(_cases()) + A2A_CHUNKED)
def test_nnx_matches_reference(cut, K, chunks, extra, dtype, causal, kv_exchange, fused):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    kw = dict(num_kv_heads=K, is_causal=causal, **extra)
    cp = jax_cp.CPAttention(H, D, head_dim=d, mesh=mesh, overlap_chunks=chunks, dtype=dtype, rngs=nnx.Rngs(0),
                            kv_exchange=kv_exchange, fused_qkv_chunks=fused, **kw)
    x = jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32).astype(dtype)
    compare_with_reference(cp, kw, x, dtype, f"{cut=} {K=} {chunks=} {extra} {kv_exchange=} {fused=}")


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_overlap_chunks_gqa_hybrid(chunks):
    """Chunking with grouped kv heads on a hybrid tp mesh: head order survives the chunked all-to-alls."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    H16 = 16
    cp = jax_cp.CPAttention(H16, D, num_kv_heads=4, head_dim=d, mesh=mesh, overlap_chunks=chunks,
                            rope_theta=10_000.0, is_causal=True, rngs=nnx.Rngs(0))
    ref = reference.Attention(H16, D, num_kv_heads=4, head_dim=d, rope_theta=10_000.0, is_causal=True,
                              rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (B, S, D))
    np.testing.assert_allclose(jax.jit(lambda x: cp(x))(x), ref(x), atol=2e-5, rtol=2e-5)


def test_same_rngs_same_parameters_and_sharding():
    mesh = jax_cp.make_mesh(cp_ulysses=2, tp=2, dp=2)
    cp = jax_cp.CPAttention(H, D, num_kv_heads=2, mesh=mesh, use_bias=True, rngs=nnx.Rngs(3))
    ref = reference.Attention(H, D, num_kv_heads=2, use_bias=True, rngs=nnx.Rngs(3))
    for name, value in nnx.to_pure_dict(nnx.state(ref)).items():
        np.testing.assert_array_equal(np.asarray(getattr(cp, name)[...]), np.asarray(value))
    assert cp.q_kernel[...].sharding.spec == P(None, "tp", None)
    assert cp.o_kernel[...].sharding.spec == P("tp", None, None)
    specs = nnx.get_partition_spec(nnx.state(cp))
    assert specs["k_kernel"].get_value() == P(None, "tp", None)
    assert specs["q_bias"].get_value() == P("tp", None)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_jit_init_and_optax_step(axis_type):
    """Initialised sharded inside jit (no full copy on one device), then trained with optax."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=axis_type)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: jax_cp.CPAttention(H, D, num_kv_heads=1, mesh=mesh, is_causal=True,
                                                   rngs=nnx.Rngs(0)))()
    assert model.v_kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, None)), 3)
    assert model.q_kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp", None)), 3)
    opt = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    target = jnp.roll(x, 1, axis=-1)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, x)) for _ in range(5)]
    assert losses[-1] < losses[0], losses
    assert model.q_kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp", None)), 3)


@pytest.mark.parametrize("cut", [(2, 2, 2), (1, 4, 2), (4, 1, 1)])
def test_linen_matches_reference(cut):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    kw = dict(num_kv_heads=2, is_causal=True, use_qk_norm=True, rope_theta=10_000.0, use_bias=True)
    model = jax_cp.linen.CPAttention(H, D, head_dim=d, mesh=mesh, overlap_chunks=2 if u * t < 8 else 1, **kw)
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    variables = model.init(jax.random.key(0), x)
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["q_kernel"] == P(None, "tp", None) and specs["o_kernel"] == P("tp", None, None)
    params = nn.unbox(variables)["params"]
    ref = reference.Attention(H, D, head_dim=d, rngs=nnx.Rngs(0), **kw)
    fr, rstate = _split(ref)
    nnx.replace_by_pure_dict(rstate, jax.tree.map(np.asarray, params))
    ct = jax.random.normal(jax.random.key(7), x.shape)
    out, (g, gx) = fwd_and_vjp(lambda p, x: model.apply({"params": p}, x), (params, x), ct)
    r_out, (rg, rgx) = fwd_and_vjp(fr, (rstate, x), ct)
    assert_close(out, r_out, jnp.float32, "linen output")
    assert_close(gx, rgx, jnp.float32, "linen dx")
    rg = nnx.to_pure_dict(rg)
    for name in params:
        assert_close(g[name], rg[name], jnp.float32, f"linen d{name}")


def test_module_errors():
    mesh = jax_cp.make_mesh(cp_ulysses=4, tp=2)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by tp\*cp_ulysses=2\*4=8"):
        jax_cp.CPAttention(4, D, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"overlap_chunks=3 does not divide the 2 query heads per device"):
        jax_cp.CPAttention(16, D, mesh=mesh, overlap_chunks=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mesh=None: pass the mesh"):
        jax_cp.CPAttention(8, D, mesh=None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_heads=8 is not a multiple of num_kv_heads=3"):
        jax_cp.CPAttention(8, D, num_kv_heads=3, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=30 is not divisible by num_heads=8"):
        jax_cp.CPAttention(8, 30, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"fused_qkv_chunks=1 cannot be combined with kv_exchange='all_to_all'.*"
                                         r"Use kv_exchange='all_gather' or 'ring', or fused_qkv_chunks=0"):
        jax_cp.CPAttention(8, D, mesh=mesh, kv_exchange="all_to_all", fused_qkv_chunks=1, rngs=nnx.Rngs(0))
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match=rf"fused_qkv_chunks={bad!r} must be an integer from 0 to overlap_chunks=2"):
            jax_cp.CPAttention(16, D, mesh=mesh, overlap_chunks=2, fused_qkv_chunks=bad, rngs=nnx.Rngs(0))
    attn = jax_cp.CPAttention(8, D, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x.shape=\(2, 16, 16\) must be \(batch, seq_len, in_features=32\)"):
        attn(jnp.zeros((2, 16, 16)))
    with pytest.raises(ValueError, match=r"mesh=None: pass the mesh"):
        jax_cp.linen.CPAttention(8, D).init(jax.random.key(0), jnp.zeros((2, 16, D)))


def test_tie_cotangents_is_identity_with_a_backward_barrier():
    """The layer's chunk-to-chunk tie: values and gradients pass unchanged; the two cotangents
    meet in one optimization barrier in the backward, and the forward has none."""
    from jax_cp._projection import tie_cotangents

    def f(a, b):
        x, y = tie_cotangents(a, b)
        return (2 * x).sum() + (y ** 2).sum()

    a, b = jnp.arange(3.0), jnp.array([[1.0, -2.0], [0.5, 3.0]])
    x, y = tie_cotangents(a, b)
    np.testing.assert_array_equal(x, a)
    np.testing.assert_array_equal(y, b)
    ga, gb = jax.grad(f, argnums=(0, 1))(a, b)
    np.testing.assert_array_equal(ga, np.full(3, 2.0))
    np.testing.assert_array_equal(gb, 2 * b)
    assert "optimization_barrier" not in str(jax.make_jaxpr(f)(a, b))
    assert str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(a, b)).count("optimization_barrier") == 1
