"""Overlap of CP collectives with compute, from the real TPU compiler's schedule (no TPU needed).

For each topology and layout, compiles forward+backward of one Llama-3-8B-sized
attention layer (D=4096, 32 heads, 8 kv heads, head dim 128, bf16, causal, RoPE):

* ``naive``: one fused QKV projection, then every collective (the baseline);
* ``defaults``: ``CPAttention`` with every knob left ``"auto"`` (the row names what it resolved to);
* ``CPAttention``: the library layer, ``overlap_chunks`` 1, 2 and 4, with each
  K/V exchange: ``all_gather`` (``cp``), ``all_to_all`` (``cp-a2a``) and
  ``ring`` (``cp-ring``) where there is a ``cp_colossal`` axis, and with Q, K
  and V in one all-to-all where there is a ``cp_ulysses`` axis:
  ``fused_qkv_chunks`` = every chunk (``cp-fused``, ``cp-ring-fused``) or the
  first chunk only (``cp-fused1``, ``cp-ring-fused1``, 2 and 4 chunks);

and prints a markdown table: overlap fraction forward / backward (share of CP
collective bytes with a matmul scheduled between start and done), the share of their estimated
transfer time that compute covers (`plan.Analysis.covered`), per-device
memory and the planner's step-time estimate. Measures only; asserts nothing.

    JAX_PLATFORMS=cpu python benchmarks/overlap.py                 # v5e:4x4 and v5p:4x4x4
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --topology v5e:4x4 --variants cp,naive
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --topology v5e:4x4 --layout 2,4,2 --variants cp-a2a
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --variants defaults --seq-len 32768   # the defaults
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --topology v5p:2x2x1 --layout 2,2,1 --variants defaults --seq-len 4096
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --digest > before.txt   # lowered programs only (fast)

``--digest`` lowers instead of compiling and prints a hash of each program's
StableHLO (debug info dropped, and no source locations inside Pallas kernels'
serialized bodies, which would otherwise change with any line moved in the files
on the call stack): a refactor that leaves every hash unchanged leaves every
schedule, and so every figure of the table, unchanged.

Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import jax  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import plan  # noqa: E402

# topology -> (batch, seq_len, layouts (name, cp_colossal, cp_ulysses, tp))
CASES = {
    "v5e:4x4": (2, 8192, [("Ulysses", 1, 4, 2), ("all-gather", 4, 1, 4), ("hybrid", 2, 2, 4)]),
    # (2,2,4) with dp=4 does not map onto the 4x4x4 torus (jax.make_mesh); the hybrid uses all 64 chips.
    "v5p:4x4x4": (4, 32768, [("Ulysses", 1, 4, 4), ("all-gather", 4, 1, 4), ("hybrid", 4, 4, 4)]),
}


def cp_layer_with(kv_exchange: str, fused: str = "none"):
    """``CPAttention(kv_exchange=..., fused_qkv_chunks=...)``; ``fused``: "none", "all" or "first" chunk."""
    def build(shape: plan.LayerShape, mesh):
        k = {"none": 0, "all": shape.overlap_chunks, "first": 1}[fused]
        return plan.cp_layer(dataclasses.replace(shape, kv_exchange=kv_exchange, fused_qkv_chunks=k), mesh)
    return build


# name -> (label, builder, overlap_chunks tried, needs cp_colossal > 1, needs cp_ulysses > 1)
VARIANTS = {
    "cp": ("CPAttention", cp_layer_with("all_gather"), (1, 2, 4), False, False),
    "cp-ring": ("CPAttention ring", cp_layer_with("ring"), (1, 2, 4), True, False),
    "cp-a2a": ("CPAttention all_to_all", cp_layer_with("all_to_all"), (1, 2, 4), True, False),
    "cp-fused": ("CPAttention fused QKV", cp_layer_with("all_gather", "all"), (1, 2, 4), False, True),
    "cp-fused1": ("CPAttention first chunk fused", cp_layer_with("all_gather", "first"), (2, 4), False, True),
    "cp-ring-fused": ("CPAttention ring fused QKV", cp_layer_with("ring", "all"), (1, 2, 4), True, True),
    "cp-ring-fused1": ("CPAttention ring first chunk fused", cp_layer_with("ring", "first"), (2, 4), True, True),
    "naive": ("naive fused QKV", plan.naive_layer, (1,), False, False),
    # CPAttention with its defaults: kv_exchange, overlap_chunks and fused_qkv_chunks all "auto".
    "defaults": ("CPAttention defaults (auto)", plan.cp_layer, ("auto",), False, False),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", action="append", help="repeatable; default: " + ", ".join(CASES))
    p.add_argument("--variants", default="naive,cp,cp-a2a,cp-ring,cp-fused,cp-fused1,cp-ring-fused,cp-ring-fused1",
                   help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--kernel", default="blockwise")
    p.add_argument("--layouts", default="Ulysses,all-gather,hybrid")
    p.add_argument("--layout", action="append", metavar="C,U,T",
                   help="repeatable: these (cp_colossal, cp_ulysses, tp) instead of the preset layouts")
    p.add_argument("--seq-len", type=int, help="instead of the preset sequence length of each topology")
    p.add_argument("--batch", type=int, help="instead of the preset batch of each topology (others: 1)")
    p.add_argument("--digest", action="store_true",
                   help="print a hash of each lowered program instead of compiling (refactor check)")
    p.add_argument("--dump-dir", help="with --digest: also write each lowered program's text here")
    args = p.parse_args(argv)
    if args.digest:  # Pallas kernel bodies carry file:line locations of the call stack; drop them
        jax.config.update("jax_traceback_in_locations_limit", 0)
    custom = [("custom", *map(int, x.split(","))) for x in args.layout or []]
    spec = plan.MODELS["llama3-8b"]
    if not args.digest:
        print("| topology | layout (c,u,t) dp | B, S | variant | chunks | overlap fwd | overlap bwd | "
              "time covered fwd / bwd | memory/device | est. step | compile |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for topo in args.topology or list(CASES):
        if topo not in CASES and not custom:
            p.error(f"--topology {topo} has no preset layouts ({', '.join(CASES)} do): give them with --layout C,U,T")
        batch, seq_len, layouts = CASES.get(topo, (1, 4096, []))
        seq_len, batch = args.seq_len or seq_len, args.batch or batch
        devices = plan.get_topology(topo).devices
        for name, c, u, t in custom or layouts:
            if not custom and name not in args.layouts.split(","):
                continue
            mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, devices=devices,
                                    axis_types=jax.sharding.AxisType.Explicit)
            for key in args.variants.split(","):
                label, build, chunk_options, needs_c, needs_u = VARIANTS[key]
                if (needs_c and c == 1) or (needs_u and u == 1):
                    continue
                for chunks in chunk_options:
                    if chunks != "auto" and spec.num_heads % (t * u * chunks):
                        continue
                    auto = "auto" if key == "defaults" else None
                    shape = plan.LayerShape(batch=batch, seq_len=seq_len, d_model=spec.d_model,
                                            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                            head_dim=spec.head_dim, rope_theta=spec.rope_theta, kernel=args.kernel,
                                            overlap_chunks=chunks, kv_exchange=auto or "all_gather",
                                            fused_qkv_chunks=auto or 0)
                    if auto:  # the row names what "auto" resolved to
                        resolved, _ = shape.resolved(mesh)
                        label = (f"defaults: {resolved.kv_exchange}, chunks={resolved.overlap_chunks}, "
                                 f"fused={resolved.fused_qkv_chunks}")
                    t0 = time.perf_counter()
                    fn, fargs = build(shape, mesh)
                    if args.digest:
                        text = jax.jit(fn).lower(*fargs).as_text(debug_info=False)
                        row = f"{topo} ({c},{u},{t}) {key} n={chunks}"
                        print(f"{row} {hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)
                        if args.dump_dir:
                            os.makedirs(args.dump_dir, exist_ok=True)
                            with open(os.path.join(args.dump_dir, row.replace(" ", "_") + ".mlir"), "w") as f:
                                f.write(text)
                        continue
                    a = plan.analyze_program(fn, fargs, topology=topo, mesh=mesh, label=label, layer=shape)
                    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                    print(f"| {topo} | {name} ({c},{u},{t}) dp={mesh.shape['dp']} | {batch}, {seq_len} | {label} | "
                          f"{chunks} | {fmt(a.overlap('fwd'))} | {fmt(a.overlap('bwd'))} | "
                          f"{fmt(a.covered('fwd'))} / {fmt(a.covered('bwd'))} | {a.memory.total / 2**30:.2f} GiB | {a.estimate.step_s * 1e3:.2f} ms | "
                          f"{time.perf_counter() - t0:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
