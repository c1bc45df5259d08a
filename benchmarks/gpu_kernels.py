"""Attention kernels on one GPU: TFLOP/s of what jax_cp runs against cuDNN on the same causal shapes.

For each sequence length, one device's causal bf16 attention (Llama-3-8B heads: 32 query heads,
8 kv heads, head dim 128, batch 1), forward and forward+backward:

- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)``, cuDNN's
  index-pattern causal mask (the ceiling a fused kernel is held to);
- ``jax_cp auto``: ``jax_cp.dot_product_attention(..., is_causal=True)`` on a one-device mesh,
  positions given (a masked call: what auto runs there, ``jax_cp.describe_kernel`` says which: the fused
  Pallas kernel on a GPU);
- ``jax_cp pallas_gpu``: the same, the fused Pallas GPU kernel explicitly (interpret mode off GPU);
- ``jax_cp blockwise``: the portable kernel, explicitly.

FLOPs are the causal pairs ``S (S + 1) / 2`` x 4 d per head (two matmuls) forward, x 3.5 forward +
backward (the backward recomputes the scores and runs four more). The rate is against the chip's
dense bf16 peak (``--peak-tflops``, default the H200/H100 datasheet's 989). The minimum of
``--reps`` timed runs after one warm-up counts. Measures only; asserts nothing. On a machine
without a GPU the cuDNN rows say why they are missing (``--quick``: tiny shapes, a smoke run).

    JAX_PLATFORMS=cuda python benchmarks/gpu_kernels.py --out gpu-check/kernels.md
    JAX_PLATFORMS=cpu python benchmarks/gpu_kernels.py --quick
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import jax_cp
from jax_cp import kernels

H, K, d = 32, 8, 128


def flops(S: int, grad: bool) -> float:
    forward = 4.0 * H * d * S * (S + 1) / 2
    return forward * (3.5 if grad else 1.0)


def _inputs(S: int):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, S, H, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, S, K, d), jnp.bfloat16) for kk in keys[1:])
    return q, k, v


def implementations(S: int) -> dict:
    """name -> attention(q, k, v), or the reason it cannot run here."""
    mesh = jax_cp.make_mesh(devices=jax.devices()[:1])
    pos = jnp.arange(S, dtype=jnp.int32)
    impls = {
        "jax_cp auto": lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos),
        "jax_cp pallas_gpu": lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True,
                                                                          positions=pos, kernel="pallas_gpu"),
        "jax_cp blockwise": lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True,
                                                                         positions=pos, kernel="blockwise"),
    }
    if kernels.target_platform() == "gpu":
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        impls["cudnn"] = f"cuDNN needs a CUDA GPU; this run's platform is {kernels.target_platform()!r}"
    return impls


def _program(f, grad: bool):
    if grad:
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return jax.jit(f)


def time_it(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def run(seq_lens, reps: int, peak_tflops: float) -> list[dict]:
    rows = []
    for S in seq_lens:
        args = _inputs(S)
        for name, f in implementations(S).items():
            for grad in (False, True):
                row = dict(S=S, impl=name, pass_="fwd+bwd" if grad else "fwd")
                if isinstance(f, str):
                    rows.append(row | dict(note=f))
                    continue
                try:
                    seconds = time_it(_program(f, grad), args, reps)
                except Exception as e:  # e.g. out of memory at the longest lengths: say so, keep going
                    rows.append(row | dict(note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                    continue
                tflops = flops(S, grad) / seconds / 1e12
                rows.append(row | dict(ms=seconds * 1e3, tflops=tflops, peak_share=tflops / peak_tflops))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict], peak_tflops: float) -> str:
    head = [f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
            f"kernel auto picks: {jax_cp.describe_kernel(is_causal=True)}; peak {peak_tflops:g} TFLOP/s", "",
            "| S | implementation | pass | ms | TFLOP/s | share of peak | vs cuDNN |", "|---|---|---|---:|---:|---:|---:|"]
    cudnn = {(r["S"], r["pass_"]): r.get("tflops") for r in rows if r["impl"] == "cudnn"}
    lines = []
    for r in rows:
        if "tflops" not in r:
            lines.append(f"| {r['S']} | {r['impl']} | {r['pass_']} | | | | {r['note']} |")
            continue
        ref = cudnn.get((r["S"], r["pass_"]))
        ratio = f"{r['tflops'] / ref:.2f}" if ref else ""
        lines.append(f"| {r['S']} | {r['impl']} | {r['pass_']} | {r['ms']:.2f} | {r['tflops']:.3g} | "
                     f"{r['peak_share']:.2f} | {ratio} |")
    return "\n".join(head + lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repetition (a smoke run)")
    p.add_argument("--out", help="also write the markdown table here")
    args = p.parse_args(argv)
    seq_lens, reps = ([256], 1) if args.quick else (args.seq_lens, args.reps)
    table = markdown(run(seq_lens, reps, args.peak_tflops), args.peak_tflops)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
