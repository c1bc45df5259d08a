"""``analyze``: compile a layout ahead of time for a TPU topology and report on it.

Compiles forward+backward of one ``CPAttention`` (and the naive baseline) for
the topology's devices with the recommended flags, then reads memory, FLOPs
and the scheduled HLO. ``strategy="auto"`` ranks every valid layout by a
closed-form estimate, compiles the best few and keeps the fastest that fits.
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import math
import os
import re
import tempfile
import time

import jax
from jax.sharding import AxisType

from jax_cp import exchanges
from jax_cp._checks import check_positive_int
from jax_cp._mesh import MeshDims, make_mesh, mesh_dims
from jax_cp.plan import _auto
from jax_cp.plan._build import LayerShape, cp_layer, naive_layer
from jax_cp._chips import chip_for
from jax_cp.plan._flags import compiler_options, recommended_xla_flags
from jax_cp.plan._hlo import analyze_schedule, loop_bytes
from jax_cp.plan._models import ModelSpec, model_spec
from jax_cp.plan._report import Analysis, Comparison, Report, analysis_of, option_of
from jax_cp.plan._verdict import TIE, rule_check, verdict

__all__ = ["analyze", "analyze_program", "compare", "get_topology", "parse_layout", "STRATEGIES", "kv_exchanges"]

STRATEGIES = ("manual", "auto")
_TOPOLOGIES: dict[str, object] = {}


def kv_exchanges() -> tuple[str, ...]:
    """The names of the colossal K/V exchanges this installation offers (``jax_cp.exchanges.NAMES``)."""
    return exchanges.NAMES


def _compile_only() -> bool:
    """This process compiles for TPU without running on one (``JAX_PLATFORMS`` set, without ``tpu``)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return bool(platforms) and "tpu" not in platforms


def _allow_shared_libtpu() -> None:
    """Lets several compile-only processes load libtpu at once (it takes a machine-wide lock otherwise)."""
    if _compile_only():
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# Loading libtpu on a machine that is no TPU VM, with these unset, prints a harmless block to stderr
# (libtpu 0.0.52: "Failed to find host bounds for accelerator type: WARNING: could not determine ...",
# "E0000 ... INVALID_ARGUMENT: ... unexpected worker hostname ...", "=== Source Location Trace: ==="):
# it looks for the TPU workers and hosts it would run on, and a compile-only process runs on none.
# Its log-level variables (TPU_STDERR_LOG_LEVEL, TPU_MIN_LOG_LEVEL) do not reach it (it logs before
# initialising its logging). Naming this host as the only worker silences it, and the compiled programs
# are the same (v5e:2x4 and v5p:4x4x4 layers: byte-identical scheduled HLO). Set only while the planner
# loads libtpu in a compile-only process, only where the user has not set them, and removed afterwards.
QUIET_LIBTPU_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


