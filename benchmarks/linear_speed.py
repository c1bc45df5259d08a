"""Chunked linear-attention layers against their token-by-token recurrence, on whatever devices run this.

    python benchmarks/linear_speed.py [--seq 8192] [--heads 4] [--dk 64] [--dv 64] [--chunk 64] [--backward]
    python benchmarks/linear_speed.py --tpu v5p:4x4x4 --seqs 32768 131072   # ahead-of-time, on a CPU host

Prints one table row per layer: the median wall time of the recurrence (``jax_cp.linear.reference``)
and of the chunked form (``jax_cp.linear``) on one device, and their ratio. With ``--tpu`` it instead
compiles one gated delta layer for a TPU topology (libtpu's compiler, no TPU needed) over
``cp_colossal`` and prints, per sequence length, each collective's bytes per device, whether compute
is scheduled under the state exchange and the share of its transfer time that compute covers
(``jax_cp.plan``'s schedule reader).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

import jax_cp
from jax_cp import linear


def _inputs(S, H, dk, dv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)
    q, k = (jax.random.normal(kk, (1, S, H, dk), jnp.float32) for kk in ks[:2])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (1, S, H, dv), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, S, H), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, S, H), jnp.float32))
    return dict(gdn=(q, k, v, g, beta),
                ssd=(v, jax.nn.softplus(g), -jnp.ones((H,)), q[:, :, :1], k[:, :, :1]),
                conv=(v.reshape(1, S, H * dv), jax.random.normal(ks[5], (4, H * dv), jnp.float32)))


def _timed(f, args, repeat: int) -> float:
    jax.block_until_ready(f(*args))  # compile
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _program(layer, backward: bool):
    if not backward:
        return jax.jit(layer)
    return jax.jit(lambda *a: jax.grad(lambda *b: jnp.sum(layer(*b) ** 2), argnums=tuple(range(len(a))))(*a))


def speed(args) -> None:
    inputs = _inputs(args.seq, args.heads, args.dk, args.dv)
    layers = {
        "gdn": (linear.reference.gated_delta_rule, lambda *a: linear.gated_delta_rule(*a, chunk_size=args.chunk)),
        "ssd": (linear.reference.mamba2_ssd, lambda *a: linear.mamba2_ssd(*a, chunk_size=args.chunk)),
        "conv": (linear.reference.causal_conv1d, linear.causal_conv1d),
    }
    what = "forward+backward" if args.backward else "forward"
    print(f"# S={args.seq} H={args.heads} dk={args.dk} dv={args.dv} chunk={args.chunk} {what} on "
          f"{jax.devices()[0].platform} ({os.cpu_count()} cores), median of {args.repeat}")
    print(f"{'layer':6} {'recurrence ms':>14} {'chunked ms':>11} {'speedup':>8}")
    for name, (ref, fast) in layers.items():
        r = _timed(_program(ref, args.backward), inputs[name], args.repeat)
        c = _timed(_program(fast, args.backward), inputs[name], args.repeat)
        print(f"{name:6} {r * 1e3:14.1f} {c * 1e3:11.1f} {r / c:8.1f}")


def tpu(args) -> None:
    from jax_cp import plan

    mesh = plan.topology_mesh(args.tpu, cp_colossal=args.colossal)
    B = jax_cp.mesh_dims(mesh).dp
    print(f"# {args.tpu}: dp={B} cp_colossal={args.colossal}; one gated delta layer (forward+backward), "
          f"H={args.heads} dk={args.dk} dv={args.dv} chunk={args.chunk} max_pieces={args.pieces}, bf16 in")
    print(f"{'S':>7} {'phase':>5} {'collective':>14} {'axes':>12} {'bytes/device':>13} {'async':>6} "
          f"{'compute inside':>15}")
    layer = lambda *a: linear.gated_delta_rule(*a, mesh=mesh, chunk_size=args.chunk,  # noqa: E731
                                               max_pieces=args.pieces)
    step = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4))
    seq = jax.sharding.NamedSharding(mesh, jax.P("dp", ("cp_colossal", "cp_ulysses")))
    for S in args.seqs:
        shapes = [jax.ShapeDtypeStruct((B, S, args.heads, d), jnp.bfloat16, sharding=seq)
                  for d in (args.dk, args.dk, args.dv)]
        shapes += [jax.ShapeDtypeStruct((B, S, args.heads), jnp.float32, sharding=seq)] * 2
        a = plan.analyze_program(step, shapes, topology=args.tpu, mesh=mesh, label=f"gdn S={S}")
        for c in a.schedule.collectives:
            print(f"{S:7} {c.phase:>5} {c.kind:>14} {','.join(c.axes):>12} {c.bytes:13} {str(c.is_async):>6} "
                  f"{len(c.compute_inside):15}")
        covered = ", ".join("-" if t is None else f"{t:.2f}" for t in a.time_covered[:2])
        print(f"{S:7} transfer time covered fwd, bwd: {covered}; peak memory/device "
              f"{a.memory.peak / 2**20:.0f} MiB, compile {a.compile_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dk", type=int, default=64)
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--tpu", default=None, help="a TPU topology name, e.g. v5p:4x4x4 (ahead-of-time compile)")
    p.add_argument("--seqs", type=int, nargs="*", default=[32768, 131072])
    p.add_argument("--colossal", type=int, default=8)
    p.add_argument("--pieces", type=int, default=None, help="max_pieces (default: the layer's own, sized)")
    args = p.parse_args()
    tpu(args) if args.tpu else speed(args)


if __name__ == "__main__":
    main()
