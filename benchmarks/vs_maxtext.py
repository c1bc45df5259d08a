"""jax_cp's training step against MaxText's, both compiled ahead of time for one TPU pod.

Both steps are compiled with the TPU compiler of the same libtpu wheel for a topology
this machine does not have (libtpu compiles without a TPU), and the two scheduled HLO
modules are read by ONE reader, ``jax_cp.plan``'s (collectives, their mesh axes, bytes
and overlap; the roofline step-time estimate at the chip's published peaks). Memory is
each compiler's own ``memory_analysis()``; the largest buffers are read from each
compiler's buffer assignment.

MaxText needs Python >= 3.12 and its own dependency set, so it runs in its own virtual
environment (``make vs-maxtext`` creates ``.venv-maxtext``); this file is also its
driver there (``--maxtext-driver``): it runs MaxText's ``train_compile`` with its
``jit_and_compile`` replaced by one that keeps the compiler's dump, then writes the
memory and cost analyses beside the scheduled HLO.

Compiles cost minutes each on a small CPU, so both sides are compiled with few decoder
layers (``--layers 2 4`` by default) and every per-step figure is extrapolated
linearly to ``--full-layers`` (32 for Llama 3.1 8B): each is affine in the layer count
(the layers are identical; embedding, head, loss and optimizer are the constant part).
The table says which figures were extrapolated.

Usage (from the repository root, with the project's venv)::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/vs_maxtext.py --seq-len 32768
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/vs_maxtext.py --seq-len 32768 --jax-cp-fsdp

Results (HLO, buffer assignment, memory.json) are kept under ``--out`` and reused
unless ``--force``.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT_PYTHON = ROOT / ".venv-maxtext" / "bin" / "python"
GiB = 2**30

# jax_cp topology name -> MaxText's compile_topology (MaxText counts TensorCores on v4 / v5p / TPU7x).
MAXTEXT_TOPOLOGY = {"v5p:4x4x4": "v5p-128", "v5p:2x2x2": "v5p-16", "tpu7x:4x4x4": "tpu7x-128",
                    "v6e:16x16": "v6e-256", "v5e:16x16": "v5e-256"}
# Libtpu's environment for a compile-only process (jax_cp.plan sets the same: quiet, shared load).
QUIET_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
             "JAX_PLATFORMS": "cpu"}
# The flags --maxtext-flags jax_cp adds to MaxText's compile (its own config's compile_xla_flags kept).
MAXTEXT_FLAGS_ENV = "VS_MAXTEXT_XLA_FLAGS"


# --------------------------------------------------------------------------------------------------
# The MaxText side (runs in .venv-maxtext; imports nothing from jax_cp)


def variant_heads(head_dim: int) -> tuple[int, int]:
    """``(query heads, kv heads)`` of the model at ``head_dim``: Llama 3.1 8B's 32 / 8 of 128, or the
    recipe's head_dim-256 variant with the same width, 16 / 4."""
    if head_dim not in (128, 256):
        raise SystemExit(f"--head-dim={head_dim}: 128 (Llama 3.1 8B) or 256 (16 query / 4 kv heads).")
    return 4096 // head_dim, 1024 // head_dim


def maxtext_overrides(a, layers: int) -> list[str]:
    """MaxText's recipe for the comparison, as ``key=value`` overrides of its base.yml."""
    chips = math.prod(int(x) for x in a.topology.split(":")[1].split("x"))
    devices = chips * (2 if a.topology.startswith("tpu7x") else 1)
    heads, kv_heads = variant_heads(a.head_dim)
    return [
        f"run_name=vs_maxtext_L{layers}", f"base_output_directory={a.out}/maxtext_outputs",
        f"compile_topology={MAXTEXT_TOPOLOGY[a.topology]}", "compile_topology_num_slices=1",
        "model_name=llama3.1-8b", "override_model_config=true", f"base_num_decoder_layers={layers}",
        *([f"head_dim={a.head_dim}", f"base_num_query_heads={heads}", f"base_num_kv_heads={kv_heads}"]
          if a.head_dim != 128 else []),
        f"max_target_length={a.seq_len}", f"per_device_batch_size={a.batch / devices}",
        *([f"ici_context_parallelism={a.cp_colossal}", f"ici_context_usp_ulysses_parallelism={a.cp_ulysses}"]
          if a.maxtext_cp_strategy == "usp" else [f"ici_context_parallelism={a.cp}"]),  # usp: jax_cp's 2-D split
        f"ici_tensor_parallelism={a.tp}", "ici_fsdp_parallelism=-1",
        f"context_parallel_strategy={a.maxtext_cp_strategy}",
        f"context_parallel_load_balance={str(a.maxtext_cp_strategy != 'ulysses').lower()}",  # ulysses refuses it
        f"remat_policy={a.maxtext_remat}", "attention=flash", "dataset_type=synthetic",
        "enable_checkpointing=false",
        *(["use_tokamax_splash=true"] if a.maxtext_cp_strategy != "all_gather" else []),  # ring, ulysses, usp need it
        *a.maxtext_extra,
    ]


