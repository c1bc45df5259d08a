"""Per-device temporary memory of forward+backward attention: blockwise (linear) vs dense (quadratic).

Compiles (never runs) ``jax_cp.dot_product_attention`` under ``jax.grad`` on 8
simulated CPU devices for S = 8K ... 128K and prints ``compiled.memory_analysis()``
temporary bytes per device as a markdown table, with the growth per doubling of S.
Measures only; asserts nothing.

    JAX_PLATFORMS=cpu python benchmarks/kernel_memory.py
    JAX_PLATFORMS=cpu python benchmarks/kernel_memory.py --mesh 8,1,1 --seq 8192,16384

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402


def temp_bytes(mesh, S, *, B, H, K, d, dtype, kernel, is_causal, kv_exchange="all_gather") -> int:
    """``temp_size_in_bytes`` of the compiled forward+backward, per device."""
    spec = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    q = jax.ShapeDtypeStruct((B, S, H, d), dtype, sharding=spec)
    kv = jax.ShapeDtypeStruct((B, S, K, d), dtype, sharding=spec)
    loss = lambda q, k, v: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, is_causal=is_causal, kernel=kernel, kv_exchange=kv_exchange).astype(jnp.float32).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="8,1,1;1,8,1", help="c,u,t meshes separated by ';'")
    ap.add_argument("--seq", default="8192,16384,32768,65536,131072")
    ap.add_argument("--kernels", default="blockwise,xla,ring", help="'ring': blockwise with kv_exchange='ring'")
    ap.add_argument("--heads", default="8,8,64", help="H,K,d")
    args = ap.parse_args()
    H, K, d = map(int, args.heads.split(","))
    seqs = [int(s) for s in args.seq.split(",")]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices; "
          f"B=1 H={H} K={K} d={d} bfloat16 causal, forward+backward; MiB of temporaries per device\n")
    print("| mesh (c,u,t) | kernel | " + " | ".join(f"S={s // 1024}K" for s in seqs) + " | growth per 2x S |")
    print("|---|---|" + "---|" * len(seqs) + "---|")
    for cut in args.mesh.split(";"):
        c, u, t = map(int, cut.split(","))
        mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, axis_types=jax.sharding.AxisType.Explicit)
        for kernel in args.kernels.split(","):
            if kernel == "ring" and c == 1:
                continue
            t0 = time.time()
            how = dict(kernel="blockwise", kv_exchange="ring") if kernel == "ring" else dict(kernel=kernel)
            sizes = [temp_bytes(mesh, S, B=1, H=H, K=K, d=d, dtype=jnp.bfloat16, is_causal=True, **how)
                     for S in seqs]
            growth = ", ".join(f"{b / a:.2f}x" for a, b in zip(sizes, sizes[1:]))
            cells = " | ".join(f"{b / 2**20:,.1f}" for b in sizes)
            print(f"| {c},{u},{t} | {kernel} | {cells} | {growth} |  <!-- {time.time() - t0:.0f}s -->", flush=True)


if __name__ == "__main__":
    main()
