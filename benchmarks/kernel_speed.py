"""The blockwise kernel's achieved GFLOP/s next to plain matmuls of the same FLOPs, same run, one device.

Two local shapes, as one device holds them: Ulysses-like (1 head, all S queries) and all-gather-like
(8 heads, the last S/8 queries against all S keys), causal and full, forward and forward+backward.
The practical limit on this machine is the rate of two plain batched matmuls (``[H, T, d] @ [H, d,
S]``, then ``@ [H, S, d]``: the kernel's forward FLOPs, full mask) measured in the same run; the
kernel's rate counts the FLOPs it must do (visible query-key pairs x 4 d per head forward, x 3.5
for forward+backward: the backward recomputes the scores and runs four more matmuls). Repetitions
are interleaved round-robin; the minimum is kept. Measures only; asserts nothing.

    JAX_PLATFORMS=cpu python benchmarks/kernel_speed.py
    JAX_PLATFORMS=cpu python benchmarks/kernel_speed.py --seq 4096 --reps 3 --block-q 512 --block-kv 512

Letters: T queries, S keys, H heads, d head dim.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_cp import kernels  # noqa: E402


def shapes(S: int):
    """``(name, T, H)``: the two local shapes of one device at global length ``S``."""
    return [("Ulysses-like", S, 1), ("all-gather-like", S // 8, 8)]


def visible_pairs(T: int, S: int, causal: bool) -> int:
    """Query-key pairs the last ``T`` queries of ``S`` tokens see."""
    if not causal:
        return T * S
    return T * S - T * (T - 1) // 2


def kernel_fn(T, S, H, d, *, causal, grad, block_q, block_kv):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, T, H, d), jnp.float32)
    k, v = (jax.random.normal(kk, (1, S, H, d), jnp.float32) for kk in keys[1:])
    q_pos, kv_pos = jnp.arange(S - T, S, dtype=jnp.int32)[None], jnp.arange(S, dtype=jnp.int32)[None]
    f = lambda q, k, v: kernels.blockwise_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos,
                                                    is_causal=causal, block_q=block_q, block_kv=block_kv)
    if grad:
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))), (q, k, v)
    return jax.jit(f), (q, k, v)


def matmul_fn(T, S, H, d):
    keys = jax.random.split(jax.random.key(1), 3)
    a = jax.random.normal(keys[0], (H, T, d), jnp.float32)
    b = jax.random.normal(keys[1], (H, d, S), jnp.float32)
    c = jax.random.normal(keys[2], (H, S, d), jnp.float32)
    return jax.jit(lambda a, b, c: jnp.einsum("hts,hsd->htd", jnp.einsum("htd,hds->hts", a, b), c)), (a, b, c)


def timed(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="global sequence length S")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-q", type=int, default=None, help="default: jax_cp.kernels.auto_blocks")
    ap.add_argument("--block-kv", type=int, default=None)
    args = ap.parse_args()
    S, d = args.seq, args.head_dim
    load0 = os.getloadavg()
    cases = {}  # (shape name, mask, pass) -> (fn, args, flops)
    limits = {}  # shape name -> (fn, args, flops)
    for name, T, H in shapes(S):
        limits[name] = (*matmul_fn(T, S, H, d), 4 * T * S * H * d)
        for causal in (False, True):
            for grad in (False, True):
                fn, fargs = kernel_fn(T, S, H, d, causal=causal, grad=grad, block_q=args.block_q,
                                      block_kv=args.block_kv)
                flops = 4 * visible_pairs(T, S, causal) * H * d * (3.5 if grad else 1.0)
                cases[name, "causal" if causal else "full", "fwd+bwd" if grad else "fwd"] = (fn, fargs, flops)
    runs = {**{("limit", n): v for n, v in limits.items()}, **cases}
    for fn, fargs, _ in runs.values():
        jax.block_until_ready(fn(*fargs))  # compile and warm up
    best = {key: float("inf") for key in runs}
    for _ in range(args.reps):
        for key, (fn, fargs, _) in runs.items():
            best[key] = min(best[key], timed(fn, fargs))
    rate = {key: runs[key][2] / best[key] / 1e9 for key in runs}
    load1 = os.getloadavg()
    print(f"jax {jax.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, one {jax.devices()[0].platform} "
          f"device; S={S}, d={d}, float32, blocks {args.block_q or 'auto'} x {args.block_kv or 'auto'} "
          f"(auto: {kernels.auto_blocks(1, 8, 'cpu')} at 8 heads); min of {args.reps} interleaved repetitions")
    fmt = lambda load: ", ".join(f"{x:.2f}" for x in load)
    print(f"load average at start {fmt(load0)}; at end {fmt(load1)}\n")
    print("| local shape | T x S, heads | mask | pass | kernel s | kernel GFLOP/s | matmul GFLOP/s | ratio |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for name, T, H in shapes(S):
        lim = rate["limit", name]
        for mask in ("full", "causal"):
            for kind in ("fwd", "fwd+bwd"):
                key = (name, mask, kind)
                print(f"| {name} | {T} x {S}, {H} | {mask} | {kind} | {best[key]:.3f} | {rate[key]:.1f} | {lim:.1f} | "
                      f"{rate[key] / lim:.2f} |")


if __name__ == "__main__":
    main()
