"""What the planner reports about one compiled program, and how it prints.

All sizes are per device (one JAX device: a chip, or a TensorCore on v4).
Times are *estimates* from published chip peaks, not measurements.
"""
from __future__ import annotations

import dataclasses

from jax_cp._chips import Chip
from jax_cp.plan._hlo import Schedule
from jax_cp.plan._verdict import Option, Verdict

__all__ = ["Memory", "Estimate", "Analysis", "Report", "Comparison", "analysis_of", "format_programs", "option_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """``compiled.memory_analysis()`` per device, and the budget it is checked against.

    Attributes:
        arguments, outputs, temporaries, aliased, code: bytes of each kind, per device.
        peak: the compiler's own peak figure (0 where the backend gives none).
        budget: the memory budget in bytes (positive).
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    code: int
    peak: int  # the compiler's own peak figure (0 where the backend gives none)
    budget: int

    def __post_init__(self):
        if self.budget <= 0:
            raise ValueError(f"budget={self.budget} bytes must be positive.")

    @classmethod
    def of(cls, compiled, budget: int) -> "Memory":
        """The memory analysis of a compiled program.

        Args:
            compiled: a compiled program (``jax.jit(f).lower(...).compile()``), or an object with its
                ``memory_analysis()``.
            budget: the device's memory in bytes.

        Returns:
            Its :class:`Memory` per device, checked against ``budget``.
        """
        m = compiled.memory_analysis()
        return cls(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
                   temporaries=int(m.temp_size_in_bytes), aliased=int(m.alias_size_in_bytes),
                   code=int(m.generated_code_size_in_bytes), peak=int(getattr(m, "peak_memory_in_bytes", 0) or 0),
                   budget=budget)

    @property
    def total(self) -> int:
        """Peak bytes in use: the compiler's peak, never below arguments+outputs+temporaries-aliased."""
        return max(self.peak, self.arguments + self.outputs + self.temporaries - self.aliased)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """Step-time estimate (seconds) from FLOPs, bytes and published peaks. An estimate only.

    Attributes:
        compute_s: FLOPs / peak bf16 FLOP/s.
        memory_s: bytes accessed / HBM bandwidth.
        comm_s: every collective's wire bytes / ICI bandwidth.
        exposed_comm_s: the same for collectives with no compute scheduled inside.
    """

    compute_s: float  # FLOPs / peak bf16 FLOP/s
    memory_s: float  # bytes accessed / HBM bandwidth
    comm_s: float  # every collective's wire bytes / ICI bandwidth
    exposed_comm_s: float  # the same for collectives with no compute scheduled inside

    @property
    def step_s(self) -> float:
        """Roofline of the device work, plus exposed communication; never below all communication."""
        return max(max(self.compute_s, self.memory_s) + self.exposed_comm_s, self.comm_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Analysis:
    """One compiled program: memory, FLOPs, collectives and overlap, time estimate.

    Attributes:
        label: the program's name.
        memory: its :class:`Memory`.
        flops, bytes_accessed: the compiler's cost analysis.
        schedule: its collectives (:class:`Schedule`).
        estimate: the step-time :class:`Estimate`.
        compile_s: compile time in seconds.
        kernel_calls: Pallas attention kernels in the scheduled program.
        model_flops: counted from the shapes (``plan._auto.layer_flops``), not by the compiler.
        executed_flops: the same plus the kernels' backward recomputation.
        peak_flops: the chip's, for the MFU estimate.
        time_covered: fwd, bwd, both: share of CP transfer time compute covers.
    """

    label: str
    memory: Memory
    flops: float
    bytes_accessed: float
    schedule: Schedule
    estimate: Estimate
    compile_s: float
    kernel_calls: tuple[tuple[str, int], ...] = ()  # Pallas attention kernels in the scheduled program
    model_flops: float | None = None  # counted from the shapes (plan._auto.layer_flops), not by the compiler
    executed_flops: float | None = None  # the same plus the kernels' backward recomputation
    peak_flops: float | None = None  # the chip's, for the MFU estimate
    time_covered: tuple = (None, None, None)  # fwd, bwd, both: share of CP transfer time compute covers

    def with_shape_flops(self, model: float, executed: float, chip: Chip) -> "Analysis":
        """This analysis with FLOPs counted from the shapes; compute time is the larger count over
        the peak (the compiler counts a loop body once and gives Pallas kernels no FLOPs)."""
        estimate = dataclasses.replace(self.estimate, compute_s=max(self.flops, executed) / chip.device_flops)
        return dataclasses.replace(self, model_flops=model, executed_flops=executed, estimate=estimate,
                                   peak_flops=chip.device_flops)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs over (estimated step time x peak): the roofline-bound MFU. An estimate."""
        if not self.model_flops or not self.peak_flops or not self.estimate.step_s:
            return None
        return self.model_flops / (self.estimate.step_s * self.peak_flops)

    @property
    def kernel(self) -> str:
        """The attention kernel the compiled program runs, read from its scheduled HLO."""
        if not self.kernel_calls:
            return "plain JAX (blockwise)"
        return "splash (" + ", ".join(f"{name} x{n}" for name, n in self.kernel_calls) + ")"

    def overlap(self, phase: str | None = None) -> float | None:
        """Share of context-parallel collective bytes with compute scheduled inside (fwd/bwd/all)."""
        return self.schedule.overlap_fraction(phase)

    @property
    def cp_bytes(self) -> float:
        """Bytes of the CP collectives, forward + backward, a loop body's once per trip."""
        return float(sum(c.bytes * c.iterations for c in self.schedule.select()))

    def covered(self, phase: str | None = None) -> float | None:
        """Share of the CP collectives' estimated transfer time that the compute scheduled inside them
        covers (``Schedule.time_covered`` at the chip's peaks; fwd/bwd/all). An estimate."""
        return self.time_covered[{"fwd": 0, "bwd": 1, None: 2}[phase]]

    def __str__(self) -> str:
        return format_programs([self])


def analysis_of(label: str, compiled, schedule: Schedule, chip: Chip, budget: int, compile_s: float,
                loop_bytes: float = 0.0) -> Analysis:
    """Reads memory and cost from a compiled program and estimates its step time on ``chip``.

    Any compiled program (jax_cp's or another library's) is read the same way.

    Args:
        label: the program's name in reports.
        compiled: the compiled program (``jax.jit(f).lower(...).compile()``), or an object with its
            ``memory_analysis()`` and ``cost_analysis()``.
        schedule: its collectives as :func:`analyze_schedule` read them.
        chip: the chip it runs on (:data:`CHIPS`).
        budget: the device's HBM bytes.
        compile_s: seconds the compile took.
        loop_bytes: HBM bytes of loop bodies' further trips (:func:`loop_bytes`), which the
            compiler's cost analysis, counting each body once, leaves out.

    Returns:
        The :class:`Analysis`: memory, collectives and the estimated step.
    """
    memory = Memory.of(compiled, budget)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)) + loop_bytes
    comm = [c.wire_bytes * c.iterations / chip.device_ici_bandwidth for c in schedule.collectives]
    exposed = [t for t, c in zip(comm, schedule.collectives) if not c.overlapped]
    estimate = Estimate(
        compute_s=flops / chip.device_flops, memory_s=accessed / chip.device_hbm_bandwidth,
        comm_s=sum(comm), exposed_comm_s=sum(exposed),
    )
    covered = tuple(schedule.time_covered(ph, flops_per_s=chip.device_flops, bytes_per_s=chip.device_ici_bandwidth,
                                          hbm_bytes_per_s=chip.device_hbm_bandwidth) for ph in ("fwd", "bwd", None))
    return Analysis(label=label, memory=memory, flops=flops, bytes_accessed=accessed, schedule=schedule,
                    estimate=estimate, compile_s=compile_s, time_covered=covered)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """The planner's answer: the layout, its analysis, the naive baseline, and why (for ``auto``).

    Attributes:
        topology: the topology planned for.
        chip: its :class:`Chip`.
        mesh_shape: the mesh's axis sizes.
        layer: the ``LayerShape`` compiled.
        flags: the XLA flags compiled with.
        analysis: the layout's :class:`Analysis`.
        baseline: the naive baseline's (or ``None``).
        reasons: why the layout was chosen (for ``auto``).
        defaults: why the ``"auto"`` knobs resolved as they did (empty: none was auto).
        rule_check: this plan's overlap against what the auto rule measured (``plan._verdict.rule_check``).
        verdict: the last line: which layout to run and why (``plan._verdict.verdict``).
    """

    topology: str
    chip: Chip
    mesh_shape: dict[str, int]
    layer: object  # the LayerShape compiled
    flags: str
    analysis: Analysis
    baseline: Analysis | None = None
    reasons: tuple[str, ...] = ()
    defaults: str = ""  # why the "auto" knobs resolved as they did (empty: none was auto)
    rule_check: str = ""  # this plan's overlap against what the auto rule measured (plan._verdict.rule_check)
    verdict: str = ""  # the last line: which layout to run and why (plan._verdict.verdict)

    def __str__(self) -> str:
        return format_report(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """Several layouts of one layer planned alike (``plan.compare``), and which to run.

    Attributes:
        reports: one :class:`Report` per layout (at least one).
        verdict: the :class:`Verdict` over them.
    """

    reports: tuple[Report, ...]
    verdict: Verdict

    def __post_init__(self):
        if not self.reports:
            raise ValueError("Comparison needs at least one report; got none.")

    def __str__(self) -> str:
        return format_comparison(self)


def option_of(a: Analysis, label: str | None = None) -> Option:
    """What the verdict weighs of a compiled program: estimated step, peak memory, CP bytes, fit."""
    return Option(label=label or a.label, step_s=a.estimate.step_s, memory_bytes=a.memory.total,
                  cp_bytes=a.cp_bytes, fits=a.memory.fits)


def _b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _f(x: float | None) -> str:
    return "  -  " if x is None else f"{x:.2f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _layer_line(L, knobs: bool = True) -> str:
    line = (f"layer: B={L.batch} S={L.seq_len} D={L.d_model} H={L.num_heads} K={L.num_kv_heads} d={L.head_dim} "
            f"dtype={L.dtype} params={L.param_dtype} causal={L.is_causal} kernel={L.kernel}")
    return line + (f" {_knobs(L)}" if knobs else "")


def _knobs(L) -> str:
    return f"kv_exchange={L.kv_exchange} overlap_chunks={L.overlap_chunks} fused_qkv_chunks={L.fused_qkv_chunks}"


def _auto_lines(r: Report, indent: str = "") -> list[str]:
    lines = [f"{indent}auto (kv_exchange, overlap_chunks, fused_qkv_chunks): {r.defaults}"] if r.defaults else []
    return lines + ([f"{indent}  {r.rule_check}"] if r.rule_check else [])


def format_report(r: Report) -> str:
    a, base = r.analysis, r.baseline
    mesh = " ".join(f"{k}={v}" for k, v in r.mesh_shape.items())
    lines = [
        f"jax_cp plan: {r.topology} ({r.chip.device_kind}), mesh {mesh}",
        _layer_line(r.layer),
        f"flags: {r.flags or '(none)'}",
        *_auto_lines(r),
        f"kernel (kernel={r.layer.kernel}): {a.kernel} in the scheduled program",
        "",
    ]
    if r.reasons:
        lines += ["strategy=auto:", *(f"  {x}" for x in r.reasons), ""]
    lines += format_programs([a] + ([base] if base is not None else [])).splitlines()
    return "\n".join(lines + ([""] + [r.verdict] if r.verdict else []))


def format_comparison(cmp: Comparison) -> str:
    """The layouts side by side (the first one's collectives listed), then the verdict as the last line."""
    first = cmp.reports[0]
    lines = [f"jax_cp plan: {first.topology} ({first.chip.device_kind}), {len(cmp.reports)} layouts of one layer "
             "at the same global batch", _layer_line(first.layer, knobs=False), f"flags: {first.flags or '(none)'}"]
    for r in cmp.reports:
        mesh = " ".join(f"{k}={v}" for k, v in r.mesh_shape.items())
        lines += [f"{r.analysis.label}: mesh {mesh}, {_knobs(r.layer)}, kernel {r.analysis.kernel.split(' (')[0]}",
                  *_auto_lines(r, indent="  ")]
    lines.append("")
    lines += format_programs([r.analysis for r in cmp.reports]).splitlines()
    return "\n".join(lines + ["", cmp.verdict.line])


def format_programs(programs: list[Analysis], grouped: bool = False) -> str:
    """Side-by-side figures of ``programs``, then the first one's collectives, then what the figures mean.

    Args:
        programs: the :class:`Analysis` of each program.
        grouped: one line per kind of collective (phase, kind, axes, bytes) with counts, for
            programs with thousands of them (a whole model's training step).

    Returns:
        The text.
    """
    a = programs[0]
    lines = []
    head = f"{'':34s}" + "".join(f"{p.label:>22s}" for p in programs)
    rows = [
        ("memory: arguments", lambda p: _b(p.memory.arguments)),
        ("memory: outputs", lambda p: _b(p.memory.outputs)),
        ("memory: temporaries", lambda p: _b(p.memory.temporaries)),
        ("memory: total (peak)", lambda p: _b(p.memory.total)),
        (f"fits HBM budget {_b(a.memory.budget)}", lambda p: "yes" if p.memory.fits else "NO"),
        ("kernel that ran", lambda p: p.kernel.split(" (")[0]),
        ("FLOPs per device (compiler)", lambda p: f"{p.flops:.3e}"),
        ("FLOPs per device (shapes, model)", lambda p: "-" if p.model_flops is None else f"{p.model_flops:.3e}"),
        ("FLOPs executed (with recompute)", lambda p: "-" if p.executed_flops is None else f"{p.executed_flops:.3e}"),
        ("CP collective bytes fwd", lambda p: _b(sum(c.bytes * c.iterations for c in p.schedule.select("fwd")))),
        ("CP collective bytes bwd", lambda p: _b(sum(c.bytes * c.iterations for c in p.schedule.select("bwd")))),
        ("HBM bytes (loops x trips)", lambda p: _b(p.bytes_accessed)),
        ("overlap fraction fwd", lambda p: _f(p.overlap("fwd"))),
        ("overlap fraction bwd", lambda p: _f(p.overlap("bwd"))),
        ("overlap fraction fwd+bwd", lambda p: _f(p.overlap())),
        ("CP transfer time covered fwd", lambda p: _f(p.covered("fwd"))),
        ("CP transfer time covered bwd", lambda p: _f(p.covered("bwd"))),
        ("est. compute (FLOPs/peak)", lambda p: _ms(p.estimate.compute_s)),
        ("est. HBM traffic time", lambda p: _ms(p.estimate.memory_s)),
        ("est. communication (all)", lambda p: _ms(p.estimate.comm_s)),
        ("est. communication exposed", lambda p: _ms(p.estimate.exposed_comm_s)),
        ("ESTIMATED step time", lambda p: _ms(p.estimate.step_s)),
        ("est. MFU (model FLOPs / step)", lambda p: "-" if p.mfu is None else f"{p.mfu:.2f}"),
        ("compile time", lambda p: f"{p.compile_s:.1f} s"),
    ]
    lines.append(head)
    lines += [f"{name:34s}" + "".join(f"{fn(p):>22s}" for p in programs) for name, fn in rows]
    lines += ["", f"collectives of {a.label} ({'grouped, ' if grouped else ''}schedule order; * = counted in the "
              "CP overlap fraction; loop = in a loop body, bytes per iteration, xN = runs N times, counted N times in "
              "the time estimates):"]
    lines += _grouped_collectives(a) if grouped else _listed_collectives(a)
    lines += _FOOTER
    return "\n".join(lines)


_FOOTER = ["", "Times are estimates from published per-chip peaks (bf16 FLOP/s, HBM and ICI bandwidth),",
           "not measurements. A collective counts as overlapped when a matmul/convolution is scheduled",
           "between its start and done; fwd/bwd come from JAX's op names (transpose(...) = backward).",
           "Transfer time covered: per overlapped CP collective, min(1, the ops inside at their roofline,",
           "max(FLOPs / peak, HBM bytes / bandwidth), over its wire bytes / ICI bandwidth), weighted by",
           "transfer time (a Pallas kernel inside counts as covering)."]


def _listed_collectives(a: Analysis) -> list[str]:
    lines = [f"  {'':2s}{'phase':6s}{'kind':20s}{'mesh axes':26s}{'bytes':>12s}  {'async':6s}{'overlapped':11s}name"]
    for c in a.schedule.collectives:
        mark = "*" if a.schedule.is_cp(c) else " "
        lines.append(
            f"  {mark} {c.phase:6s}{c.kind:20s}{','.join(c.axes) or '-':26s}{_b(c.bytes):>12s}  "
            f"{'yes' if c.is_async else 'no':6s}{'yes' if c.overlapped else 'no':11s}{c.name}"
            + ((f" (loop x{c.iterations})" if c.iterations > 1 else " (loop)") if c.in_loop else "")
        )
    return lines


def _grouped_collectives(a: Analysis) -> list[str]:
    groups: dict[tuple, list[int]] = {}  # (cp, phase, kind, axes, bytes, loop) -> [count, async, overlapped]
    for c in a.schedule.collectives:
        g = groups.setdefault((a.schedule.is_cp(c), c.phase, c.kind, c.axes, c.bytes, c.in_loop), [0, 0, 0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + c.is_async, g[2] + c.overlapped
    lines = [f"  {'':2s}{'phase':6s}{'kind':20s}{'mesh axes':26s}{'bytes':>12s}{'count':>7s}  {'async':>7s}  "
             f"{'overlapped':>10s}"]
    for (cp, phase, kind, axes, nbytes, loop), (n, n_async, n_over) in groups.items():
        lines.append(f"  {'*' if cp else ' '} {phase:6s}{kind:20s}{','.join(axes) or '-':26s}{_b(nbytes):>12s}{n:>7d}  "
                     f"{n_async:>7d}  {n_over:>10d}" + (" (loop)" if loop else ""))
    return lines
