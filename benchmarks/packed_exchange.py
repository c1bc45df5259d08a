"""K/V a colossal rank receives per layer on packed rows: ``Attended``'s two transports against the need.

    JAX_PLATFORMS=cpu python benchmarks/packed_exchange.py
    JAX_PLATFORMS=cpu python benchmarks/packed_exchange.py --cp 8 --seq 32768 --dist lognormal-2K --window 4096

Rows are packed with documents drawn as in ``benchmarks/packed_balance.py`` (lognormal, sigma = 1,
mean 256, 2K or 16K tokens; Pareto, tail index 1.5, mean 2K), planned one row per dp shard
(``load_balance.plan`` on ``AbstractMesh((rows, c, 1, 1))``, so a device holds one row and
per device is per row), causal (``--window``: a causal sliding window of that many keys back).
Host side (NumPy); the block counts are ``attended.needed_blocks``, the rule the devices apply.
Columns, key tokens per rank and row (K/V bytes scale with them), the mean over rows:

* needed max: the keys held by other ranks that the rank's queries see (same document, causal,
  the window), counted here from the reordered positions and segment ids, not by the library
  (``needed_remote_keys``): the rank that needs the most;
* ragged, busiest rank: what the ragged transport (``Dispatch.kv_exchange``: one
  ``lax.ragged_all_to_all``, sizes set at run time) moves to its busiest receiver: ``block x``
  the blocks it needs from every other rank; "/ needed max": that over "needed max" (in
  brackets: the worst row's own ratio);
* worst rank: ``received_r / need_r`` of the ragged transport, the largest over every rank of
  every row (ranks needing nothing left out): a rank needing little gets its blocks' rounding;
* capacity: the ragged transport's static buffer, ``block x capacity`` (a power of two of
  blocks, at least the busiest device's sends or receives): memory, not bytes moved;
* ppermute: ``block x sum(sizes)`` of ``Dispatch.kv_exchange_for(transport="ppermute")``, one
  static buffer per ring distance, received in full whether used or not, and its ratio to
  "needed max";
* all-gather / needed max: ``(c-1)/c * S`` (the ring moves as much) over "needed max";
* compiles: distinct ``Dispatch.kv_exchange`` values over the rows' batches (each row planned
  as a batch of its own, one row per batch): the programs a run of ``rows`` batches compiles;
* plan+sizes ms/row: ``load_balance.plan`` and ``kv_exchange`` for all rows at once, per row.

Measures only; asserts nothing. Letters: B rows, S sequence, c colossal ranks.
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
    mesh = AbstractMesh((rows, c, 1, 1), jax_cp.AXES)  # one row per dp shard: per device = per row
    seg, pos = (np.stack(a) for a in zip(*[packed_row(rng, kind, mean, S) for _ in range(rows)]))
    w = None if window is None else (window, 0)
    t0 = time.perf_counter()
    d = load_balance.plan(seg, mesh, positions=pos, local_window_size=w)
    ex = d.kv_exchange
    ms = (time.perf_counter() - t0) * 1e3 / rows
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    need = np.stack([needed_remote_keys(seg_r[b], d.positions[b], c, window) for b in range(rows)])  # [B, c]
    counts = attended.needed_blocks(d.positions, seg_r, c, ex.block, is_causal=True, local_window_size=w,
                                    query_block=ex.query_block)
    received = ex.block * counts.sum(axis=2)  # [B, receiver]: the run-time sizes of the ragged all-to-all
    has_need = need > 0
    worst = float((received / np.where(has_need, need, 1))[has_need].max()) if has_need.any() else float("nan")
    ppermute = d.kv_exchange_for(is_causal=True, local_window_size=w, transport="ppermute")
    # Per-row exchanges: the compiles a one-row-per-batch run would see.
    per_row = {load_balance.plan(seg[b:b + 1], AbstractMesh((1, c, 1, 1), jax_cp.AXES), positions=pos[b:b + 1],
                                 local_window_size=w).kv_exchange
               for b in range(rows)}
    return dict(need_max=need.max(axis=1).mean(), ragged=received.max(axis=1).mean(),
                ragged_worst_row=float(np.max(received.max(axis=1) / np.maximum(need.max(axis=1), 1))),
                worst_rank=worst, capacity=ex.received_tokens(), ppermute=ppermute.received_tokens(),
                gather=(c - 1) * S // c, ms=ms, compiles=len(per_row), block=ex.block)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--seq", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--dist", nargs="*", default=list(DISTRIBUTIONS))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--window", type=int, default=None, help="a causal sliding window of this many keys back")
    args = ap.parse_args()
    t_start = time.perf_counter()
    print("| distribution | S | c | window | needed max | ragged, busiest rank (block) | ragged / needed max "
          "(worst row) | worst rank: received / needed | ragged capacity | ppermute | ppermute / needed max "
          "| all-gather / needed max | compiles | plan+sizes ms/row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dist:
        kind, mean = DISTRIBUTIONS[name]
        for S in args.seq:
            for c in args.cp:
                m = measure(kind, mean, S, c, args.rows, args.window)
                nm = max(m["need_max"], 1.0)
                print(f"| {name} | {S // 1024}K | {c} | {args.window or '-'} | {m['need_max']:,.0f} "
                      f"| {m['ragged']:,.0f} ({m['block']}) | {m['ragged'] / nm:.2f} ({m['ragged_worst_row']:.2f}) "
                      f"| {m['worst_rank']:.2f} | {m['capacity']:,} | {m['ppermute']:,} | {m['ppermute'] / nm:.2f} "
                      f"| {m['gather'] / nm:.2f} | {m['compiles']} | {m['ms']:.0f} |", flush=True)
    print(f"\n{time.perf_counter() - t_start:.0f} s; {args.rows} rows per line, seed 0.")


if __name__ == "__main__":
    main()