def maxtext_driver(out: str, overrides: list[str]) -> None:
    """Runs MaxText's train_compile with the compiler's dump kept; writes memory/cost/mesh JSON."""
    import jax
    from maxtext.trainers.pre_train import train_compile as tc
    from maxtext.utils import max_utils

    dump = os.path.join(out, "dump")
    captured = {}

    def jit_and_compile(func, args, kwargs, mesh, in_shardings, out_shardings, static_argnums, donate_argnums,
                        config, logical_axis_rules):  # train_compile.jit_and_compile, the dump kept
        with jax.set_mesh(mesh), logical_axis_rules:
            jitted = jax.jit(func, in_shardings=in_shardings, out_shardings=out_shardings,
                             static_argnums=static_argnums, donate_argnums=donate_argnums)
            lowered = jitted.lower(*args, **kwargs)
        options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
        options |= max_utils.parse_libtpu_flags_to_dict(os.environ.get(MAXTEXT_FLAGS_ENV, ""))
        options |= {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        captured.update(compiled=compiled, mesh=mesh, compile_s=time.perf_counter() - t0, config=config)
        return compiled

    tc.jit_and_compile = jit_and_compile
    tc.main(["train_compile", _maxtext_base_yml(), *overrides])
    compiled, mesh = captured["compiled"], captured["mesh"]
    _write_compiled(out, compiled, mesh, captured["compile_s"], {
        "maxtext": _version("maxtext"), "jax": jax.__version__, "libtpu": _version("libtpu"),
        "overrides": overrides, "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "compile_xla_flags": captured["config"].compile_xla_flags,
        "jax_cp_flags": os.environ.get(MAXTEXT_FLAGS_ENV, "").split(),
    })


def _maxtext_base_yml() -> str:
    import maxtext

    return str(Path(maxtext.__file__).parent / "configs" / "base.yml")


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _write_compiled(out: str, compiled, mesh, compile_s: float, info: dict) -> None:
    """memory.json (memory and cost analyses, the mesh), hlo.txt (the scheduled module) and the
    buffer assignment, from a compiled program and the compiler's dump in ``out/dump``."""
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    record = {
        "memory": {k: int(getattr(m, k, 0) or 0) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes", "peak_memory_in_bytes", "host_temp_size_in_bytes",
            "host_argument_size_in_bytes", "host_output_size_in_bytes")},
        "cost": {"flops": float(cost.get("flops", 0.0)), "bytes accessed": float(cost.get("bytes accessed", 0.0))},
        "mesh_shape": [int(v) for v in mesh.shape.values()], "axis_names": list(mesh.axis_names),
        "compile_s": compile_s, **info,
    }
    dump = os.path.join(out, "dump")
    texts = [f for f in glob.glob(os.path.join(dump, "*after_optimizations.txt")) if "train_step" in f]
    if texts:
        shutil.copy(max(texts, key=os.path.getmtime), os.path.join(out, "hlo.txt"))
    else:
        Path(out, "hlo.txt").write_text(compiled.as_text())
    for suffix in ("buffer-assignment.txt", "memory-usage-report.txt"):
        found = [f for f in glob.glob(os.path.join(dump, f"*after_optimizations-{suffix}")) if "train_step" in f]
        if found:
            shutil.copy(max(found, key=os.path.getmtime), os.path.join(out, suffix))
    shutil.rmtree(dump, ignore_errors=True)  # the rest of the dump (every pass) is large
    Path(out, "memory.json").write_text(json.dumps(record, indent=1))


# --------------------------------------------------------------------------------------------------
# The jax_cp side (the project's venv)


