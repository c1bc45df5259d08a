"""Chunked linear-attention layers against their token-by-token recurrence, on whatever devices run this.

    python benchmarks/linear_speed.py [--seq 8192] [--heads 4] [--dk 64] [--dv 64] [--chunk 64] [--backward]
    python benchmarks/linear_speed.py --tpu v5p:4x4x4 --seqs 32768 131072   # ahead-of-time, on a CPU host
    python benchmarks/linear_speed.py --tpu v5p:4x4x4 --colossal 16 --heads 8 --dk 128 --dv 128 \
        --orders natural dual-chunk dispatch

Prints one table row per layer: the median wall time of the recurrence (``jax_cp.linear.reference``)
and of the chunked form (``jax_cp.linear``) on one device, and their ratio. With ``--tpu`` it instead
compiles one gated delta layer for a TPU topology (libtpu's compiler, no TPU needed) over
``cp_colossal`` and prints, per token order and sequence length, the state slots the order needs,
each collective's bytes per device, whether compute is scheduled under the state exchange, the share
of its transfer time that compute covers (``jax_cp.plan``'s schedule reader) and the CP bytes against
a softmax layer's all-gathered K/V. Orders (``--orders``): ``natural``; ``dual-chunk`` (one document,
``load_balance.positions``); ``dispatch`` (rows packed with documents of log-uniform lengths, ordered
by ``load_balance.plan``, as ``models.train`` orders a batch). Positions and segment ids are concrete
NumPy arrays closed over, so the layer sizes its slots on the host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_cp
from jax_cp import linear, load_balance

ORDERS = ("natural", "dual-chunk", "dispatch")


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


def packed_rows(rows: int, S: int, *, seed: int = 0, shortest: int = 1024, longest: int = 65536):
    """``(positions, segment_ids)`` ``[rows, S]`` int32 NumPy, natural order: each row packed with
    documents whose lengths are drawn log-uniform in ``[shortest, longest]`` (seeded), ids 0, 1, ...
    and positions restarting at 0 per document; the last document is cut at the row's end."""
    rng = np.random.default_rng(seed)
    pos, seg = np.empty((rows, S), np.int32), np.empty((rows, S), np.int32)
    for b in range(rows):
        lengths = []
        while sum(lengths) < S:
            lengths.append(int(np.exp(rng.uniform(np.log(shortest), np.log(longest + 1)))))
        lengths[-1] -= sum(lengths) - S
        starts = np.cumsum([0] + lengths[:-1])
        seg[b] = np.repeat(np.arange(len(lengths)), lengths)
        pos[b] = np.arange(S) - np.repeat(starts, lengths)
    return pos, seg


def order_metadata(order: str, mesh, B: int, S: int, *, seed: int = 0, chunks_per_rank: int = 8):
    """``(positions, segment_ids)`` ``[B, S]`` int32 NumPy of the tokens as the layer receives them in
    ``order``: ``natural`` (one document), ``dual-chunk`` (one document, ``load_balance.positions``) or
    ``dispatch`` (:func:`packed_rows`, each dp shard's rows ordered by ``load_balance.plan`` with
    ``chunks_per_rank``)."""
    if order == "natural":
        return np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(), np.zeros((B, S), np.int32)
    if order == "dual-chunk":
        pos = np.asarray(load_balance.positions(S, mesh), np.int32)
        return np.broadcast_to(pos, (B, S)).copy(), np.zeros((B, S), np.int32)
    if order == "dispatch":
        pos, seg = packed_rows(B, S, seed=seed)
        plan = load_balance.plan(seg, mesh, positions=pos, chunks_per_rank=chunks_per_rank)
        (seg,), pos = plan.reorder((seg,))
        return np.asarray(pos, np.int32), np.asarray(seg, np.int32)
    raise ValueError(f"order={order!r} must be one of {ORDERS}.")


def kv_gather_bytes(B: int, dp: int, S: int, kv_heads: int, dk: int, dv: int) -> int:
    """Bytes per device of a softmax layer's all-gathered bf16 K/V: ``B/dp * S * kv_heads * (dk + dv) * 2``."""
    return B // dp * S * kv_heads * (dk + dv) * 2


