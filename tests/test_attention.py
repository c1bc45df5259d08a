"""jax_cp.dot_product_attention equals the single-device reference: forward and gradients."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jax_cp
from jax_cp import reference
from util import MESHES, assert_close, assert_matches, random_qkv

B, S, H, d = 2, 32, 8, 8
KV = (8, 2, 1)  # kv-head ratios 1, 4 and MQA


def _cases():
    """Every mesh x kv ratio; causal, layout and dtype cycle so each mesh sees each."""
    cycle = itertools.cycle(itertools.product((True, False), ("BSHD", "BNSD"), (jnp.float32, jnp.bfloat16)))
    exchanges = itertools.cycle(("all_gather", "all_to_all"))  # the ring has its own tests (test_ring.py)
    for mesh in MESHES:
        for K in KV:
            causal, layout, dtype = next(cycle)
            yield mesh, K, causal, layout, dtype, next(exchanges) if mesh[0] > 1 else "all_gather"


@pytest.mark.parametrize("cut,K,causal,layout,dtype,kv_exchange", list(_cases()))
def test_matches_reference(cut, K, causal, layout, dtype, kv_exchange):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, layout=layout)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=causal, layout=layout,
                                                     kv_exchange=kv_exchange)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal, layout=layout)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{cut=} {K=} {causal=} {layout=} {kv_exchange=}")


# Half of the 2 x 2 x 2 product, each value of each option twice (the mesh sees all eight via _cases).
@pytest.mark.parametrize("causal,layout,dtype", [(True, "BSHD", jnp.float32), (False, "BNSD", jnp.float32),
                                                 (True, "BNSD", jnp.bfloat16), (False, "BSHD", jnp.bfloat16)])
def test_hybrid_tp_all_options(causal, layout, dtype):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, dtype, layout=layout, seed=1)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=causal, layout=layout, scale=0.3)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=causal, layout=layout, scale=0.3)
    assert_matches(f, ref, (q, k, v), ct, dtype)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_axis_types_and_output_sharding(axis_type):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, axis_types=axis_type)
    q, k, v, ct = random_qkv(B, S, H, 4, d)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32)
    out = jax.jit(f)(q, k, v)
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", ("cp_colossal", "cp_ulysses"), "tp", None))
    assert out.sharding.is_equivalent_to(want, out.ndim), out.sharding
    # Eager (un-jitted) call, with inputs already sharded some other way.
    q2 = jax.device_put(q, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "cp_ulysses")))
    np.testing.assert_allclose(f(q2, k, v), ref(q, k, v), atol=2e-5, rtol=2e-5)


def test_make_mesh_shapes():
    mesh = jax_cp.make_mesh(cp_colossal=2, tp=2)
    assert mesh.axis_names == jax_cp.AXES
    assert dict(mesh.shape) == {"dp": 2, "cp_colossal": 2, "cp_ulysses": 1, "tp": 2}
    assert jax_cp.mesh_dims(mesh) == jax_cp.MeshDims(dp=2, c=2, u=1, t=2)
    sub = jax_cp.make_mesh(cp_ulysses=2, devices=jax.devices()[:2], axis_types=AxisType.Auto)
    assert sub.size == 2 and set(sub.axis_types) == {AxisType.Auto}


def _attn(mesh, q, k, v, **kw):
    return jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw)


ERRORS = [
    ("heads", dict(cut=(1, 8, 1), H=4, K=4), r"num_heads=4 is not divisible by tp\*cp_ulysses=1\*8=8"),
    ("gqa", dict(H=8, K=3), r"num_heads=8 is not a multiple of num_kv_heads=3"),
    ("seq", dict(S=34), r"seq_len=34 is not divisible by cp_colossal\*cp_ulysses=2\*2=4"),
    ("batch", dict(cut=(2, 2, 1), B=3), r"batch=3 is not divisible by dp=2"),
    ("layout", dict(kw=dict(layout="SBHD")), r"layout='SBHD' must be one of"),
    ("kernel", dict(kw=dict(kernel="flash")), r"kernel='flash' is not one of"),
    ("window", dict(kw=dict(local_window_size=-1)), r"local_window_size=-1 is negative"),
]


@pytest.mark.parametrize("name,spec,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, spec, match):
    c, u, t = spec.get("cut", (2, 2, 2))
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, _ = random_qkv(spec.get("B", 2), spec.get("S", 32), spec.get("H", 8), spec.get("K", 2), d)
    with pytest.raises(ValueError, match=match):
        _attn(mesh, q, k, v, **spec.get("kw", {}))


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.int32])
def test_non_real_dtypes_are_refused(dtype):
    """Complex (a port of flax's dtype test gave values off by up to 8) and integer inputs: a clear error."""
    mesh = jax_cp.make_mesh(cp_colossal=8)
    q = jnp.ones((2, 32, 8, d), dtype)
    with pytest.raises(ValueError, match=rf"query.dtype={jnp.dtype(dtype)} is not supported.*cast first"):
        _attn(mesh, q, q, q)
    attn = jax_cp.CPAttention(8, 32, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"x.dtype={jnp.dtype(dtype)} is not supported"):
        attn(jnp.ones((2, 32, 32), dtype))


def test_float16_matches_the_reference():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, _ = random_qkv(2, 32, 8, 2, d)
    out = _attn(mesh, *(a.astype(jnp.float16) for a in (q, k, v)), is_causal=True)
    assert out.dtype == jnp.float16
    ref = jax_cp.reference.dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, ref, jnp.float16, "float16")


