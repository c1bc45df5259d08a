"""Ring with splash vs the other long-context paths, from the TPU compiler's schedule (ahead of time).

For an attention layer, forward + backward, on a TPU topology you do not have (libtpu's compiler,
``jax_cp.plan``): per-chip FLOPs (counted from the shapes, and the compiler's), HBM bytes, memory,
overlap, and the roofline-bound estimate (max of compute and HBM time, plus exposed
communication) with its MFU (model FLOPs / (estimated step x peak)). Causal work is counted
load-balanced (``jax_cp.load_balance``; ``--natural-order`` for the busiest device in natural
order). Compiled-schedule estimates, not runs.

    JAX_PLATFORMS=cpu python benchmarks/ring_splash.py                       # v5p:4x4x4, 128K
    JAX_PLATFORMS=cpu python benchmarks/ring_splash.py --seq-len 1048576 --rows ring-blockwise,ring-splash
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax_cp import plan  # noqa: E402

MODELS = {
    "llama3-8b": plan.ModelSpec(d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128),
    # MaxText's Llama3.1-8B long-context variant (tpu-recipes): 16 query heads, 4 kv heads, head dim 256.
    "llama3.1-8b-longctx": plan.ModelSpec(d_model=4096, num_heads=16, num_kv_heads=4, head_dim=256),
}
ROWS = {  # name -> (kv_exchange, kernel, (c, u, t), overlap_chunks)
    "ring-blockwise": ("ring", "blockwise", (64, 1, 1), 1),
    "ring-splash": ("ring", "auto", (64, 1, 1), 1),
    "all_gather-splash": ("all_gather", "auto", (64, 1, 1), 1),
    "hybrid-ring-splash": ("ring", "auto", (16, 4, 1), 1),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:4x4x4")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--natural-order", action="store_true",
                   help="count causal work in natural order (default: load-balanced, as MaxText runs)")
    args = p.parse_args(argv)
    print("| model | S | path | (c,u,t) | kernel ran | model FLOPs | compute | HBM bytes | HBM time | "
          "memory | overlap fwd / bwd | exposed comm | est. step | est. MFU | compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for row in args.rows.split(","):
            ex, kernel, (c, u, t), chunks = ROWS[row]
            try:
                r = plan.analyze(topology=args.topology, model=MODELS[model], seq_len=args.seq_len, cp_colossal=c,
                                 cp_ulysses=u, tp=t, kv_exchange=ex, kernel=kernel, overlap_chunks=chunks,
                                 fused_qkv_chunks=0, baseline=False, load_balanced=not args.natural_order)
            except ValueError as e:  # e.g. does not fit: say so in the table
                print(f"| {model} | {args.seq_len} | {row} | ({c},{u},{t}) | - | {str(e)[:80]} |", flush=True)
                continue
            a, e = r.analysis, r.analysis.estimate
            fwd, bwd = a.overlap("fwd"), a.overlap("bwd")
            print(f"| {model} | {args.seq_len} | {row} | ({c},{u},{t}) | {a.kernel.split(' (')[0]} | "
                  f"{a.model_flops:.3e} | {e.compute_s * 1e3:.2f} ms | {a.bytes_accessed / 2**30:.2f} GiB | "
                  f"{e.memory_s * 1e3:.2f} ms | {a.memory.total / 2**30:.2f} GiB | "
                  f"{fwd if fwd is None else f'{fwd:.2f}'} / {bwd if bwd is None else f'{bwd:.2f}'} | "
                  f"{e.exposed_comm_s * 1e3:.2f} ms | {e.step_s * 1e3:.2f} ms | {a.mfu:.2f} | {a.compile_s:.0f} s |",
                  flush=True)


if __name__ == "__main__":
    main()