def tpu(args) -> None:
    from jax_cp import plan

    mesh = plan.topology_mesh(args.tpu, cp_colossal=args.colossal)
    dims = jax_cp.mesh_dims(mesh)
    B = dims.dp
    print(f"# {args.tpu}: dp={B} cp_colossal={args.colossal}; one gated delta layer (forward+backward), "
          f"H={args.heads} dk={args.dk} dv={args.dv} chunk={args.chunk} max_pieces={args.pieces}, bf16 in")
    if "dispatch" in args.orders:
        print(f"# dispatch: rows packed with documents of log-uniform lengths in [1K, 64K] tokens (seed {args.seed}, "
              f"the last cut at the row's end), ordered by load_balance.plan (chunks_per_rank={args.chunks_per_rank})")
    print(f"# K/V: a softmax layer's all-gathered bf16 K/V per device = B/dp * S * kv_heads * (dk + dv) * 2 "
          f"(kv_heads={args.kv_heads})")
    print(f"{'order':>10} {'S':>7} {'phase':>5} {'collective':>14} {'axes':>12} {'bytes/device':>13} {'async':>6} "
          f"{'compute inside':>15}")
    step = lambda layer: jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2),  # noqa: E731
                                  argnums=(0, 1, 2, 3, 4))
    seq = jax.sharding.NamedSharding(mesh, jax.P("dp", ("cp_colossal", "cp_ulysses")))
    for order in args.orders:
        for S in args.seqs:
            pos, seg = order_metadata(order, mesh, B, S, seed=args.seed, chunks_per_rank=args.chunks_per_rank)
            need = linear.needed_pieces(pos, seg, dims.c)
            slots = args.pieces or linear.sized_pieces(need, S // dims.c)  # as the layer sizes them
            docs = max(len(np.unique(r[r >= 0])) for r in seg)
            layer = lambda *a, pos=pos, seg=seg: linear.gated_delta_rule(  # noqa: E731
                *a, mesh=mesh, chunk_size=args.chunk, max_pieces=args.pieces, positions=pos, segment_ids=seg)
            shapes = [jax.ShapeDtypeStruct((B, S, args.heads, d), jnp.bfloat16, sharding=seq)
                      for d in (args.dk, args.dk, args.dv)]
            shapes += [jax.ShapeDtypeStruct((B, S, args.heads), jnp.float32, sharding=seq)] * 2
            a = plan.analyze_program(step(layer), shapes, topology=args.tpu, mesh=mesh, label=f"gdn {order} S={S}")
            for c in a.schedule.collectives:
                print(f"{order:>10} {S:7} {c.phase:>5} {c.kind:>14} {','.join(c.axes):>12} {c.bytes:13} "
                      f"{str(c.is_async):>6} {len(c.compute_inside):15}")
            fwd, bwd = (sum(c.bytes * c.iterations for c in a.schedule.select(ph)) for ph in ("fwd", "bwd"))
            kv = kv_gather_bytes(B, dims.dp, S, args.kv_heads, args.dk, args.dv)
            covered = ", ".join("-" if t is None else f"{t:.2f}" for t in a.time_covered[:2])
            print(f"{order:>10} {S:7} needed pieces {need} (slots {slots}, at most {docs} documents a row); "
                  f"CP bytes/device fwd {fwd / 1e6:.1f} MB, bwd {bwd / 1e6:.1f} MB; K/V all-gather "
                  f"{kv / 1e6:.0f} MB: fwd {fwd / kv:.3f}, bwd {bwd / kv:.3f} of it "
                  f"({kv / max(fwd, bwd, 1):.1f}x below)")
            print(f"{order:>10} {S:7} transfer time covered fwd, bwd: {covered}; peak memory/device "
                  f"{a.memory.peak / 2**20:.0f} MiB, compile {a.compile_s:.0f} s", flush=True)


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
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=["natural"],
                   help="token orders (--tpu): natural, dual-chunk, dispatch (packed rows, load_balance.plan)")
    p.add_argument("--seed", type=int, default=0, help="the dispatch order's document lengths")
    p.add_argument("--chunks-per-rank", type=int, default=8, help="the dispatch plan's chunks per colossal rank")
    p.add_argument("--kv-heads", type=int, default=8, help="the softmax layer whose K/V bytes are compared")
    args = p.parse_args()
    tpu(args) if args.tpu else speed(args)


if __name__ == "__main__":
    main()