@contextlib.contextmanager
def _quiet_libtpu():
    added = [k for k in QUIET_LIBTPU_ENV if k not in os.environ] if _compile_only() else []
    os.environ.update({k: QUIET_LIBTPU_ENV[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def get_topology(name: str):
    """TPU topology description for ``name`` (e.g. ``"v5e:4x4"``); its ``devices`` build meshes.

    Args:
        name: the topology name.

    Returns:
        libtpu's topology description (cached per name).

    Raises:
        ValueError: the chip is unknown, or libtpu does not know the topology.
    """
    if name not in _TOPOLOGIES:
        _describe(name)
    return _TOPOLOGIES[name]


def _describe(name: str, **description):
    """libtpu's description of ``name`` (``get_topology_desc`` with ``description``), cached for ``name``."""
    chip_for(name)  # a clear error for unknown chips before libtpu is asked
    _allow_shared_libtpu()
    from jax.experimental import topologies

    description = {"platform": "tpu", "topology_name": name, **description}
    try:
        with _quiet_libtpu():  # libtpu reads its environment once, at its first topology
            _TOPOLOGIES[name] = topologies.get_topology_desc(**description)
    except Exception as e:  # libtpu raises JaxRuntimeError with its own wording
        raise ValueError(f"topology={name!r} is not a TPU topology libtpu knows ({e}); "
                         "use e.g. 'v5e:4x4', 'v5p:4x4x4', 'v6e:16x16'.") from None
    return _TOPOLOGIES[name]


def set_topology(name: str, **description):
    """Describes the TPU topology ``name`` to libtpu with ``description`` (``get_topology_desc``'s keywords:
    ``topology_name``, ``chip_config_name``, ``chips_per_host_bounds``, ``wrap``, ...) and makes it the one
    every later plan for ``name`` compiles for (``get_topology`` asks for the name alone), e.g. a pod
    described as another framework describes it.

    Args:
        name: the topology name plans use (e.g. ``"tpu7x:4x4x4"``).
        **description: ``jax.experimental.topologies.get_topology_desc`` keywords (``platform="tpu"`` and
            ``topology_name=name`` unless given).

    Returns:
        libtpu's topology description.

    Raises:
        ValueError: the chip is unknown, or libtpu does not take the description.
    """
    return _describe(name, **description)


def _layer_shape(model, *, batch, seq_len, **kw) -> LayerShape:
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    kw.setdefault("rope_theta", spec.rope_theta)
    return LayerShape(batch=batch, seq_len=seq_len, d_model=spec.d_model, num_heads=spec.num_heads,
                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, **kw)


def check_degrees(n_devices: int, shape: LayerShape, c: int, u: int, t: int) -> int:
    """Validates cp_colossal/cp_ulysses/tp against the devices and shapes; returns dp."""
    for name, v in (("cp_colossal", c), ("cp_ulysses", u), ("tp", t)):
        check_positive_int(name, v)
    if n_devices % (c * u * t):
        raise ValueError(
            f"cp_colossal*cp_ulysses*tp={c}*{u}*{t}={c * u * t} does not divide the topology's {n_devices} "
            f"devices; choose degrees whose product divides {n_devices}."
        )
    dp = n_devices // (c * u * t)
    if shape.batch % dp:
        raise ValueError(f"batch={shape.batch} is not divisible by dp={dp} (= {n_devices} devices / "
                         f"(cp_colossal*cp_ulysses*tp={c * u * t})); use a batch that is a multiple of {dp}.")
    if shape.seq_len % (c * u):
        raise ValueError(f"seq_len={shape.seq_len} is not divisible by cp_colossal*cp_ulysses={c * u}.")
    shape.attention.layout(MeshDims(dp=dp, c=c, u=u, t=t))  # heads and chunks against tp*cp_ulysses
    return dp


def _compile(build, label, shape, mesh, chip, budget, flags: tuple[str, ...]) -> Analysis:
    fn, args = build(shape, mesh)
    return _analyze_compiled(fn, args, label, mesh, chip, budget, flags)


def _analyze_compiled(fn, args, label, mesh, chip, budget, flags, donate_argnums=()) -> Analysis:
    """Compiles with ``flags`` as per-compile options; reads the schedule from the compiler's own dump."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jax_cp_plan_") as dump:
        options = compiler_options(flags) | {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        try:
            compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            raise _hbm_error(e, label, chip) from None
        elapsed = time.perf_counter() - t0
        text = _scheduled_text(compiled, dump)
    schedule = analyze_schedule(text, mesh_shape=tuple(mesh.shape.values()), axis_names=tuple(mesh.axis_names))
    return dataclasses.replace(analysis_of(label, compiled, schedule, chip, budget, elapsed, loop_bytes(text)),
                               kernel_calls=kernel_calls(text))


_SPLASH = r"splash_m[hq]a_(?:fwd|dq|dkv)"
_CUSTOM_CALL = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = [^\n]*custom-call\(", flags=re.M)
_NEXT_INSTRUCTION = re.compile(r"\n\s*(?:ROOT )?%[\w.-]+ = ")


def kernel_calls(hlo_text: str) -> tuple[tuple[str, int], ...]:
    """``((kernel, count), ...)`` of the splash attention kernels called in a scheduled HLO text
    (forward, dq and dK/dV; loop bodies count once).

    A call is named after its kernel (``%splash_mha_fwd.3 = ... custom-call(``), or, where the kernel
    was vmapped over a device's batch rows (a loop over them), ``%closed_call.N`` with the kernel in
    its ``op_name``."""
    names = []
    for m in _CUSTOM_CALL.finditer(hlo_text):
        own = re.match(_SPLASH, m.group(1))
        if own:
            names.append(own.group(0))
            continue
        end = _NEXT_INSTRUCTION.search(hlo_text, m.end())  # its attributes can span lines
        text = hlo_text[m.start():end.start() if end else len(hlo_text)]
        op_name = re.search(r'op_name="([^"]*)"', text)
        found = re.findall(_SPLASH, op_name.group(1)) if op_name and '"tpu_custom_call"' in text else []
        names += found[-1:]
    return tuple(sorted(collections.Counter(names).items()))


def _hbm_error(e: Exception, label: str, chip) -> Exception:
    """The TPU compiler's out-of-HBM refusal as a ValueError saying what to change; other errors unchanged."""
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg or "HBM" not in msg:
        return e
    why = next((line.split(": ", 2)[-1] for line in msg.splitlines() if "HBM" in line), msg)
    return ValueError(
        f"{label} does not fit one {chip.device_kind} device ({chip.device_hbm_bytes / 2**30:.0f} GiB HBM); the TPU "
        f"compiler says: {why.strip()} Spread it further (more tp / cp_colossal / cp_ulysses, FSDP), "
        "rematerialise, or plan a shorter sequence or a smaller batch."
    )


def analyze_program(fn, args, *, topology: str, mesh, label: str = "program", memory_budget: int | None = None,
                    xla_flags: tuple[str, ...] | None = None, donate_argnums: int | tuple[int, ...] = (),
                    layer: LayerShape | None = None) -> Analysis:
    """Compiles any ``fn(*args)`` for ``topology`` and analyzes it like the planner's layers.

    Use it for your own layer or training step.

    Args:
        fn: the function to compile.
        args: ``jax.ShapeDtypeStruct`` s sharded over ``mesh``.
        topology: the TPU topology name.
        mesh: a mesh of the topology's devices (``topology_mesh(topology, ...)``).
        label: the program's name in the analysis.
        memory_budget: bytes per device (default: the chip's HBM).
        xla_flags: ``--name=value`` strings passed to the compile.
        donate_argnums: as in ``jax.jit`` (a training step that donates its state: the memory
            peak then counts the state once, not as input and output).
        layer: when ``fn`` is one attention layer of this shape, its FLOPs are also counted from
            the shapes, as :func:`analyze` does (the compiler's count gives the splash kernels
            none, so without it the estimated step leaves them out).

    Returns:
        The :class:`Analysis`.
    """
    chip = chip_for(topology)
    budget = int(memory_budget or chip.device_hbm_bytes)
    shape, dims = (layer.resolved(mesh)[0], mesh_dims(mesh)) if layer is not None else (None, None)  # before compiling
    a = _analyze_compiled(fn, args, label, mesh, chip, budget, _flags_for(chip, xla_flags), donate_argnums)
    return a if shape is None else _with_shape_flops(a, shape, dims.c, dims.u, dims.t, dims.dp, chip)


def _scheduled_text(compiled, dump: str) -> str:
    """The optimized, scheduled module as the compiler dumped it; ``compiled.as_text()`` if none was dumped.

    The dump is read first because jaxlib 0.10.2 cannot read back some libtpu
    0.0.52 modules (v5p ``async-update`` ops fail its HLO proto check).
    """
    files = [f for f in glob.glob(os.path.join(dump, "*after_optimizations.txt")) if "jit_" in f]
    if files:
        with open(max(files, key=os.path.getmtime)) as f:
            return f.read()
    return compiled.as_text()


def topology_mesh(topology: str, *, cp_colossal: int = 1, cp_ulysses: int = 1, tp: int = 1, dp: int | None = None,
                  axis_types=AxisType.Explicit):
    """``jax_cp.make_mesh`` over the devices of a TPU ``topology`` (for ``analyze_program``).

    Explicit axes by default, as every planner figure was measured (``make_mesh`` defaults to Auto).

    Args:
        topology: the TPU topology name.
        cp_colossal, cp_ulysses, tp, dp: as ``jax_cp.make_mesh``.
        axis_types: as ``jax_cp.make_mesh``, but Explicit by default.

    Returns:
        The mesh.

    Raises:
        ValueError: degrees the torus cannot hold, naming them (JAX raises
            ``NotImplementedError`` deep in its mesh utilities).
    """
    devices = get_topology(topology).devices
    c, u, t = cp_colossal, cp_ulysses, tp
    try:
        return make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, dp=dp, devices=devices, axis_types=axis_types)
    except NotImplementedError as e:  # jax.make_mesh cannot lay these axes onto the torus
        raise ValueError(
            f"cp_colossal={c}, cp_ulysses={u}, tp={t} (dp={dp or len(devices) // (c * u * t)}) does not map onto "
            f"the {topology} torus ({e}); choose degrees that are products of its side lengths."
        ) from None


def _flags_for(chip, xla_flags) -> tuple[str, ...]:
    return recommended_xla_flags("tpu", chip=chip.name) if xla_flags is None else tuple(xla_flags)


def analyze_layout(topology: str, shape: LayerShape, c: int, u: int, t: int, *, memory_budget=None,
                   baseline: bool = True, xla_flags=None, load_balanced: bool = False) -> Report:
    """Compiles one layout (and the naive baseline) and returns the report."""
    topo = get_topology(topology)
    devices = topo.devices
    check_degrees(len(devices), shape, c, u, t)
    chip = chip_for(topology)
    budget = int(memory_budget or chip.device_hbm_bytes)
    flags = _flags_for(chip, xla_flags)
    mesh = topology_mesh(topology, cp_colossal=c, cp_ulysses=u, tp=t)
    shape, why = shape.resolved(mesh)  # the knobs CPAttention's "auto" picks on this chip and layout
    label = f"CPAttention ({c},{u},{t})"
    dp = len(devices) // (c * u * t)
    analysis = _with_shape_flops(_compile(cp_layer, label, shape, mesh, chip, budget, flags), shape, c, u, t, dp, chip,
                                 load_balanced)
    base = None
    if baseline:
        base = _with_shape_flops(_compile(naive_layer, "naive fused QKV", shape, mesh, chip, budget, flags),
                                 shape, c, u, t, dp, chip, load_balanced)
    return Report(topology=topology, chip=chip, mesh_shape=dict(mesh.shape), layer=shape, flags=" ".join(flags),
                  analysis=analysis, baseline=base, defaults=why.why if why else "",
                  rule_check=_rule_check(why, shape, analysis), verdict=_one_layout_verdict(analysis, base, shape))


def _rule_check(why, shape: LayerShape, a: Analysis) -> str:
    """This plan's overlap against the auto rule's measured figure, where the rule's grouping is what ran."""
    if why is None or why.measured_overlap is None:
        return ""
    ran = (shape.kv_exchange, shape.overlap_chunks, shape.fused_qkv_chunks)
    if ran != (why.kv_exchange.name, why.overlap_chunks, why.fused_qkv_chunks):  # an explicit knob changed it
        return ""
    return rule_check(why.measured_overlap, (a.overlap("fwd"), a.overlap("bwd")))


def _one_layout_verdict(a: Analysis, base: Analysis | None, shape: LayerShape) -> str:
    """A one-layout plan's verdict: the layout against the naive placement of the same layout (one fused
    QKV projection, one chunk), by the same rule as between layouts, and what to try next."""
    others = "; the only layout planned: to choose one, --compare C,U,T C,U,T ... (plan.compare) or --strategy auto"
    if base is None:
        return verdict([option_of(a)]).line + others
    v = verdict([option_of(a), option_of(base, "the naive placement")])
    if v.pick is None or v.pick.label == a.label:
        return v.line + others
    chunked = shape.overlap_chunks > 1 or shape.fused_qkv_chunks > 0
    return (f"verdict: {a.label}'s grouping (kv_exchange={shape.kv_exchange}, overlap_chunks={shape.overlap_chunks}, "
            f"fused_qkv_chunks={shape.fused_qkv_chunks}) does not beat the naive placement here, whose {v.why}: "
            + ("plan one chunk (--overlap-chunks 1 --fused-qkv-chunks 0) or let --strategy auto compile the "
               "groupings" if chunked else "let --strategy auto compile other layouts and groupings"))


def _with_shape_flops(a: Analysis, shape: LayerShape, c: int, u: int, t: int, dp: int, chip,
                      load_balanced: bool = False) -> Analysis:
    model, executed = _auto.layer_flops(shape, c, u, t, dp, splash=bool(a.kernel_calls), balanced=load_balanced)
    return a.with_shape_flops(model, executed, chip)


def analyze(
    *, topology: str, model: str | ModelSpec = "llama3-8b", seq_len: int, batch: int = 1,
    strategy: str = "manual", cp_colossal: int = 1, cp_ulysses: int = 1, tp: int = 1,
    kv_exchange: str | exchanges.KVExchange = "auto", overlap_chunks: int | str = "auto",
    fused_qkv_chunks: int | str = "auto",
    kernel: str = "auto", is_causal: bool = True,
    dtype: str = "bfloat16", param_dtype: str = "float32", memory_budget: int | None = None,
    baseline: bool = True, candidates: int = 2, xla_flags: tuple[str, ...] | None = None,
    load_balanced: bool = False,
) -> Report:
    """Plans one attention layer of ``model`` on ``topology`` and reports memory, collectives and overlap.

    Args:
        topology: the TPU topology name (e.g. ``"v5e:4x4"``).
        model: a model name (``MODELS``) or a :class:`ModelSpec`.
        seq_len, batch: the input's size.
        strategy: ``"manual"`` compiles the given ``cp_colossal × cp_ulysses × tp`` (``dp``
            takes the remaining devices); ``"auto"`` chooses the degrees, the K/V exchange,
            ``overlap_chunks`` and ``fused_qkv_chunks`` itself (the given ones are ignored):
            see ``Report.reasons``.
        cp_colossal, cp_ulysses, tp: the degrees (``"manual"``).
        kv_exchange, overlap_chunks, fused_qkv_chunks: as ``CPAttention``.
        kernel: defaults to ``"auto"``, what ``CPAttention`` runs on the chip (splash on TPU
            unless a window rules it out); the report names the kernel found in the scheduled
            program.
        is_causal, dtype, param_dtype: the layer's mask and dtypes.
        memory_budget: bytes per device (default: the chip's HBM).
        baseline: also compile the naive fused-QKV layer for comparison.
        candidates: how many layouts ``"auto"`` compiles.
        xla_flags: ``"--name=value"`` strings passed to each compile; ``None`` means
            ``recommended_xla_flags("tpu", chip=...)`` for the chip.
        load_balanced: count a causal layer's work as ``jax_cp.load_balance`` spreads it (the
            compiled program is the same; only the busiest device's FLOPs change).

    Returns:
        The :class:`Report`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}.")
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(f"memory_budget={memory_budget} must be a positive number of bytes.")
    shape = _layer_shape(model, batch=batch, seq_len=seq_len, kv_exchange=kv_exchange, kernel=kernel,
                         overlap_chunks=overlap_chunks, fused_qkv_chunks=fused_qkv_chunks, is_causal=is_causal,
                         dtype=dtype, param_dtype=param_dtype)
    if strategy == "manual":
        return analyze_layout(topology, shape, cp_colossal, cp_ulysses, tp, memory_budget=memory_budget,
                              baseline=baseline, xla_flags=xla_flags, load_balanced=load_balanced)
    return choose(topology, shape, memory_budget=memory_budget, baseline=baseline, candidates=candidates,
                  xla_flags=xla_flags, load_balanced=load_balanced)


def choose(topology: str, shape: LayerShape, *, memory_budget=None, baseline=True, candidates=2,
           xla_flags=None, load_balanced: bool = False) -> Report:
    """``strategy="auto"``: rank layouts in closed form, compile the best ``candidates``, keep the fastest that fits.

    Each shortlisted layout is compiled with ``overlap_chunks`` 1 and 2 (where
    the heads allow) and, where there is a Ulysses exchange to fuse, with 2
    chunks both fused and with 4 chunks the first fused
    (``fused_qkv_chunks``): only the compiled schedule shows what chunking
    and fusing buy.
    When none fits the budget, up to ``2 * candidates`` more layouts are tried.
    """
    check_positive_int("candidates", candidates)
    chip = chip_for(topology)
    n = len(get_topology(topology).devices)
    budget = int(memory_budget or chip.device_hbm_bytes)
    pool, rejected = _auto.candidates(n, shape, kv_exchanges())
    if not pool:
        raise ValueError(f"no layout of {n} devices fits the shapes: " + "; ".join(rejected))
    ranked = sorted(pool, key=lambda k: _auto.closed_form_seconds(k, shape, chip))
    layouts = []
    for k in ranked:
        key = (k.c, k.u, k.t, k.kv_exchange)
        if key not in layouts:
            layouts.append(key)
    reasons = [f"{len(pool)} valid layouts of {n} devices ({len(rejected)} degree triples rejected by divisibility)."]
    reasons.append("closed-form ranking (FLOPs/peak + wire bytes/ICI, no overlap): " + ", ".join(
        f"({c},{u},{t}) {ex}" for c, u, t, ex in layouts[:candidates + 2]) + " ...")
    tried = []
    for n_layouts, (c, u, t, ex) in enumerate(layouts):  # the best `candidates`; more only while none fits
        if n_layouts >= candidates and any(r.analysis.memory.fits for r, _ in tried):
            break
        if n_layouts >= 3 * candidates:
            break
        for chunks, fused in ((1, 0), (2, 0)) + (((2, 2), (4, 1)) if u > 1 and exchanges.resolve(ex).fuses_qkv else ()):
            s = dataclasses.replace(shape, kv_exchange=ex, overlap_chunks=chunks, fused_qkv_chunks=fused)
            if shape.num_heads % (t * u * chunks):
                continue
            try:
                r = analyze_layout(topology, s, c, u, t, memory_budget=budget, baseline=False, xla_flags=xla_flags,
                                   load_balanced=load_balanced)
            except ValueError as e:
                reasons.append(f"skipped ({c},{u},{t}) {ex}: {e}")
                break
            tried.append((r, s))
    for r, s in tried:
        a = r.analysis
        fused = f" fused={s.fused_qkv_chunks}" if s.fused_qkv_chunks else ""
        reasons.append(
            f"compiled ({r.mesh_shape['cp_colossal']},{r.mesh_shape['cp_ulysses']},{r.mesh_shape['tp']}) "
            f"{s.kv_exchange} chunks={s.overlap_chunks}{fused}: est. {a.estimate.step_s * 1e3:.3f} ms, "
            f"memory {a.memory.total / 2**30:.2f} GiB {'fits' if a.memory.fits else 'does NOT fit'}, "
            f"overlap fwd {_fmt(a.overlap('fwd'))} bwd {_fmt(a.overlap('bwd'))}"
        )
    fitting = [(r, s) for r, s in tried if r.analysis.memory.fits]
    if not fitting:
        raise ValueError(f"no compiled layout fits memory_budget={budget} bytes per device; "
                         "use more devices, a shorter seq_len or a smaller batch.")
    v = verdict([option_of(r.analysis, _grouping(r, s)) for r, s in tried])
    best, s = next((r, s) for r, s in tried if _grouping(r, s) == v.pick.label)
    m = best.mesh_shape
    reasons.append(
        f"chosen: cp_colossal={m['cp_colossal']} cp_ulysses={m['cp_ulysses']} tp={m['tp']} dp={m['dp']} "
        f"kv_exchange={s.kv_exchange} overlap_chunks={s.overlap_chunks} fused_qkv_chunks={s.fused_qkv_chunks}: "
        f"est. {best.analysis.estimate.step_s * 1e3:.3f} ms; among compiled layouts that fit "
        f"{budget / 2**30:.2f} GiB the lowest estimated step wins, estimates within {TIE * 100:.0f} % tie and go to "
        f"the least memory, then the fewest CP bytes (here: {_DECIDED[v.decided_by]}; the verdict below)."
    )
    base = None
    if baseline:
        mesh = topology_mesh(topology, cp_colossal=m["cp_colossal"], cp_ulysses=m["cp_ulysses"], tp=m["tp"])
        base = _with_shape_flops(_compile(naive_layer, "naive fused QKV", s, mesh, chip, budget,
                                          _flags_for(chip, xla_flags)),
                                 s, m["cp_colossal"], m["cp_ulysses"], m["tp"], m["dp"], chip, load_balanced)
    if base is not None and base.estimate.step_s < best.analysis.estimate.step_s:
        reasons.append(_baseline_wins(best.analysis, base))
    return dataclasses.replace(best, baseline=base, reasons=tuple(reasons), verdict=v.line)


_DECIDED = {"time": "the lowest estimate", "memory": "a tie in time, the least memory",
            "CP bytes": "a tie in time and memory, the fewest CP bytes", "fits": "the only one that fits",
            "single": "the only one compiled"}


def _grouping(r: Report, s: LayerShape) -> str:
    """A compiled candidate's name in the verdict: layout, exchange, chunks."""
    m = r.mesh_shape
    fused = f" fused={s.fused_qkv_chunks}" if s.fused_qkv_chunks else ""
    return (f"({m['cp_colossal']},{m['cp_ulysses']},{m['tp']}) {s.kv_exchange} "
            f"overlap_chunks={s.overlap_chunks}{fused}")


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"4,1,4"`` -> ``(4, 1, 4)``: cp_colossal, cp_ulysses, tp (the command line's ``--compare``).

    Args:
        text: three comma-separated integers.

    Returns:
        ``(cp_colossal, cp_ulysses, tp)``.

    Raises:
        ValueError: ``text`` is not three integers.
    """
    try:
        layout = tuple(int(x) for x in text.split(","))
    except ValueError:
        layout = ()
    if len(layout) != 3:
        raise ValueError(f"layout={text!r} must be three integers C,U,T (cp_colossal,cp_ulysses,tp), e.g. 4,1,4.")
    return layout


def compare(*, topology: str, layouts, batch: int | None = None, **kwargs) -> Comparison:
    """Plans each ``(cp_colossal, cp_ulysses, tp)`` of ``layouts`` like ``analyze`` and says which to run.

    Every layout compiles the same layer, without the naive baseline.

    Args:
        topology: the TPU topology name.
        layouts: ``(cp_colossal, cp_ulysses, tp)`` tuples.
        batch: the global batch of every layout (default: the least common multiple of the
            layouts' dp, so each replica holds whole sequences).
        **kwargs: as for ``analyze`` (``model``, ``seq_len``, knobs, flags, ``memory_budget``).

    Returns:
        The :class:`Comparison`; its last line is the verdict (``plan._verdict.verdict``): the
        lowest estimated step, near-ties (within 2 %) to the least peak memory, then the fewest
        CP bytes.
    """
    layouts = [parse_layout(x) if isinstance(x, str) else tuple(x) for x in layouts]
    if not layouts:
        raise ValueError("layouts is empty; give at least one (cp_colossal, cp_ulysses, tp), e.g. [(4, 1, 4)].")
    if any(len(x) != 3 for x in layouts):
        raise ValueError(f"layouts={layouts} must be (cp_colossal, cp_ulysses, tp) triples.")
    for key in ("strategy", "cp_colossal", "cp_ulysses", "tp", "baseline"):
        if key in kwargs:
            raise ValueError(f"{key}= is set by compare itself (each layout, manual, no baseline); leave it out.")
    if batch is None:
        n = len(get_topology(topology).devices)
        batch = math.lcm(*(max(n // (c * u * t), 1) for c, u, t in layouts))
    reports = tuple(analyze(topology=topology, batch=batch, strategy="manual", cp_colossal=c, cp_ulysses=u, tp=t,
                            baseline=False, **kwargs) for c, u, t in layouts)
    return Comparison(reports=reports, verdict=verdict([option_of(r.analysis) for r in reports]))


def _baseline_wins(a: Analysis, base: Analysis) -> str:
    """Why the naive baseline's estimate beats the chosen layout's, term by term (never silently)."""
    ea, eb = a.estimate, base.estimate
    terms = [(name, getattr(ea, f) - getattr(eb, f)) for name, f in (
        ("compute", "compute_s"), ("HBM traffic", "memory_s"), ("exposed communication", "exposed_comm_s"))]
    worst = max(terms, key=lambda x: x[1])
    return (f"note: the naive baseline's estimate ({eb.step_s * 1e3:.3f} ms) beats the chosen layout's "
            f"({ea.step_s * 1e3:.3f} ms); the largest difference is {worst[0]} (+{worst[1] * 1e3:.3f} ms: "
            + ", ".join(f"{n} {d * 1e3:+.3f} ms" for n, d in terms)
            + "). Estimates only: the chunked layer's extra HBM traffic is real, its overlap shows in the "
              "overlap rows.")


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"
