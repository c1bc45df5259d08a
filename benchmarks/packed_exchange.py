"""K/V bytes a colossal rank receives per layer on packed rows: all-gather, ring, ``Attended``.

    JAX_PLATFORMS=cpu python benchmarks/packed_exchange.py
    JAX_PLATFORMS=cpu python benchmarks/packed_exchange.py --cp 8 --seq 32768 --dist lognormal-2K --window 4096

Rows are packed with documents drawn as in ``benchmarks/packed_balance.py`` (lognormal, sigma = 1,
mean 256, 2K or 16K tokens; Pareto, tail index 1.5, mean 2K), planned one row per dp shard
(``load_balance.plan``), causal. For each row and rank:

* all-gather / ring: ``(c-1)/c * S`` key tokens (the ring moves the same bytes in ``c-1`` steps);
* attended: ``block * sum(sizes)`` key tokens, from the static sizes of ``Dispatch.kv_exchange``
  (every rank receives its buffers in full, used or not; one size for every ring distance);
* per-distance sizes: what one bucketed size per ring distance would move (not what
  ``kv_exchange`` takes: its tuple is new almost every batch, a compile each);
* ragged total: one bucketed budget per receiver, all distances together (a ragged all-to-all);
* needed: the keys held by other ranks that the rank's queries see (same document, causal, the
  window), counted here from the reordered positions and segment ids, not by the library: the
  rank that needs the most ("max") and the mean over ranks.

Columns are key tokens per rank and row, the mean over rows; "MiB" is attended's K/V bytes for a
Llama-3-8B layer (8 kv heads of 128 dims, K and V in bfloat16: 4 KiB a token; ``tp = cp_ulysses
= 1``). "attended / needed (max)" is the figure the exchange is judged by: the bytes the step
waits for over the bytes the busiest rank must have. "compiles": distinct exchange values over
the rows' batches (one row per batch, ``--batches`` batches). Measures only; asserts nothing.

Letters: B rows, S sequence, c colossal ranks.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import load_balance  # noqa: E402
from jax_cp.exchanges import attended  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

DISTRIBUTIONS = {"lognormal-256": ("lognormal", 256), "lognormal-2K": ("lognormal", 2048),
                 "lognormal-16K": ("lognormal", 16384), "pareto-2K": ("pareto", 2048)}
PARETO_TAIL = 1.5
KV_BYTES_PER_TOKEN = 8 * 128 * 2 * 2  # Llama-3-8B: 8 kv heads x 128 dims, K and V, bfloat16


def packed_row(rng, kind: str, mean: float, S: int):
    """``(segment_ids, positions)`` of one row packed with documents of random length (the last cut)."""
    lengths, n = [], 0
    while n < S:
        if kind == "lognormal":
            L = rng.lognormal(np.log(mean) - 0.5, 1.0)
        else:
            L = (rng.pareto(PARETO_TAIL) + 1) * mean * (PARETO_TAIL - 1) / PARETO_TAIL
        L = min(max(1, int(L)), S - n)
        lengths.append(L)
        n += L
    seg = np.repeat(np.arange(len(lengths)), lengths)
    return seg, np.concatenate([np.arange(L) for L in lengths])


def needed_remote_keys(seg_S, pos_S, c: int, left=None) -> np.ndarray:
    """``[c]``: keys on other ranks that each rank's queries see (causal, same document, within
    ``left`` positions before the query), for one row in its dispatched order."""
    S = seg_S.shape[0]
    T = S // c
    span = int(pos_S.max()) + 2
    key = seg_S.astype(np.int64) * span + pos_S
    out = np.zeros(c, np.int64)
    for r in range(c):
        q = np.sort(key[r * T:(r + 1) * T])
        k = np.concatenate([key[:r * T], key[(r + 1) * T:]])
        i = np.searchsorted(q, k, "left")  # the first query at or after each key (same document: below)
        ok = i < q.shape[0]
        first = np.where(ok, q[np.minimum(i, q.shape[0] - 1)], 0)
        seen = ok & (first // span == k // span)
        if left is not None:
            seen &= first - k <= left
        out[r] = seen.sum()
    return out


def measure(kind: str, mean: float, S: int, c: int, rows: int, window, seed: int = 0):
    rng = np.random.default_rng(seed)
    mesh = AbstractMesh((rows, c, 1, 1), jax_cp.AXES)
    seg, pos = (np.stack(a) for a in zip(*[packed_row(rng, kind, mean, S) for _ in range(rows)]))
    left = None if window is None else window
    t0 = time.perf_counter()
    d = load_balance.plan(seg, mesh, positions=pos, local_window_size=None if window is None else (window, 0))
    ex = d.kv_exchange
    ms = (time.perf_counter() - t0) * 1e3 / rows
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    need = np.stack([needed_remote_keys(seg_r[b], d.positions[b], c, left) for b in range(rows)])
    # What other buffer policies would move, from the same per-(receiver, sender) block counts:
    # one size per ring distance (a new tuple almost every batch), and one total per receiver
    # (a ragged all-to-all, which XLA:CPU lacks).
    counts = attended.needed_blocks(d.positions, seg_r, c, ex.block, is_causal=True,
                                    local_window_size=None if window is None else (window, 0))
    r = np.arange(c)
    by_distance = np.stack([counts[:, r, (r - k) % c] for k in range(1, c)], axis=-1)  # [B, receiver, k]
    per_distance = ex.block * sum(attended.bucket(int(n)) for n in by_distance.max(axis=(0, 1)))
    total = ex.block * attended.bucket(int(by_distance.sum(axis=-1).max()))
    # Per-row exchanges: the compiles a one-row-per-batch run would see.
    per_row = {load_balance.plan(seg[b:b + 1], AbstractMesh((1, c, 1, 1), jax_cp.AXES), positions=pos[b:b + 1],
                                 local_window_size=None if window is None else (window, 0)).kv_exchange
               for b in range(rows)}
    return dict(gather=(c - 1) * S // c, attended=ex.received_tokens(), per_distance=per_distance, total=total,
                need_max=need.max(axis=1).mean(),
                need_mean=need.mean(), ms=ms, compiles=len(per_row), block=ex.block)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--seq", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--dist", nargs="*", default=list(DISTRIBUTIONS))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--window", type=int, default=None, help="a causal sliding window of this many keys back")
    args = ap.parse_args()
    print("| distribution | S | c | window | all-gather = ring | attended (block) | per-distance sizes | ragged total "
          "| needed max | needed mean | attended / needed max | per-distance / needed max | ragged / needed max "
          "| all-gather / needed max | attended MiB per layer | compiles | plan+sizes ms/row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dist:
        kind, mean = DISTRIBUTIONS[name]
        for S in args.seq:
            for c in args.cp:
                m = measure(kind, mean, S, c, args.rows, args.window)
                nm = max(m["need_max"], 1.0)
                print(f"| {name} | {S // 1024}K | {c} | {args.window or '-'} | {m['gather']:,} | {m['attended']:,.0f} "
                      f"({m['block']}) | {m['per_distance']:,} | {m['total']:,} | {m['need_max']:,.0f} | "
                      f"{m['need_mean']:,.0f} | {m['attended'] / nm:.2f} | {m['per_distance'] / nm:.2f} | "
                      f"{m['total'] / nm:.2f} | {m['gather'] / nm:.2f} | {m['attended'] * KV_BYTES_PER_TOKEN / 2**20:.0f} | "
                      f"{m['compiles']} | {m['ms']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