def test_shape_errors():
    mesh = jax_cp.make_mesh(cp_ulysses=2, tp=2)
    q, k, v, _ = random_qkv(2, 32, 8, 2, d)
    with pytest.raises(ValueError, match=r"query.shape=\(2, 32, 8\) must have rank 4"):
        _attn(mesh, q[..., 0], k, v)
    with pytest.raises(ValueError, match=r"key.shape=\(2, 32, 2, 8\) and value.shape=\(2, 16, 2, 8\) must match"):
        _attn(mesh, q, k, v[:, :16])
    with pytest.raises(ValueError, match=r"key.shape=\(2, 32, 2, 4\) does not fit query.shape=\(2, 32, 8, 8\): "
                                         r"batch and head dim must match"):
        _attn(mesh, q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"key.shape=\(1, 32, 2, 8\) does not fit"):
        _attn(mesh, q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"dtypes float32/bfloat16/float32 must be equal"):
        _attn(mesh, q, k.astype(jnp.bfloat16), v)
    bad = jax.make_mesh((8,), ("x",))
    with pytest.raises(ValueError, match=r"mesh.axis_names=\('x',\) lacks"):
        _attn(bad, q, k, v)
    with pytest.raises(ValueError, match="mesh=None"):
        _attn(None, q, k, v)


def test_spec_replace_derives_the_derived_fields_again():
    """A new in_features or num_heads re-derives head_dim, v_head_dim, out_features and num_kv_heads
    where they were derived; given ones stay."""
    spec = jax_cp.AttentionSpec(num_heads=4, in_features=32)
    assert (spec.head_dim, spec.v_head_dim, spec.out_features, spec.num_kv_heads) == (8, 8, 32, 4)
    wider = spec.replace(in_features=64)
    assert (wider.head_dim, wider.v_head_dim, wider.out_features, wider.num_kv_heads) == (16, 16, 64, 4)
    assert wider == jax_cp.AttentionSpec(num_heads=4, in_features=64)
    more = spec.replace(num_heads=8)
    assert (more.head_dim, more.num_kv_heads) == (4, 8)
    pinned = jax_cp.AttentionSpec(num_heads=4, in_features=32, head_dim=16, v_head_dim=8, out_features=24)
    kept = pinned.replace(in_features=64)
    assert (kept.head_dim, kept.v_head_dim, kept.out_features) == (16, 8, 24)
    assert spec.replace(head_dim=16).v_head_dim == 16  # v_head_dim follows the head dim it came from


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"dp\*cp_colossal\*cp_ulysses\*tp=2\*2\*2\*1=8 does not match the 4 devices"):
        jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"cp_colossal\*cp_ulysses\*tp=3 does not divide the 8 devices"):
        jax_cp.make_mesh(cp_colossal=3)
    with pytest.raises(ValueError, match=r"tp=0 must be a positive integer"):
        jax_cp.make_mesh(tp=0)
