"""Balance of packed rows: the dual-chunk order against the dispatch plan (host side, NumPy).

    JAX_PLATFORMS=cpu python benchmarks/packed_balance.py
    JAX_PLATFORMS=cpu python benchmarks/packed_balance.py --cp 8 --seq 131072 --rows 4 --dist lognormal-1K

Rows are packed with documents whose lengths are drawn (``numpy.random.default_rng(0)``, a new
generator per table line) from a lognormal with sigma = 1 and the given mean (256, 1K, 2K, 8K, 16K
tokens), or from a Pareto distribution (Lomax + 1, tail index 1.5) scaled to mean 2,048: median
about 1,100, its largest documents fill a row. The last document of a row is cut to fit, so
rows have no padding. Causal attention, positions restarting at 0 in every document. Every row
is planned alone (``dp`` = rows), the strictest case: each row must balance by itself.

Columns: the slowest colossal rank's visible (query, key) pairs over the mean, the mean over
the rows (and the worst row), for ``load_balance``'s dual-chunk order and for the dispatch
plan, both counted here from the reordered positions (a causal query at document position
``p`` sees ``p + 1`` keys), not by the library. "K/V attended / all-gathered": for the rank
whose queries attend the most K/V held elsewhere (its documents' keys up to its last query in
each, less its own tokens), that count over the ``(c-1)/c * S`` keys an all-gather brings it;
the worst rank of all rows (the mean over ranks and rows). "plan ms": the plan's wall time for
one row on one core (best of three; median over the rows, and the slowest row; 8 rows at 32K,
4 at 128K). Measures only; asserts nothing.

Letters: B rows, S sequence, c colossal ranks.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _threads in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")  # plan time on one core

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import load_balance  # noqa: E402

DISTRIBUTIONS = {"lognormal-256": ("lognormal", 256), "lognormal-1K": ("lognormal", 1024),
                 "lognormal-2K": ("lognormal", 2048), "lognormal-8K": ("lognormal", 8192),
                 "lognormal-16K": ("lognormal", 16384), "pareto-2K": ("pareto", 2048)}
PARETO_TAIL = 1.5


def document_lengths(rng, kind: str, mean: float, seq_len: int) -> list[int]:
    """Lengths of the documents of one packed row (the last one cut to fit)."""
    lengths, n = [], 0
    while n < seq_len:
        if kind == "lognormal":  # E[exp(N(mu, 1))] = exp(mu + 1/2) = mean
            L = rng.lognormal(np.log(mean) - 0.5, 1.0)
        else:  # Lomax(a) + 1 has mean a/(a-1) in units of its scale
            L = (rng.pareto(PARETO_TAIL) + 1) * mean * (PARETO_TAIL - 1) / PARETO_TAIL
        L = min(max(1, int(L)), seq_len - n)
        lengths.append(L)
        n += L
    return lengths


def packed_rows(rng, kind: str, mean: float, rows: int, seq_len: int):
    """``(segment_ids, positions)`` ``[B, S]`` of packed rows."""
    seg_BS = np.zeros((rows, seq_len), np.int32)
    pos_BS = np.zeros((rows, seq_len), np.int32)
    for b in range(rows):
        lengths = document_lengths(rng, kind, mean, seq_len)
        seg_BS[b] = np.repeat(np.arange(len(lengths)), lengths)
        pos_BS[b] = np.concatenate([np.arange(L) for L in lengths])
    return seg_BS, pos_BS


def rank_stats(seg_S, pos_S, c: int):
    """``(slowest/mean visible pairs, largest and mean share of the all-gathered K/V a rank attends)``
    of one row in some order, causal, positions restarting at 0 in each document."""
    T = seg_S.shape[0] // c
    pairs = (pos_S.astype(np.int64) + 1).reshape(c, T).sum(axis=1)
    remote = []
    for r in range(c):
        seg, pos = seg_S[r * T:(r + 1) * T], pos_S[r * T:(r + 1) * T].astype(np.int64)
        top = np.full(seg.max() + 1, -1, np.int64)
        np.maximum.at(top, seg, pos)  # each document's last query on this rank
        remote.append(int((top[top >= 0] + 1).sum()) - T)  # keys attended, less the rank's own
    return pairs.max() / pairs.mean(), max(remote) / (seg_S.shape[0] - T), np.mean(remote) / (seg_S.shape[0] - T)


def abstract_mesh(c: int) -> jax.sharding.AbstractMesh:
    """A device-free mesh with ``c`` colossal ranks (planning needs only the axis sizes)."""
    return jax.sharding.AbstractMesh((1, c, 1, 1), jax_cp.AXES)


def dual_chunk_order(seq_len: int, c: int) -> np.ndarray:
    """Today's order: ``load_balance.positions`` (the natural index at each slot)."""
    return np.asarray(jax_cp.load_balance.positions(seq_len, abstract_mesh(c)))


def measure(c: int, seq_len: int, dist: str, rows: int):
    kind, mean = DISTRIBUTIONS[dist]
    seg_BS, pos_BS = packed_rows(np.random.default_rng(0), kind, mean, rows, seq_len)
    mesh = abstract_mesh(c)
    dual = dual_chunk_order(seq_len, c)
    out = {"dual": [], "plan": [], "ms": []}
    for b in range(rows):
        times = []
        for _ in range(3):  # the best of three: the machine may be shared
            t0 = time.perf_counter()
            d = load_balance.plan(seg_BS[b:b + 1], mesh, positions=pos_BS[b:b + 1])
            times.append(1e3 * (time.perf_counter() - t0))
        out["ms"].append(min(times))
        out["dual"].append(rank_stats(seg_BS[b, dual], pos_BS[b, dual], c))
        out["plan"].append(rank_stats(seg_BS[b, d.perm[0]], d.positions[0], c))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", default="4,8,16", help="colossal ranks c")
    ap.add_argument("--seq", default="32768,131072")
    ap.add_argument("--dist", default=",".join(DISTRIBUTIONS), help=f"of {list(DISTRIBUTIONS)}")
    ap.add_argument("--rows", type=int, default=0, help="rows per line (0: 8 at 32K, 4 at 128K)")
    args = ap.parse_args()
    unknown = sorted(set(args.dist.split(",")) - set(DISTRIBUTIONS))
    if unknown:
        ap.error(f"--dist {','.join(unknown)}: not one of {list(DISTRIBUTIONS)}")
    load_balance.plan(np.zeros((1, 1024), np.int32), abstract_mesh(4))  # warm up
    print("| c | S | documents | slowest/mean: dual-chunk (worst row) | plan (worst row) "
          "| K/V attended / all-gathered: dual-chunk | plan | plan ms per row (slowest) |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in (int(s) for s in args.seq.split(",")):
        for c in (int(x) for x in args.cp.split(",")):
            for dist in args.dist.split(","):
                rows = args.rows or (8 if seq_len <= 32768 else 4)
                r = measure(c, seq_len, dist, rows)
                dual, planned = np.array(r["dual"]), np.array(r["plan"])
                print(f"| {c} | {seq_len // 1024}K | {dist} | {dual[:, 0].mean():.2f} ({dual[:, 0].max():.2f}) "
                      f"| {planned[:, 0].mean():.3f} ({planned[:, 0].max():.3f}) "
                      f"| {dual[:, 1].max():.2f} ({dual[:, 2].mean():.2f}) "
                      f"| {planned[:, 1].max():.2f} ({planned[:, 2].mean():.2f}) "
                      f"| {np.median(r['ms']):.1f} ({max(r['ms']):.1f}) |", flush=True)


if __name__ == "__main__":
    main()
