"""One-device checks of the local kernels and paths, on whatever device JAX runs on: the CPU in CI,
the GPU when ``benchmarks/gpu/check.sh`` runs them there (``-m gpu``, ``JAX_PLATFORMS=cuda``).
Forward and gradients against the reference in float32 and bfloat16; cuDNN where the platform is
a GPU (the only test here that a CPU run cannot take, and says so)."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_cp
from jax_cp import kernels, reference
from util import assert_close, assert_matches, random_qkv

pytestmark = pytest.mark.gpu

B, S, H, K, d = 2, 256, 8, 2, 64


def _one_device():
    return jax_cp.make_mesh(devices=jax.devices()[:1])


def _masks(name):
    pos = jnp.arange(S)
    if name == "causal":
        return dict(is_causal=True)
    if name == "documents":  # two packed documents, the last 16 tokens padding
        seg = jnp.where(pos < 100, 0, 1).at[-16:].set(-1)
        return dict(is_causal=True, segment_ids=seg, positions=jnp.where(pos < 100, pos, pos - 100))
    return dict(is_causal=True, local_window_size=(48, 0))


@pytest.mark.parametrize("kernel", ["blockwise", "xla", "pallas_gpu"])
@pytest.mark.parametrize("mask", ["causal", "documents", "window"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_local_kernels_on_this_device(kernel, mask, dtype):
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=5)
    kw = _masks(mask)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel=kernel, **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{jax.default_backend()} {kernel} {mask}")


def test_auto_kernel_on_this_device():
    """What ``auto`` runs here (cuDNN on a GPU for unmasked bfloat16, else blockwise) equals the reference."""
    q, k, v, ct = random_qkv(B, S, H, K, d, jnp.bfloat16, seed=6)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device())
    assert_matches(f, reference.dot_product_attention, (q, k, v), ct, jnp.bfloat16, jax_cp.describe_kernel())
    expected = "cudnn (auto on gpu)" if jax.default_backend() in ("cuda", "rocm", "gpu") else "blockwise"
    assert jax_cp.describe_kernel().startswith(expected)


def test_auto_runs_the_fused_kernel_under_masks_on_a_gpu():
    """A causal call with positions: the fused Pallas kernel on a GPU (its Triton compile, not
    interpret mode), blockwise elsewhere; either equals the reference."""
    q, k, v, ct = random_qkv(B, S, H, K, d, jnp.bfloat16, seed=8)
    kw = _masks("documents")
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, jnp.bfloat16, jax_cp.describe_kernel(is_causal=True, has_segments=True))
    gpu = kernels.target_platform() == "gpu"
    assert jax_cp.describe_kernel(is_causal=True).startswith("pallas_gpu" if gpu else "blockwise")


def test_cudnn_kernel_needs_a_gpu_and_matches_the_reference():
    q, k, v, ct = random_qkv(B, S, H, K, d, jnp.bfloat16, seed=7)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=_one_device(), kernel="cudnn")
    if kernels.target_platform() != "gpu":
        with pytest.raises(ValueError, match=r"kernel='cudnn' needs a CUDA GPU, but the target platform is"):
            f(q, k, v)
        return
    assert_matches(f, reference.dot_product_attention, (q, k, v), ct, jnp.bfloat16, "cudnn")


@pytest.mark.parametrize("kv_exchange", ["all_gather", "ring"])
def test_module_trains_on_this_device(kv_exchange):
    """``CPAttention`` (causal, RoPE, QK-norm, GQA, two head chunks) on a one-device mesh: loss and
    parameter gradients equal the plain module's."""
    kw = dict(num_kv_heads=K, is_causal=True, use_qk_norm=True, rope_theta=10_000.0)
    attn = jax_cp.CPAttention(H, 128, mesh=_one_device(), overlap_chunks=2, kv_exchange=kv_exchange,
                              rngs=nnx.Rngs(0), **kw)
    ref = reference.Attention(H, 128, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(1), (B, S, 128))

    def grads(module):
        graph, params = nnx.split(module, nnx.Param)
        loss = lambda p: jnp.sum(nnx.merge(graph, p)(x) ** 2)
        value, g = jax.jit(jax.value_and_grad(loss))(params)
        return value, {name: g[name][...] for name in g}

    (loss, g), (r_loss, r_g) = grads(attn), grads(ref)
    assert_close(loss, r_loss, jnp.float32, "loss")
    assert set(g) == set(r_g)
    for name in r_g:
        assert_close(g[name], r_g[name], jnp.float32, name)


def test_device_check_script_and_kernel_benchmark_run_here(tmp_path):
    """``benchmarks/gpu/check.sh`` parses, and its benchmark runs (``--quick``) and writes its table:
    every jax_cp row timed, cuDNN timed on a GPU or its absence stated."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(root / "benchmarks" / "gpu" / "check.sh")]).returncode == 0
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import gpu_kernels
    finally:
        sys.path.remove(str(root / "benchmarks"))
    out = tmp_path / "kernels.md"
    gpu_kernels.main(["--quick", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 8, rows
    timed = [r for r in rows if "jax_cp" in r]
    assert len(timed) == 6 and all(float(r.split("|")[4]) > 0 and float(r.split("|")[5]) > 0 for r in timed), timed
    cudnn = [r for r in rows if "cudnn" in r]
    gpu = kernels.target_platform() == "gpu"
    assert all(("needs a CUDA GPU" in r) != gpu for r in cudnn), cudnn
