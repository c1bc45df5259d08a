"""Forward+backward wall time of the blockwise kernel vs dense attention on one device, causal and not.

Causal blockwise should take about half of non-causal (hidden blocks are
skipped); dense costs the same either way. Prints a markdown table of median
milliseconds. Measures only; asserts nothing. On a shared CPU the numbers move.

    JAX_PLATFORMS=cpu python benchmarks/kernel_speed.py
    JAX_PLATFORMS=cpu python benchmarks/kernel_speed.py --seq 2048 --reps 5

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_cp import kernels  # noqa: E402


def fwd_bwd(kernel, S, *, B, H, K, d, is_causal, block):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, S, H, d), jnp.float32)
    k, v = (jax.random.normal(kk, (B, S, K, d), jnp.float32) for kk in keys[1:])
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    extra = dict(block_q=block, block_kv=block) if kernel == "blockwise" else {}
    fn = kernels.blockwise_attention if kernel == "blockwise" else kernels.dense_attention
    loss = lambda q, k, v: fn(q, k, v, q_positions=pos, kv_positions=pos, is_causal=is_causal, **extra).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)


def median_ms(f, args, reps: int) -> float:
    jax.block_until_ready(f(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="1024,2048,4096")
    ap.add_argument("--heads", default="4,4,64", help="H,K,d")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    H, K, d = map(int, args.heads.split(","))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; B=1 H={H} K={K} d={d} "
          f"float32, blocks {args.block}; median ms of {args.reps} forward+backward\n")
    print("| S | dense | dense causal | blockwise | blockwise causal | causal / full (blockwise) |")
    print("|---|---|---|---|---|---|")
    for S in map(int, args.seq.split(",")):
        ms = {}
        for kernel in ("xla", "blockwise"):
            for causal in (False, True):
                f, a = fwd_bwd(kernel, S, B=1, H=H, K=K, d=d, is_causal=causal, block=args.block)
                ms[kernel, causal] = median_ms(f, a, args.reps)
        ratio = ms["blockwise", True] / ms["blockwise", False]
        print(f"| {S} | {ms['xla', False]:.0f} | {ms['xla', True]:.0f} | {ms['blockwise', False]:.0f} | "
              f"{ms['blockwise', True]:.0f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
