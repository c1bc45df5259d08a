"""Packed rows on a TPU pod, ahead of time: per-rank attention work and CP bytes, dual-chunk vs dispatch.

    JAX_PLATFORMS=cpu python benchmarks/packed_tpu.py                 # ~14 min on 2 cores
    JAX_PLATFORMS=cpu python benchmarks/packed_tpu.py --case v5e:4x4:4,1,4 --seq 32768 --forward-only

Rows are packed as in ``benchmarks/packed_exchange.py`` (``packed_row``): documents of lognormal
length, sigma = 1, mean 2,048 tokens (``--dist``), the last one cut to fit, no padding; positions
restart at 0 in every document; ``numpy.random.default_rng(seed + batch)``. One row per dp shard
(``B = dp``), each shard planned on its own row (``load_balance.plan``), causal.

For each topology and layout ``(cp_colossal c, cp_ulysses u, tp t)`` the real TPU compiler (the
``libtpu`` wheel, no TPU needed) compiles one Llama-3-8B attention call of batch 0,
``jax_cp.dot_product_attention`` on q ``[B, S, 32, 128]`` and k/v ``[B, S, 8, 128]`` bfloat16,
causal, positions and segment ids as (sharded) inputs, ``kernel="auto"``, forward and backward
(the gradient of a scalar loss w.r.t. q, k, v; ``--forward-only``: forward), twice:

* dual-chunk: ``kv_exchange="all_gather"``, what the dual-chunk order runs;
* dispatch: ``kv_exchange=Dispatch.kv_exchange`` of the planned batch (``exchanges.Attended``:
  one ``ppermute`` per ring distance, its buffers bucketed; and a ``lax.cond`` that takes the
  all-gather instead when some buffer would overflow). Both branches are in the compiled
  program: the table gives the bytes of the path taken (``ppermute``) and of the fallback.

Columns:

* "pairs slowest/mean": ``Dispatch.work()`` (visible (query, key) pairs per CP device;
  ``load_balance.fixed(balanced=True)`` for the dual-chunk order), the slowest device over the mean,
  of batch 0 (in brackets: the worst of ``--batches`` batches, host only);
* "est. attention ms": the slowest device's forward attention at the chip's peak, batch 0:
  ``work x 4 x head_dim x (H / t)`` FLOPs (``work`` already charges a colossal chunk's pairs ``1/u``
  to each device of its Ulysses group) over ``plan.chip_for(topology).device_flops`` (v5e 197,
  v5p 459 TFLOP/s). The kernels skip fully masked blocks, so visible pairs set it; an estimate:
  no kernel efficiency, no exchange time, no backward;
* "CP MiB per device and layer, fwd + bwd": from the scheduled HLO (``plan.analyze_program``,
  ``Analysis.schedule``): every collective over ``cp_colossal`` / ``cp_ulysses`` only, its bytes
  (the larger of its input and output buffers) as often as it runs. The planner's CP selection
  (``Schedule.select``) drops collectives whose result no matmul consumes, which in a bare
  attention call are the backward's dK/dV exchanges; here they count. "dispatch, taken" is the
  program's collectives outside the ``lax.cond`` plus its ``ppermute`` branch; "fallback" the
  same with its all-gather branch instead (the metadata all-gathers of positions and segment ids,
  and the overflow flag's ``psum``, are in both, and in dual-chunk's);
* "K/V needed MiB": K/V bytes per device that the busiest rank's queries attend on other ranks
  (``packed_exchange.needed_remote_keys``, counted from the dispatched positions and segment ids;
  forward; the kv heads each device holds after the Ulysses exchange, bfloat16 K and V): what the
  forward exchange is judged against;
* "exchange": ``Dispatch.kv_exchange``; "kernel": what the compiled programs call (splash: kernel
  calls in dual-chunk's / dispatch's program, both ``lax.cond`` branches counted); "GiB": the
  compiler's memory per device (``Memory.total``), dual-chunk / dispatch; "compile s": the two compiles.

Measures only; asserts nothing. One compile at a time: each takes 10 s to 2 min on two cores.

Letters: B batch, S sequence, H query heads, K kv heads, c/u/t the layout.
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import load_balance, plan  # noqa: E402
from packed_exchange import DISTRIBUTIONS, needed_remote_keys, packed_row  # noqa: E402

H, K, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
# v5p's (8,1,8) does not map onto the 4x4x4 torus (8 is no product of its sides): (4,4,4) and (16,1,4).
CASES = ("v5e:4x4:4,1,4", "v5p:4x4x4:4,4,4", "v5p:4x4x4:16,1,4")
CP_AXES = {jax_cp.COLOSSAL, jax_cp.ULYSSES}
PHASES = ("fwd", "bwd")


def parse_case(case: str):
    topo, layout = case.rsplit(":", 1)
    c, u, t = (int(x) for x in layout.split(","))
    return topo, c, u, t


def attention_fn(mesh, kv_exchange, grad: bool):
    """The attention call (or the gradients of a scalar loss of it w.r.t. q, k, v)."""
    def fwd(q, k, v, pos, seg):
        return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos, segment_ids=seg,
                                            kv_exchange=kv_exchange)
    if not grad:
        return fwd

    def loss(q, k, v, pos, seg):
        return jnp.sum(jnp.square(fwd(q, k, v, pos, seg).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2))


def abstract_args(mesh, B: int, S: int):
    """q, k, v (batch on dp, sequence on the CP axes, heads on tp), positions and segment ids."""
    seq = (jax_cp.COLOSSAL, jax_cp.ULYSSES)

    def qkv(heads):
        return jax.ShapeDtypeStruct((B, S, heads, HEAD_DIM), jnp.bfloat16,
                                    sharding=NamedSharding(mesh, P(jax_cp.DP, seq, jax_cp.TP, None)))
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=NamedSharding(mesh, P(jax_cp.DP, seq)))
    return qkv(H), qkv(K), qkv(K), ids, ids


def cp_bytes(analysis) -> dict[tuple[str, str], float]:
    """``{(part, phase): MiB}`` per device; part: "common" (the entry computation), "permute" (the
    ``ppermute`` branch of ``Attended``'s ``lax.cond``), "fallback" (its other collectives)."""
    out = {(part, ph): 0.0 for part in ("common", "permute", "fallback") for ph in PHASES}
    for col in analysis.schedule.select(cp_only=False):
        if not col.axes or not set(col.axes) <= CP_AXES:
            continue
        part = "common" if not col.in_loop else "permute" if col.kind == "collective-permute" else "fallback"
        out[part, col.phase] += col.bytes * col.iterations / 2**20
    return out


def fmt_mib(b: dict, parts, grad: bool) -> str:
    fwd, bwd = (sum(b[p, ph] for p in parts) for ph in PHASES)
    return f"{fwd:,.1f} + {bwd:,.1f}" if grad else f"{fwd:,.1f}"


def batch_rows(dist: str, dp: int, S: int, seed: int):
    kind, mean = DISTRIBUTIONS[dist]
    rng = np.random.default_rng(seed)
    seg, pos = (np.stack(a) for a in zip(*[packed_row(rng, kind, mean, S) for _ in range(dp)]))
    return seg, pos


def imbalance(d) -> float:
    w = d.work()
    return float((w.max(axis=1) / w.mean(axis=1)).max())


def measure(topo: str, c: int, u: int, t: int, dist: str, S: int, grad: bool, seed: int, batches: int):
    mesh = plan.topology_mesh(topo, cp_colossal=c, cp_ulysses=u, tp=t)
    dp = mesh.shape[jax_cp.DP]
    chip = plan.chip_for(topo)
    row = dict(dp=dp, ratios={"dual": [], "plan": []})
    for b in range(batches):  # host only: the balance of further batches
        seg, pos = batch_rows(dist, dp, S, seed + b)
        d = load_balance.plan(seg, mesh, positions=pos)
        dual = load_balance.fixed(seg, mesh, balanced=True, positions=pos)
        row["ratios"]["dual"].append(imbalance(dual))
        row["ratios"]["plan"].append(imbalance(d))
        if b == 0:
            first = (seg, pos, d, dual)
    seg, pos, d, dual = first
    ex = d.kv_exchange
    row["docs"] = float(np.mean(seg.max(axis=1) + 1))
    sizes = set(ex.sizes)
    row["exchange"] = (f"{ex.name}(block={ex.block}, {len(ex.sizes)} x {ex.sizes[0]})" if len(sizes) == 1 else str(ex))
    for name, disp in (("dual", dual), ("plan", d)):
        row[name + "_est"] = 1e3 * float(disp.work().max()) * 4 * HEAD_DIM * (H // t) / chip.device_flops
    # K/V the busiest rank's queries attend on other ranks, per device (its kv heads after Ulysses).
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    need = max(int(needed_remote_keys(seg_r[b], d.positions[b], c).max()) for b in range(dp))
    kv_heads = math.lcm(K, u * t) // (u * t)  # kv heads repeated until each of the t*u devices holds whole ones
    row["need_mib"] = need * 2 * kv_heads * HEAD_DIM * 2 / 2**20
    args = abstract_args(mesh, dp, S)
    for name, kv in (("dual", "all_gather"), ("plan", ex)):
        a = plan.analyze_program(attention_fn(mesh, kv, grad), args, topology=topo, mesh=mesh,
                                 label=f"{topo} ({c},{u},{t}) {name}")
        row[name + "_bytes"] = cp_bytes(a)
        row[name + "_compile"] = a.compile_s
        row[name + "_gib"] = a.memory.total / 2**30
        calls = sum(n for _, n in a.kernel_calls)
        row[name + "_kernel"] = f"splash, {calls} calls" if calls else a.kernel
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help=f"TOPOLOGY:C,U,T, repeatable; default: {' '.join(CASES)}")
    ap.add_argument("--seq", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--dist", nargs="*", default=["lognormal-2K"], help=f"of {list(DISTRIBUTIONS)}")
    ap.add_argument("--forward-only", action="store_true", help="compile the forward call only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=8, help="batches whose balance is counted (host only)")
    args = ap.parse_args()
    grad = not args.forward_only
    t_start = time.perf_counter()
    mib = "fwd + bwd" if grad else "fwd"
    print(f"| topology | layout (c,u,t) dp | documents | S | docs/row | pairs slowest/mean: dual-chunk | dispatch "
          f"| est. attention ms, slowest device: dual-chunk | dispatch | CP MiB/device/layer ({mib}): dual-chunk "
          f"(all_gather) | dispatch, taken | dispatch, fallback | K/V needed MiB (fwd) | exchange | kernel | GiB "
          f"| compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.case or CASES:
        topo, c, u, t = parse_case(case)
        for S in args.seq:
            for dist in args.dist:
                r = measure(topo, c, u, t, dist, S, grad, args.seed, args.batches)
                rd, rp = r["ratios"]["dual"], r["ratios"]["plan"]
                kernel = r["plan_kernel"] if r["plan_kernel"] == r["dual_kernel"] else \
                    f"{r['dual_kernel']} / {r['plan_kernel']}"
                print(f"| {topo} | ({c},{u},{t}) dp={r['dp']} | {dist} | {S // 1024}K | {r['docs']:.0f} "
                      f"| {rd[0]:.2f} ({max(rd):.2f}) | {rp[0]:.3f} ({max(rp):.3f}) "
                      f"| {r['dual_est']:.3f} | {r['plan_est']:.3f} "
                      f"| {fmt_mib(r['dual_bytes'], ('common', 'permute', 'fallback'), grad)} "
                      f"| {fmt_mib(r['plan_bytes'], ('common', 'permute'), grad)} "
                      f"| {fmt_mib(r['plan_bytes'], ('common', 'fallback'), grad)} | {r['need_mib']:.1f} "
                      f"| {r['exchange']} | {kernel} | {r['dual_gib']:.2f} / {r['plan_gib']:.2f} "
                      f"| {r['dual_compile']:.0f} + {r['plan_compile']:.0f} |", flush=True)
    print(f"\n{time.perf_counter() - t_start:.0f} s; jax {jax.__version__}; batch 0 compiled, "
          f"{args.batches} batches planned (host); seed {args.seed}.")


if __name__ == "__main__":
    main()
