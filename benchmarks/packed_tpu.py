"""Packed rows on a TPU pod, ahead of time: per-rank attention work and CP bytes, dual-chunk vs dispatch.

    JAX_PLATFORMS=cpu python benchmarks/packed_tpu.py                 # ~9 min on 2 cores
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
* dispatch: ``kv_exchange=Dispatch.kv_exchange`` of the planned batch (``exchanges.Attended`` with
  ``capacity``, the ragged transport: one ``lax.ragged_all_to_all`` over ``cp_colossal`` moving
  each device's needed K/V blocks forward and one moving their dK/dV back; and a ``lax.cond``
  that takes the all-gather instead when some device would send or receive more than
  ``capacity`` blocks). Both branches are in the compiled program.

Columns (per device and layer; MiB, fwd + bwd):

* "pairs slowest/mean": ``Dispatch.work()`` (visible (query, key) pairs per CP device;
  ``load_balance.fixed(balanced=True)`` for the dual-chunk order), the slowest device over the mean,
  of batch 0 (in brackets: the worst of ``--batches`` batches, host only);
* "est. attention ms": the slowest device's forward attention at the chip's peak, batch 0:
  ``work x 4 x head_dim x (H / t)`` FLOPs (``work`` already charges a colossal chunk's pairs ``1/u``
  to each device of its Ulysses group) over ``plan.chip_for(topology).device_flops`` (v5e 197,
  v5p 459 TFLOP/s). The kernels skip fully masked blocks, so visible pairs set it; an estimate:
  no kernel efficiency, no exchange time, no backward;
* "all-gather": dual-chunk's CP collectives, from the scheduled HLO (``plan.analyze_program``,
  ``Analysis.schedule``): every collective over ``cp_colossal`` / ``cp_ulysses`` only, its bytes
  (the larger of its input and output buffers) as often as it runs, the backward's dK/dV
  exchanges included (``Schedule.select(cp_only=False)``);
* "ragged buffers": the static buffers of dispatch's ``ragged-all-to-all`` ops in the schedule
  (``Analysis.schedule``): each op's larger of operand and result, ``capacity x block`` tokens;
  what the compiled program holds;
* "ragged moved": what moves at run time on batch 0: the busiest device's needed blocks (sum over
  senders, ``attended.needed_blocks``, the rule the devices apply) x ``block`` x the K/V bytes of a
  token (bfloat16 K and V of the kv heads each device holds after the Ulysses exchange); backward:
  the dK/dV of the blocks the busiest sender lent, back in K/V's dtype;
* "K/V needed": K/V bytes per device that the busiest rank's queries attend on other ranks
  (``packed_exchange.needed_remote_keys``, counted from the dispatched positions and segment ids;
  forward): what the forward exchange is judged against;
* "other CP": dispatch's other collectives on the path taken (outside the ``lax.cond`` and in its
  ragged branch: the metadata all-gathers of positions and segment ids, the overflow flag's
  ``psum``, the all-to-all of each receiver's offsets; with ``u > 1`` the Ulysses all-to-alls of
  q, k, v and the output, which "all-gather" counts too); "fallback": the same with the
  all-gather branch instead, what a batch overflowing ``capacity`` moves;
* "ppermute": ``Dispatch.kv_exchange_for(transport="ppermute")``'s static buffers (one per ring
  distance, received in full), ``block x sum(sizes)`` x the bytes of a token, the same back:
  from the host, not compiled;
* "ragged async, compute inside": for dispatch's forward and backward ragged-all-to-all, whether
  the schedule has it as a start/done pair, and the compute ops scheduled between the two
  (``Collective.compute_inside``: a kernel call by name, else "fusion"), which its transfer can
  overlap;
* "exchange": ``Dispatch.kv_exchange``; "kernel": what the compiled programs call (splash: kernel
  calls in dual-chunk's / dispatch's program, both ``lax.cond`` branches counted); "GiB": the
  compiler's memory per device (``Memory.total``), dual-chunk / dispatch; "compile s": the two compiles.

Measures only; asserts nothing. One compile at a time: each takes 10 s to 2 min on two cores.

Letters: B batch, S sequence, H query heads, K kv heads, c/u/t the layout.
"""
from __future__ import annotations

import argparse
import importlib.metadata
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
from jax_cp.exchanges import attended  # noqa: E402
from packed_exchange import DISTRIBUTIONS, needed_remote_keys, packed_row  # noqa: E402

H, K, HEAD_DIM = 32, 8, 128  # Llama-3-8B attention
# v5p's (8,1,8) does not map onto the 4x4x4 torus (8 is no product of its sides): (4,4,4) and (16,1,4).
CASES = ("v5e:4x4:4,1,4", "v5p:4x4x4:4,4,4", "v5p:4x4x4:16,1,4")
CP_AXES = {jax_cp.COLOSSAL, jax_cp.ULYSSES}
PHASES = ("fwd", "bwd")
RAGGED = "ragged-all-to-all"

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