# How MaxText's train_compile describes these pods to libtpu (maxtext.utils.accelerator_to_spec_map, 0.2.5):
# topology name, chip config, chips per host, wraparound links. jax_cp.plan asks libtpu for the name alone.
MAXTEXT_TOPOLOGIES = {
    "v5p:4x4x4": ("v5:4x4x4", "megacore", (2, 2, 1), (True, True, True)),
    "tpu7x:4x4x4": ("tpu7x:4x4x4", "default", (2, 2, 1), (True, True, True)),
}


def maxtext_topology_kwargs(topology: str) -> dict:
    """``get_topology_desc`` keywords that describe ``topology`` as MaxText's train_compile does."""
    if topology not in MAXTEXT_TOPOLOGIES:
        raise ValueError(f"--topology {topology} has no MaxText description here (known: "
                         f"{', '.join(MAXTEXT_TOPOLOGIES)}); use --jax-cp-topology plan.")
    name, chip_config, per_host, wrap = MAXTEXT_TOPOLOGIES[topology]
    return dict(platform="tpu", topology_name=name, chip_config_name=chip_config, chips_per_host_bounds=per_host,
                num_slices=1, wrap=wrap)


def compile_jax_cp(a, layers: int, out: str) -> None:
    """``models.train.plan_train_step`` of Llama 3 8B cut to ``layers`` layers, the compiler's dump kept."""
    import dataclasses

    import jax
    from jax_cp import plan
    from jax_cp.plan import compiler_options, recommended_xla_flags
    from models import llama, train

    name = f"llama3-8b-L{layers}"
    base = llama.CONFIGS["llama3-8b"]
    heads, kv_heads = variant_heads(a.head_dim)
    llama.CONFIGS[name] = dataclasses.replace(base, num_layers=layers, head_dim=a.head_dim, num_heads=heads,
                                              num_kv_heads=kv_heads)
    cfg = train.TrainConfig(model=name, seq_len=a.seq_len, batch=a.batch, cp_colossal=a.cp_colossal,
                            cp_ulysses=a.cp_ulysses, tp=a.tp, remat=True, remat_policy=a.jax_cp_remat,
                            fsdp=True if a.jax_cp_fsdp else "auto",
                            kv_exchange=a.jax_cp_kv_exchange, scan_layers=not a.jax_cp_unrolled,
                            residual_dtype=a.jax_cp_residual_dtype,
                            fsdp_axes="dp,cp_colossal,cp_ulysses", plan=a.topology,
                            progress=False)
    dump = os.path.join(out, "dump")

    def analyze_program(fn, args, *, topology, mesh, label="program", memory_budget=None, xla_flags=None,
                        donate_argnums=(), layer=None):  # plan.analyze_program's compile, the dump kept
        chip = plan.chip_for(topology)
        flags = recommended_xla_flags("tpu", chip=chip.name) if xla_flags is None else tuple(xla_flags)
        options = compiler_options(flags) | {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile(compiler_options=options)
        _write_compiled(out, compiled, mesh, time.perf_counter() - t0, {
            "jax": jax.__version__, "libtpu": _version("libtpu"), "flags": list(flags), "label": label,
            "train_config": dataclasses.asdict(cfg)})
        return read_program(out, chip, ("cp_colossal", "cp_ulysses"))[0]  # what the trainer reads on

    real = plan.analyze_program
    plan.analyze_program = analyze_program
    try:
        train.plan_train_step(cfg)
    finally:
        plan.analyze_program = real


# --------------------------------------------------------------------------------------------------
# One reader for both programs


def remat_of(rec: dict) -> str:
    """What a compiled jax_cp step's remat kept: the policy its label names (``--jax-cp-remat auto``'s choice),
    else its config's; MaxText's record: its ``remat_policy`` override."""
    from models.train import planned_remat

    return planned_remat(rec.get("label", "")) or rec.get("train_config", {}).get("remat_policy", "full")


def read_program(path: str, chip, cp_axes: tuple[str, ...]):
    """``(Analysis, extra)``: jax_cp.plan's analysis of a compiled program's files, and its record."""
    from jax_cp.plan import analyze_schedule
    from jax_cp.plan import analysis_of, loop_bytes

    rec = json.loads(Path(path, "memory.json").read_text())
    text = Path(path, "hlo.txt").read_text()
    schedule = analyze_schedule(text, mesh_shape=rec["mesh_shape"], axis_names=rec["axis_names"], cp_axes=cp_axes)

    class Compiled:  # what analysis_of reads from a compiled program, from the files
        def memory_analysis(self):
            return type("M", (), {k: v for k, v in rec["memory"].items()})()

        def cost_analysis(self):
            return dict(rec["cost"])

    a = analysis_of(Path(path).name, Compiled(), schedule, chip, chip.device_hbm_bytes, rec["compile_s"],
                    loop_bytes(text))
    return a, {"rec": rec}


def shape_flops(a, layers: int, devices: int, kernel_rerun: bool = True) -> float:
    """Per-device FLOPs of one step counted from the shapes, the same formula for both programs (both
    rematerialise every layer): every layer's matmuls 8 x params x tokens (forward, the remat forward,
    backward 4), the head's 6 x D x V x tokens, and the causal attention kernels (forward 2 matmuls, the
    remat forward 2 where the kernel reruns, backward 5: scores recomputed, dP, dV, dQ, dK; each
    2 B S^2 H d / 2). ``kernel_rerun=False``: the step keeps the kernels' outputs (jax_cp's
    remat that keeps the attention, ``--jax-cp-remat attention`` or ``auto``'s choice, whose compiled program
    calls each forward kernel once)."""
    D, F, V = 4096, 14336, 128256
    H, K = variant_heads(a.head_dim)
    tokens = a.batch * a.seq_len
    layer = D * (H + 2 * K) * a.head_dim + H * a.head_dim * D + 3 * D * F
    attention = (9 if kernel_rerun else 7) * 2 * a.batch * a.seq_len**2 * H * a.head_dim / 2
    return (layers * (8 * layer * tokens + attention) + 6 * D * V * tokens) / devices


def figures(a_rec, analysis, extra, chip, layers: int, devices: int, args, kernel_rerun: bool = True) -> dict:
    """The table's figures of one compiled program (per device, seconds and bytes)."""
    m = analysis.memory
    compute_s = shape_flops(args, layers, devices, kernel_rerun) / chip.device_flops
    est = analysis.estimate
    cp = analysis.schedule.select()
    cp_exposed = sum(c.wire_bytes * c.iterations for c in cp if not c.overlapped) / chip.device_ici_bandwidth
    step = max(max(compute_s, est.memory_s) + est.exposed_comm_s, est.comm_s)
    host = a_rec["memory"].get("host_temp_size_in_bytes", 0)  # what --jax-cp-remat offload keeps on the host
    return {"arguments": m.arguments, "temporaries": m.temporaries, "peak": m.total, "host_temp": host,
            "cp_bytes": analysis.cp_bytes,
            "all_coll_bytes": float(sum(c.bytes * c.iterations for c in analysis.schedule.collectives)),
            "exposed_s": est.exposed_comm_s, "cp_exposed_s": cp_exposed, "compute_s": compute_s,
            "memory_s": est.memory_s, "comm_s": est.comm_s, "step_s": step}


def extrapolate(by_layers: dict[int, dict], full: int) -> dict:
    """Each figure at ``full`` layers: the whole step's where it was compiled, else from the two smallest
    cuts (affine in the layer count)."""
    if full in by_layers:
        return {**by_layers[full], "step_s": None}
    if len(by_layers) < 2:
        raise SystemExit(f"--layers={sorted(by_layers)}: two layer counts to extrapolate from, or the model's "
                         f"{full} (--full-layers) to compile the step whole.")
    (l0, f0), (l1, f1) = sorted(by_layers.items())[:2]
    out = {}
    for k in f0:
        slope = (f1[k] - f0[k]) / (l1 - l0)
        out[k] = f0[k] + slope * (full - l0)
    out["step_s"] = None  # recomputed from the extrapolated terms below
    return out


def _step_of(f: dict) -> float:
    return max(max(f["compute_s"], f["memory_s"]) + f["exposed_s"], f["comm_s"])


# --------------------------------------------------------------------------------------------------
# Largest buffers: each compiler's buffer assignment

_ALLOC = re.compile(r"^allocation (\d+): size (\d+),(.*):$")
_VALUE = re.compile(r"^\s*value: <\d+ ([^ ]+?)(?:\{[0-9,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
_ALIASES = ("get-tuple-element", "bitcast", "tuple", "opt-barrier")


def temp_values(path: str) -> dict[str, int]:
    """``{instruction: bytes}`` of the values the compiler placed in the main temporary allocation
    (the largest ``preallocated-temp`` one), from its buffer assignment."""
    f = Path(path, "buffer-assignment.txt")
    if not f.exists():
        return {}
    allocs, current = {}, None
    for line in f.read_text().splitlines():
        m = _ALLOC.match(line)
        if m:
            current = int(m.group(1)) if "preallocated-temp" in m.group(3) and "color" not in m.group(3) else None
            if current is not None:
                allocs[current] = (int(m.group(2)), {})
            continue
        if line.startswith("allocation") or not line.startswith(" value"):
            current = None if line.startswith("allocation") else current
        if current is not None:
            v = _VALUE.match(line)
            if v:
                values = allocs[current][1]
                values[v.group(1)] = values.get(v.group(1), 0) + int(v.group(2))
    if not allocs:
        return {}
    return max(allocs.values(), key=lambda a: a[0])[1]


def live_at_peak(path: str, n: int = 14) -> tuple[int, list[tuple[int, str, str, str]]]:
    """``(bytes, [(bytes, name, shape, op)])``: the entry computation's temporaries live at its peak.

    Liveness from the schedule (the scheduled entry computation): a value lives from its defining
    instruction to the last use of it or of an alias of it (get-tuple-element, bitcast, tuple).
    Loop bodies' and fusions' own scratch is not in it (the compiler's temporary total is)."""
    from jax_cp.plan import parse_module

    sizes = temp_values(path)
    comps, entry = parse_module(Path(path, "hlo.txt").read_text())
    instrs = comps[entry]
    where = {i.name: k for k, i in enumerate(instrs)}
    sources: dict[str, set[str]] = {}
    last: dict[str, int] = {}
    for k, i in enumerate(instrs):
        refs = [r.split("#")[0].lstrip("%") for r in (i.refs or i.operands)]
        src = set()
        for r in refs:
            for s_ in sources.get(r, {r}):
                last[s_] = k
                src.add(s_)
        sources[i.name] = src if i.opcode in _ALIASES else {i.name}
    events = []
    for name, size in sizes.items():
        if name in where:
            events.append((where[name], last.get(name, where[name]), size, name))
    if not events:
        return 0, []
    live = [0] * (len(instrs) + 1)
    for a, b, size, _ in events:
        live[a] += size
        live[b + 1] -= size
    run, peak, t_peak = 0, -1, 0
    for t, d in enumerate(live):
        run += d
        if run > peak:
            peak, t_peak = run, t
    at = sorted(((size, name) for a, b, size, name in events if a <= t_peak <= b), reverse=True)[:n]
    out = []
    for size, name in at:
        i = instrs[where[name]]
        op = (i.op_name or "").replace("jit(train_step)/", "")
        out.append((size, name, re.sub(r"\{[^}]*\}", "", i.shape)[:70], op[-110:]))
    return peak, out


# --------------------------------------------------------------------------------------------------


def _gib(x):
    return f"{x / GiB:.2f}"


def _ms(x):
    return f"{x * 1e3:.1f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5p:4x4x4")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--head-dim", type=int, default=128, choices=(128, 256),
                   help="128 (Llama 3.1 8B) or 256 (16 query / 4 kv heads of 256, the same width)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4],
                   help="decoder layers compiled: two or more cuts extrapolated to --full-layers, or --full-layers "
                        "itself (the whole step, exact)")
    p.add_argument("--full-layers", type=int, default=32, help="the model's layer count, extrapolated to")
    p.add_argument("--cp-colossal", type=int, default=4)
    p.add_argument("--cp-ulysses", type=int, default=4)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--jax-cp-fsdp", action="store_true",
                   help="jax_cp stores weights and optimizer state sharded over dp and the CP axes, as MaxText does "
                        "(--fsdp; default: the trainer's --fsdp auto, which does so for the 8B)")
    p.add_argument("--jax-cp-kv-exchange", default="auto", help="jax_cp's K/V exchange (auto, all_gather, "
                   "all_to_all, ring)")
    p.add_argument("--jax-cp-residual-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="jax_cp's residual stream (models.train --residual-dtype: auto, the compute dtype, is "
                        "bfloat16 here, as MaxText's)")
    p.add_argument("--jax-cp-remat", choices=("auto", "full", "attention", "offload"), default="auto",
                   help="what jax_cp's remat keeps (models.train --remat-policy): auto (its default) the first of "
                        "attention, full, offload whose step fits the chip; full recomputes every layer, as "
                        "MaxText's recipe; attention also keeps the attention kernels' outputs (no kernel rerun); "
                        "offload recomputes every layer and keeps each layer's input in host memory")
    p.add_argument("--jax-cp-topology", choices=("maxtext", "plan"), default="maxtext",
                   help="the pod description jax_cp compiles for: MaxText's (the default: its chip config, chips per "
                        "host and wraparound links, the same pod as its side) or jax_cp.plan's (libtpu's default "
                        "for the name, without wraparound links)")
    p.add_argument("--jax-cp-unrolled", action="store_true", help="jax_cp unrolls its blocks "
                   "(models.train --no-scan-layers; default: one lax.scan, as MaxText scans its layers)")
    p.add_argument("--maxtext-cp-strategy", default="all_gather", choices=("all_gather", "ring", "ulysses", "usp"),
                   help="MaxText's context parallelism (usp: --cp-colossal x --cp-ulysses, as jax_cp's hybrid)")
    p.add_argument("--maxtext-remat", default="full")
    p.add_argument("--maxtext-flags", default="default", choices=("default", "jax_cp"),
                   help="MaxText's compiler flags: its own (default) or, added to them, jax_cp's "
                        "plan.recommended_xla_flags for the chip and FSDP (MaxText's sharding), jax_cp's side's flags")
    p.add_argument("--maxtext-extra", nargs="*", default=[], help="more MaxText key=value overrides")
    p.add_argument("--maxtext-python", default=str(MAXTEXT_PYTHON))
    p.add_argument("--only", choices=("jax_cp", "maxtext"), help="compile one side only")
    p.add_argument("--out", default=str(ROOT / "runs" / "vs_maxtext"))
    p.add_argument("--force", action="store_true", help="recompile what --out already holds")
    p.add_argument("--largest", action="store_true", help="find each side's largest context that fits the chip: "
                   "--full-layers compiled whole at --seq-len, doubled while it fits (up to --max-seq-len), then "
                   "bisected to a quarter of --seq-len")
    p.add_argument("--max-seq-len", type=int, default=16 * 2**20)
    p.add_argument("--maxtext-driver", metavar="DIR", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args(argv)
    if a.maxtext_driver:
        return maxtext_driver(a.maxtext_driver, [r for r in rest if r != "--"])
    a.cp = a.cp_colossal * a.cp_ulysses
    a.out = os.path.abspath(a.out)

    from jax_cp import plan

    if a.jax_cp_topology == "maxtext":  # every plan for this name, jax_cp's side's, compiles for MaxText's description
        plan.set_topology(a.topology, **maxtext_topology_kwargs(a.topology))

    chip = plan.chip_for(a.topology)
    sides = {
        "jax_cp" + ("-fsdp" if a.jax_cp_fsdp else "") + ("-unrolled" if a.jax_cp_unrolled else "-scan")
        + ("-f32res" if a.jax_cp_residual_dtype == "float32" else "")
        + {"auto": "", "full": "-full", "attention": "-keepattn", "offload": "-offload"}[a.jax_cp_remat]
        + ("-planpod" if a.jax_cp_topology == "plan" else "")
        + ("" if a.jax_cp_kv_exchange == "auto" else f"-{a.jax_cp_kv_exchange}"): ("jax_cp", ("cp_colossal", "cp_ulysses")),
        f"maxtext-{a.maxtext_cp_strategy}-{a.maxtext_remat}" + ("-jaxcpflags" if a.maxtext_flags == "jax_cp" else ""):
            ("maxtext", ("context",)),
    }
    if a.largest:
        return largest(a, chip, sides)
    results = {}
    for side, (kind, cp_axes) in sides.items():
        if a.only and a.only != kind:
            continue
        by_layers = {}
        for L in a.layers:
            by_layers[L], analysis, extra, path = _program(a, chip, side, kind, cp_axes, L)
            results[(side, L)] = (analysis, extra, path)
        full = extrapolate(by_layers, a.full_layers)
        full["step_s"] = _step_of(full)
        results[(side, "full")] = full
        results[(side, "by_layers")] = by_layers
    _print(a, chip, sides, results)
    _write_summaries(a, results)


def _tag(a) -> str:
    """The folder under ``--out`` of one topology, context, batch and head size."""
    return f"{a.topology.replace(':', '_')}-S{a.seq_len}-B{a.batch}-d{a.head_dim}"


def _write_summaries(a, results) -> None:
    """``<side>-summary.json`` beside each side's programs: its figures at ``--full-layers`` and the run's
    shape (what ``benchmarks/plot_vs_maxtext.py`` draws)."""
    for (side, key), figures in results.items():
        if key == "full":
            Path(a.out, _tag(a), f"{side}-summary.json").write_text(json.dumps({
                "side": side, "topology": a.topology, "seq_len": a.seq_len, "batch": a.batch,
                "layers": a.full_layers, "compiled_layers": a.layers, "figures": figures}, indent=1))


def _program(a, chip, side: str, kind: str, cp_axes, layers: int) -> tuple[dict, object, dict, str]:
    """``(figures, analysis, extra, path)`` of ``side``'s step with ``layers`` layers at ``--seq-len``,
    compiled unless ``--out`` holds it (or ``--force``)."""
    path = os.path.join(a.out, _tag(a), f"{side}-L{layers}")
    if a.force or not Path(path, "memory.json").exists():
        os.makedirs(path, exist_ok=True)
        t0 = time.perf_counter()
        print(f"compiling {side} with {layers} layers at S={a.seq_len} ...", flush=True)
        compile_jax_cp(a, layers, path) if kind == "jax_cp" else _run_maxtext(a, layers, path)
        print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
    analysis, extra = read_program(path, chip, cp_axes)
    devices = math.prod(extra["rec"]["mesh_shape"])
    rerun = kind == "maxtext" or remat_of(extra["rec"]) != "attention"  # MaxText: --maxtext-remat full, its recipe's
    return figures(extra["rec"], analysis, extra, chip, layers, devices, a, rerun), analysis, extra, path


def _compiled(a, chip, side: str, kind: str, cp_axes, S: int) -> tuple[dict | None, str]:
    """``(figures, path)`` of ``side``'s whole step (``--full-layers``) at ``S`` tokens (``_program``);
    ``None`` and the compiler's message where the compile itself fails."""
    try:
        f, _, _, path = _program(argparse.Namespace(**{**vars(a), "seq_len": S}), chip, side, kind, cp_axes,
                                 a.full_layers)
    except (Exception, SystemExit) as e:  # a compiler that refuses the program (e.g. out of memory)
        lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        return None, next((ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "memory" in ln.lower()),
                          lines[0]).strip()[:160]
    return f, path


def largest(a, chip, sides) -> None:
    """``--largest``: each side's step compiled whole at ``--seq-len``, doubled while its peak fits the
    chip's HBM (up to ``--max-seq-len``), then bisected between the last fit and the first miss in steps
    of a quarter of ``--seq-len``; prints every compile's peak and the largest context that fits."""
    step = max(a.seq_len // 4, 1)
    print(f"\nLargest context, {a.topology} ({chip.device_kind}, {chip.device_hbm_bytes / GiB:.0f} GiB HBM), "
          f"B={a.batch}, {a.full_layers} layers compiled whole, per device:\n")
    print("| side | S | peak (GiB) | host (GiB) | remat | fits | estimated step (s) |\n|---|---|---|---|---|---|---|")
    for side, (kind, cp_axes) in sides.items():
        if a.only and a.only != kind:
            continue
        tried = {}

        def fits(S):
            f, note = _compiled(a, chip, side, kind, cp_axes, S)
            remat = remat_of(json.loads(Path(note, "memory.json").read_text())) if f is not None else "-"
            ok = f is not None and f["peak"] <= chip.device_hbm_bytes
            tried[S] = (f, note, ok)
            peak = "-" if f is None else f"{f['peak'] / GiB:.2f}"
            host = "-" if f is None else f"{f.get('host_temp', 0) / GiB:.2f}"
            print(f"| {side} | {S} | {peak} | {host} | {remat} | {'yes' if ok else 'no' + ('' if f else f' ({note})')} | "
                  + ("-" if f is None else f"{f['step_s']:.1f}") + " |", flush=True)
            return ok

        S = a.seq_len
        while S <= a.max_seq_len and fits(S):
            S *= 2
        lo, hi = S // 2, min(S, a.max_seq_len + step)
        if lo < a.seq_len:
            print(f"{side}: {a.seq_len} tokens do not fit", flush=True)
            continue
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        print(f"{side}: the largest context that fits: {lo} tokens ({lo / 2**20:.2f}M)", flush=True)


def _run_maxtext(a, layers: int, path: str) -> None:
    if not Path(a.maxtext_python).exists():
        raise SystemExit(f"{a.maxtext_python} does not exist: run `make vs-maxtext` (it creates .venv-maxtext).")
    env = dict(os.environ, **QUIET_ENV)
    env.pop("PYTHONPATH", None)
    if a.maxtext_flags == "jax_cp":
        from jax_cp.plan import chip_for, recommended_xla_flags
        env[MAXTEXT_FLAGS_ENV] = " ".join(recommended_xla_flags("tpu", chip=chip_for(a.topology).name, fsdp=True))
    cmd = [a.maxtext_python, os.path.abspath(__file__), "--maxtext-driver", path, "--", *maxtext_overrides(a, layers)]
    with open(os.path.join(path, "log.txt"), "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
    if r.returncode or not Path(path, "memory.json").exists():
        tail = Path(path, "log.txt").read_text()[-3000:]
        raise SystemExit(f"MaxText's compile failed (exit {r.returncode}); the end of {path}/log.txt:\n{tail}")


def _print(a, chip, sides, results) -> None:
    how = ("compiled whole" if a.full_layers in a.layers else
           f"extrapolated from {' and '.join(map(str, a.layers[:2]))}-layer compiles (affine in the layer count)")
    print(f"\nOne training step, Llama 3.1 8B shapes (head_dim {a.head_dim}), {a.topology} ({chip.device_kind}), "
          f"B={a.batch}, S={a.seq_len}; per device; {a.full_layers} layers {how}\n")
    rows = [("arguments (GiB)", "arguments", _gib), ("temporaries (GiB)", "temporaries", _gib),
            ("peak (GiB)", "peak", _gib), ("host memory, temporaries (GiB)", "host_temp", _gib),
            ("CP collective bytes (GiB)", "cp_bytes", _gib),
            ("all collective bytes (GiB)", "all_coll_bytes", _gib),
            ("exposed collectives, all (ms)", "exposed_s", _ms), ("exposed CP collectives (ms)", "cp_exposed_s", _ms),
            ("compute (ms)", "compute_s", _ms), ("HBM traffic (ms)", "memory_s", _ms),
            ("estimated step (ms)", "step_s", _ms)]
    names = [s for s in sides if (s, "full") in results]
    cols = [(s, L) for s in names for L in a.layers] + [(s, "full") for s in names]
    head = ["figure"] + [f"{s} L={L}" if L != "full" else f"{s} L={a.full_layers} (extrap.)" for s, L in cols]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for label, key, fmt in rows:
        vals = []
        for s, L in cols:
            f = results[(s, "full")] if L == "full" else results[(s, "by_layers")][L]
            vals.append(fmt(f[key]))
        print(f"| {label} | " + " | ".join(vals) + " |")
    print("\nCompute: FLOPs counted from the shapes, the same formula for both (full remat: matmuls 8 x params "
          "x tokens, head 6 x D x V x tokens, attention kernels fwd + remat fwd + bwd, jax_cp's remat fwd left out "
          "where jax_cp's remat keeps the attention); the compilers' own counts "
          "are not comparable: each counts a loop body once and MaxText scans its layers. HBM traffic: the "
          "compiler's bytes accessed plus jax_cp.plan's count of loop bodies' further trips (loop_bytes). "
          f"Peaks: {chip.device_kind} {chip.device_flops / 1e12:.0f} TFLOP/s, "
          f"{chip.device_hbm_bandwidth / 1e9:.0f} GB/s HBM, {chip.device_ici_bandwidth / 1e9:.0f} GB/s ICI per device.")
    for s in names:
        L = max(a.layers)
        analysis, extra, path = results[(s, L)]
        peak, top = live_at_peak(path)
        print(f"\n{s}, {L} layers: temporaries live at the entry computation's peak, {peak / GiB:.2f} GiB "
              f"(the schedule and the buffer assignment; {path})")
        for size, name, shape, op in top:
            print(f"  {size / 2**20:8.1f} MiB  {shape}  {name}  {op}")
        info = {k: v for k, v in extra["rec"].items() if k in ("jax", "libtpu", "maxtext")}
        if sides[s][0] == "jax_cp":
            print(f"  remat: {remat_of(extra['rec'])}")
        print(f"  versions: {info}")


if __name__ == "__main__":
    main()
