"""``python -m jax_cp.plan``: plan one attention layer on a TPU topology from any machine.

Example::

    JAX_PLATFORMS=cpu python -m jax_cp.plan --topology v5p:4x4x4 --cp-colossal 4 --cp-ulysses 4 --tp 4 \\
        --seq-len 131072 --model llama3-8b
    JAX_PLATFORMS=cpu python -m jax_cp.plan --topology v5e:4x4 --strategy auto --seq-len 32768
    JAX_PLATFORMS=cpu python -m jax_cp.plan --topology v5p:4x4x4 --seq-len 8192 --compare 1,4,1 4,1,4 4,4,1

Every report ends with a verdict line: which layout to run, and why.
"""
from __future__ import annotations

import argparse
import os
import sys


def parser() -> argparse.ArgumentParser:
    from jax_cp import exchanges
    from jax_cp._defaults import int_or_auto
    from jax_cp.plan._models import MODELS

    p = argparse.ArgumentParser(prog="python -m jax_cp.plan", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:4x4, v5p:4x4x4, v6e:16x16")
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS), help="attention shape preset")
    p.add_argument("--seq-len", type=int, required=True, help="global sequence length S")
    p.add_argument("--batch", type=int, default=None, help="global batch B (default: dp, one sequence per replica)")
    p.add_argument("--strategy", default="manual", choices=("manual", "auto"))
    p.add_argument("--compare", nargs="+", metavar="C,U,T", default=None,
                   help="plan these layouts (cp_colossal,cp_ulysses,tp) at one global batch (default: the lcm of "
                        "their dp) and say which to run; replaces --strategy and the degrees below")
    p.add_argument("--cp-colossal", type=int, default=1)
    p.add_argument("--cp-ulysses", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-exchange", default="auto", help="auto | " + " | ".join(exchanges.NAMES))
    p.add_argument("--overlap-chunks", type=int_or_auto, default="auto")
    p.add_argument("--fused-qkv-chunks", type=int_or_auto, default="auto",
                   help="leading head chunks whose Q, K and V share one cp_ulysses all-to-all "
                        "(CPAttention(fused_qkv_chunks=...))")
    p.add_argument("--kernel", default="auto",
                   help="local attention kernel; 'auto' (what CPAttention runs: splash on TPU, blockwise for "
                        "windows) or one of jax_cp.kernels.KERNELS; the report names the kernel that ran")
    p.add_argument("--no-causal", action="store_true", help="full (bidirectional) attention")
    p.add_argument("--load-balanced", action="store_true",
                   help="count causal work as jax_cp.load_balance spreads it (FLOPs and MFU only)")
    p.add_argument("--dtype", default="bfloat16", help="activation/compute dtype")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="per device (default: the chip's HBM)")
    p.add_argument("--candidates", type=int, default=2, help="auto: how many ranked layouts to compile")
    p.add_argument("--no-baseline", action="store_true", help="skip the naive fused-QKV baseline")
    p.add_argument("--xla-flags", default=None,
                   help="flags for every compile, space separated (default: recommended_xla_flags for the chip)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU compiler runs from the libtpu wheel; no TPU needed
    from jax_cp.plan import analyze, compare, get_topology

    batch = args.batch
    if batch is None and not args.compare:
        n = len(get_topology(args.topology).devices)
        batch = 1 if args.strategy == "auto" else max(n // (args.cp_colossal * args.cp_ulysses * args.tp), 1)
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    flags = None if args.xla_flags is None else tuple(args.xla_flags.split())
    try:
        if args.compare:
            print(compare(
                topology=args.topology, layouts=args.compare, model=args.model, seq_len=args.seq_len,
                batch=args.batch, kv_exchange=args.kv_exchange, overlap_chunks=args.overlap_chunks,
                fused_qkv_chunks=args.fused_qkv_chunks, kernel=args.kernel, is_causal=not args.no_causal,
                load_balanced=args.load_balanced, dtype=args.dtype, param_dtype=args.param_dtype,
                memory_budget=budget, xla_flags=flags))
            return 0
        report = analyze(
            topology=args.topology, model=args.model, seq_len=args.seq_len, batch=batch, strategy=args.strategy,
            cp_colossal=args.cp_colossal, cp_ulysses=args.cp_ulysses, tp=args.tp, kv_exchange=args.kv_exchange,
            overlap_chunks=args.overlap_chunks, fused_qkv_chunks=args.fused_qkv_chunks, kernel=args.kernel,
            is_causal=not args.no_causal, load_balanced=args.load_balanced,
            dtype=args.dtype, param_dtype=args.param_dtype, memory_budget=budget, baseline=not args.no_baseline,
            candidates=args.candidates, xla_flags=flags,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