def cp_bytes(analysis) -> dict:
    """``{(part, phase): MiB}`` per device, from ``analysis.schedule``; part: "common" (outside
    ``Attended``'s ``lax.cond``), "taken" (its ragged branch's other collectives), "fallback" (its
    all-gather branch), "ragged" (the ragged all-to-all buffers); and "ragged_ops" (those
    collectives)."""
    out = {(part, ph): 0.0 for part in ("common", "taken", "fallback", "ragged") for ph in PHASES}
    ragged = []
    for col in analysis.schedule.select(cp_only=False):
        if not col.axes or not set(col.axes) <= CP_AXES:
            continue
        # lax.cond(overflow, all-gather, ragged): branch 0 is the ragged one (the false branch).
        part = ("ragged" if col.kind == RAGGED else "taken" if "cond/branch_0_fun" in col.op_name
                else "fallback" if "cond/branch_1_fun" in col.op_name else "common")
        out[part, col.phase] += col.bytes * col.iterations / 2**20
        if col.kind == RAGGED:
            ragged.append(col)
    out["ragged_ops"] = ragged
    return out


def _what(name: str) -> str:
    """A compute op in a few words: a kernel call's name (splash_mha_fwd, ...), or "fusion"."""
    return name.split(".")[0].replace("_segmented", "").replace("_no_residuals", "").replace("_residuals", "")


def fmt_mib(b: dict, parts, grad: bool) -> str:
    fwd, bwd = (sum(b[p, ph] for p in parts) for ph in PHASES)
    return f"{fwd:,.1f} + {bwd:,.1f}" if grad else f"{fwd:,.1f}"


def fmt_pair(fwd: float, bwd: float, grad: bool) -> str:
    return f"{fwd:,.1f} + {bwd:,.1f}" if grad else f"{fwd:,.1f}"


def fmt_async(ops) -> str:
    """``fwd async: <compute ops inside>; bwd ...``: each ragged all-to-all, async or sync, and the
    compute ops scheduled between its start and done (``Collective.compute_inside``)."""
    return "; ".join(f"{op.phase} {'async' if op.is_async else 'sync'}: "
                     f"{', '.join(sorted(set(map(_what, op.compute_inside)))) or 'none'}"
                     for op in sorted(ops, key=lambda op: op.phase == "bwd")) or "none"


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
    row["exchange"] = str(ex)
    for name, disp in (("dual", dual), ("plan", d)):
        row[name + "_est"] = 1e3 * float(disp.work().max()) * 4 * HEAD_DIM * (H // t) / chip.device_flops
    # K/V bytes of one token on a device: its kv heads after Ulysses (repeated until each of the
    # t*u devices holds whole ones), K and V, bfloat16.
    kv_heads = math.lcm(K, u * t) // (u * t)
    token_mib = 2 * kv_heads * HEAD_DIM * 2 / 2**20
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    need = max(int(needed_remote_keys(seg_r[b], d.positions[b], c).max()) for b in range(dp))
    row["need_mib"] = need * token_mib
    counts = attended.needed_blocks(d.positions, seg_r, c, ex.block, is_causal=True,
                                    query_block=ex.query_block)  # [B = dp, receiver, sender]
    row["moved_mib"] = (int(counts.sum(axis=2).max()) * ex.block * token_mib,  # fwd: the busiest receiver
                        int(counts.sum(axis=1).max()) * ex.block * token_mib)  # bwd: dK/dV to the busiest lender
    row["ppermute_mib"] = d.kv_exchange_for(is_causal=True, transport="ppermute").received_tokens() * token_mib
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
          f"| est. attention ms, slowest device: dual-chunk | dispatch | CP MiB/device/layer ({mib}): all-gather "
          f"(dual-chunk) | ragged buffers (static) | ragged moved (run time) | K/V needed (fwd) | other CP "
          f"| fallback | ppermute (host) | ragged async, compute inside | exchange | kernel | GiB | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.case or CASES:
        topo, c, u, t = parse_case(case)
        for S in args.seq:
            for dist in args.dist:
                r = measure(topo, c, u, t, dist, S, grad, args.seed, args.batches)
                rd, rp = r["ratios"]["dual"], r["ratios"]["plan"]
                kernel = r["plan_kernel"] if r["plan_kernel"] == r["dual_kernel"] else \
                    f"{r['dual_kernel']} / {r['plan_kernel']}"
                pb = r["plan_bytes"]
                print(f"| {topo} | ({c},{u},{t}) dp={r['dp']} | {dist} | {S // 1024}K | {r['docs']:.0f} "
                      f"| {rd[0]:.2f} ({max(rd):.2f}) | {rp[0]:.3f} ({max(rp):.3f}) "
                      f"| {r['dual_est']:.3f} | {r['plan_est']:.3f} "
                      f"| {fmt_mib(r['dual_bytes'], ('common', 'taken', 'fallback'), grad)} "
                      f"| {fmt_mib(pb, ('ragged',), grad)} | {fmt_pair(*r['moved_mib'], grad)} | {r['need_mib']:.1f} "
                      f"| {fmt_mib(pb, ('common', 'taken'), grad)} | {fmt_mib(pb, ('common', 'fallback'), grad)} "
                      f"| {fmt_pair(r['ppermute_mib'], r['ppermute_mib'], grad)} | {fmt_async(pb['ragged_ops'])} "
                      f"| {r['exchange']} | {kernel} | {r['dual_gib']:.2f} / {r['plan_gib']:.2f} "
                      f"| {r['dual_compile']:.0f} + {r['plan_compile']:.0f} |", flush=True)
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "?"
    print(f"\n{time.perf_counter() - t_start:.0f} s; jax {jax.__version__}, libtpu {libtpu}; batch 0 compiled, "
          f"{args.batches} batches planned (host); seed {args.seed}.")


if __name__ == "__main__":
    main()
