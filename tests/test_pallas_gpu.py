"""The fused Pallas GPU kernel (``kernel="pallas_gpu"``): forward and gradients against the reference in
Pallas interpret mode on the CPU devices, through every exchange; its Triton lowering for CUDA (built
here without a GPU); what ``auto`` picks on a GPU. The one-device tests are ``-m gpu`` too: on a GPU
(``benchmarks/gpu/check.sh``) they run the Triton-compiled kernel."""
import jax
import jax.numpy as jnp
import pytest

import jax_cp
from jax_cp import kernels, load_balance, reference
from jax_cp.kernels import _pallas_gpu
from util import assert_matches, random_qkv


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _one_device():
    return jax_cp.make_mesh(devices=jax.devices()[:1])


S = 48
LB_POS = jnp.concatenate([jnp.arange(12), jnp.arange(36, 48), jnp.arange(12, 24), jnp.arange(24, 36)])
DOCS = jnp.where(jnp.arange(S) < 20, 0, 1).at[-4:].set(-1)  # two packed documents, 4 padding tokens


@pytest.mark.gpu  # one device: on a GPU (benchmarks/gpu/check.sh) the Triton-compiled kernel runs
@pytest.mark.parametrize("what,kw,heads", [
    ("causal GQA", dict(is_causal=True), (4, 2)),
    ("load-balanced order", dict(is_causal=True, positions=LB_POS), (4, 2)),
    ("packed documents, MQA", dict(is_causal=True, segment_ids=DOCS), (4, 1)),
    ("window, soft cap", dict(is_causal=True, local_window_size=(9, 0), logits_soft_cap=2.5), (2, 2)),
    ("bidirectional", {}, (2, 1)),
])
def test_kernel_matches_the_reference(what, kw, heads):
    H, K = heads
    q, k, v, ct = random_qkv(2, S, H, K, 16, seed=1)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="pallas_gpu", block_q=16,
                                                     block_kv=16, **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, what)


@pytest.mark.gpu
def test_kernel_in_bfloat16_with_sinks_and_statistics():
    q, k, v, ct = random_qkv(1, S, 4, 2, 16, jnp.bfloat16, seed=2)
    sinks = jnp.array([0.5, -1.0, 0.0, 2.0])
    kw = dict(is_causal=True, sinks=sinks, block_q=16, block_kv=16)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="pallas_gpu", **kw)
    ref = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="xla", **kw)
    assert_matches(f, ref, (q, k, v), ct, jnp.bfloat16, "bf16 sinks")
    o, m = jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="pallas_gpu", return_max_logits=True,
                                        **kw)
    _, r = jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="xla", return_max_logits=True, **kw)
    assert jnp.allclose(m, r, atol=0.05), (m, r)


@pytest.mark.parametrize("layout,kv_exchange", [((1, 4, 2), "all_gather"), ((4, 1, 2), "ring"),
                                                 ((2, 2, 2), "ring"), ((4, 2, 1), "all_to_all")])
def test_every_exchange_runs_it(layout, kv_exchange):
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(2, 64, 8, 4, 16, seed=3)
    pos = load_balance.positions(64, mesh)  # causal load balancing: each chunk two position runs
    kw = dict(is_causal=True, positions=pos)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="pallas_gpu", kv_exchange=kv_exchange,
                                                     block_q=8, block_kv=8, **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{layout} {kv_exchange}")


def test_kernels_lower_to_triton_for_cuda():
    """The Pallas kernels (forward, dQ, dK/dV) go through the Triton lowering for CUDA, built on this
    CPU machine for an abstract H200 (the kernels see a GPU target: no interpret mode): every op they
    use is one Triton serves (a GPU would compile them next)."""
    q, k, v, _ = random_qkv(2, 96, 4, 2, 64, jnp.bfloat16, seed=4)
    seg = jnp.where(jnp.arange(96) < 40, 0, 1)

    def loss(q, k, v):
        o = jax_cp.kernels.PALLAS_GPU.attend(q, k, v, q_positions=jnp.arange(96), kv_positions=jnp.arange(96),
                                             q_segment_ids=seg, kv_segment_ids=seg, is_causal=True,
                                             local_window_size=(32, 0), logits_soft_cap=30.0)
        return jnp.sum(o.astype(jnp.float32))

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        assert kernels.target_platform() == "gpu" and not _pallas_gpu._interpret()
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3, text.count("__gpu$xla.gpu.triton")
    for name in ("jax_cp_flash_fwd", "jax_cp_flash_dq", "jax_cp_flash_dkv"):
        assert name in text


def test_auto_picks_it_on_a_gpu_for_every_mask_cudnn_cannot_state():
    base = {"is_causal": False, "window": None, "has_segments": False, "dtype": jnp.bfloat16, "head_dim": 128}
    sel = lambda **kw: kernels.select_kernel("auto", platform="gpu", **(base | kw))
    assert sel() == "cudnn"
    assert sel(is_causal=True) == sel(has_segments=True) == sel(window=(128, 0)) == "pallas_gpu"
    assert sel(is_causal=True, head_dim=512) == "blockwise"
    assert jax_cp.describe_kernel(platform="gpu", is_causal=True).startswith("pallas_gpu (auto on gpu: is_causal=True")
    assert jax_cp.describe_kernel(platform="gpu", is_causal=True, kv_exchange="ring").startswith("pallas_gpu (auto on gpu")
    with pytest.raises(ValueError, match=r"kernel='pallas_gpu' cannot serve this call: head_dim=512 is above"):
        kernels.select_kernel("pallas_gpu", platform="gpu", is_causal=True, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=512)
