"""Reads a compiled module's scheduled HLO text: collectives, their mesh axes, and overlap.

The text of ``compiled.as_text()`` lists each non-fusion computation's
instructions in schedule order. A collective is *overlapped* when compute (a
convolution/dot, directly or inside a fusion, or a kernel custom-call) is
scheduled between its start and its done. Async forms recognised:

* ``all-to-all-start``/``-done`` (and ``all-gather-``, ``all-reduce-``,
  ``collective-permute-``, ``reduce-scatter-``, ``ragged-all-to-all-start``/``-done``);
* ``async-start``/``async-update``/``async-done`` wrapping a collective (offloaded to the
  SparseCores, the start takes no data and the update that brings the operand in is where the
  transfer can begin: compute counts as inside from there);
* TPU async collective fusion: a ``fusion`` whose computation holds an
  ``AsyncCollectiveStart`` custom-call, continued by fusions whose computations
  hold the collective (and usually a convolution), ended by one holding
  ``AsyncCollectiveDone``.

Replica groups are read in each form XLA prints: explicit lists
(``{{0,2},{1,3}}``), iota (``[4,2]<=[2,2,2]T(0,2,1)``) and named mesh axes
(``mesh['dp'=1,'cp'=4] {'cp'}``, the modules jax 0.12 compiles); devices are the
mesh's logical ids in all three.

A collective in a scheduled computation (or a plain fusion) is synchronous.
Backward collectives are those JAX named under ``transpose(...)`` in the op
metadata (for ops the compiler created without metadata: those fed by such
ops); the rest are forward.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Sequence

import numpy as np

from jax_cp.plan._hlo_text import Instr, _balanced, array_bytes, parse_module, tuple_element

__all__ = ["Instr", "Collective", "Schedule", "Timeline", "timeline", "parse_module", "analyze_schedule", "instr_flops", "loop_bytes",
           "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute", "ragged-all-to-all")
PHASES = ("fwd", "bwd")

_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# Named-mesh replica groups: mesh[<axes>][, device_ids=(<ids>)] {<group axes>}.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:\s*,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"('[^']*'|\"[^\"]*\"|[\w.\-]+)\s*=\s*(\d+)")
_GROUP_AXIS = re.compile(r"('[^']*'|\"[^\"]*\"|[\w.\-]+)(?:\s*:\s*\((\d+)\)(\d+))?")
_IOTA_SPEC = re.compile(r"<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_KERNEL_TARGETS = re.compile(r"tpu_custom_call|mosaic|gemm|cublas|cudnn|triton", re.I)
_COMPUTE_OPS = ("convolution", "dot", "ragged-dot")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective of the schedule, per device.

    Attributes:
        name: the instruction's name.
        kind: one of ``COLLECTIVE_KINDS``.
        axes: the mesh axes it runs over.
        group_size: devices per replica group.
        bytes: the larger of its input and output buffers.
        phase: ``"fwd"`` or ``"bwd"``.
        is_async: whether it is a start/done pair.
        compute_inside: compute ops scheduled between start and done.
        op_name: the JAX op it came from.
        feeds_compute: some matmul/kernel consumes its result (directly or not).
        in_loop: scheduled in a loop body: bytes are per iteration.
        iterations: how often it runs: the trip counts of the loops around it (1 when not readable).
        flops_inside: FLOPs of the matmuls between start and done; ``None``: a kernel is among them.
        bytes_inside: HBM bytes the ops between start and done read and write (``instr_bytes``; loop
            bodies once per trip; other async starts, which move data on their own engines, left out).
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    group_size: int
    bytes: int  # the larger of its input and output buffers
    phase: str  # "fwd" | "bwd"
    is_async: bool
    compute_inside: tuple[str, ...]  # compute ops scheduled between start and done
    op_name: str = ""
    feeds_compute: bool = True  # some matmul/kernel consumes its result (directly or not)
    in_loop: bool = False  # scheduled in a loop body: bytes are per iteration
    iterations: int = 1  # how often it runs: the trip counts of the loops around it (1 when not readable)
    flops_inside: float | None = 0.0  # FLOPs of the matmuls between start and done; None: a kernel is among them
    bytes_inside: float = 0.0  # HBM bytes of the ops between start and done (loop bodies per trip)

    def __post_init__(self):
        if self.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {COLLECTIVE_KINDS}.")
        if self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r} must be one of {PHASES}.")

    @property
    def overlapped(self) -> bool:
        return self.is_async and bool(self.compute_inside)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends (ring/bucket algorithms): the basis of time estimates."""
        n = max(self.group_size, 1)
        frac = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * self.bytes * frac
        if self.kind in ("collective-permute", "ragged-all-to-all"):  # ragged: its buffers, an upper bound
            return float(self.bytes)
        return self.bytes * frac


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """Every collective of a compiled module, in schedule order.

    Attributes:
        collectives: the collectives (:class:`Collective`), in schedule order.
        cp_axes: the context-parallel mesh axes.
    """

    collectives: tuple[Collective, ...]
    cp_axes: tuple[str, ...] = ("cp_colossal", "cp_ulysses")

    def is_cp(self, c: Collective) -> bool:
        """A context-parallel exchange: over CP mesh axes only, and feeding further compute.

        Excluded: collectives whose result no matmul consumes - the gradient sum
        of parameters replicated over the CP axes, which a training step
        reduces once per step, under the next layer's backward.
        """
        return bool(c.axes) and set(c.axes) <= set(self.cp_axes) and c.feeds_compute

    def select(self, phase: str | None = None, *, cp_only: bool = True) -> tuple[Collective, ...]:
        return tuple(
            c for c in self.collectives
            if (phase is None or c.phase == phase) and (not cp_only or self.is_cp(c))
        )

    def overlap_fraction(self, phase: str | None = None, *, cp_only: bool = True) -> float | None:
        """Overlapped bytes / all bytes of the selected collectives, each counted as often as it runs
        (a loop body's once per trip; ``None`` when there are none)."""
        sel = self.select(phase, cp_only=cp_only)
        total = sum(c.bytes * c.iterations for c in sel)
        if total == 0:
            return None
        return sum(c.bytes * c.iterations for c in sel if c.overlapped) / total

    def kinds(self, *, cp_only: bool = True) -> set[str]:
        return {c.kind for c in self.select(cp_only=cp_only)}

    def time_covered(self, phase: str | None = None, *, flops_per_s: float, bytes_per_s: float,
                     hbm_bytes_per_s: float | None = None, cp_only: bool = True) -> float | None:
        """Share of the selected collectives' estimated transfer time (wire bytes / ``bytes_per_s``)
        that the compute scheduled inside them covers. The ops inside take at least
        ``max(FLOPs / flops_per_s, HBM bytes / hbm_bytes_per_s)`` (their roofline; the FLOPs alone
        where ``hbm_bytes_per_s`` is ``None``); a Pallas kernel inside, whose FLOPs the HLO does not
        state, counts as covering all. Only overlapped collectives (a matmul inside) are covered.
        ``None``: no transfer."""
        sel = [c for c in self.select(phase, cp_only=cp_only) if c.wire_bytes > 0]
        total = sum(c.wire_bytes * c.iterations / bytes_per_s for c in sel)
        if not total:
            return None
        covered = 0.0
        for c in sel:
            t = c.wire_bytes * c.iterations / bytes_per_s
            if not c.overlapped:
                continue
            if c.flops_inside is None:
                covered += t
                continue
            inside = c.flops_inside / flops_per_s
            if hbm_bytes_per_s:
                inside = max(inside, c.bytes_inside / hbm_bytes_per_s)
            covered += min(t, inside * c.iterations)
        return min(1.0, covered / total)  # summed in another order than total: may round above 1


class _Module:
    def __init__(self, text: str):
        self.comps, self.entry = parse_module(text)
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}
        self._has: dict[tuple[str, str], bool] = {}
        self._iterations: dict[str, int] | None = None

    def contains(self, comp: str, what: str) -> bool:
        """Does ``comp`` (or anything it calls) hold ``what`` ("compute", a collective kind, a target)?"""
        key = (comp, what)
        if key not in self._has:
            self._has[key] = False  # recursion guard
            self._has[key] = any(self._instr_is(i, what) for i in self.comps.get(comp, ()))
        return self._has[key]

    def _instr_is(self, i: Instr, what: str) -> bool:
        if what == "compute":
            if i.opcode in _COMPUTE_OPS or (i.opcode == "custom-call" and _KERNEL_TARGETS.search(i.target)):
                return True
        elif what in COLLECTIVE_KINDS:
            if i.opcode in (what, what + "-start"):
                return True
        elif i.opcode == "custom-call" and i.target == what:
            return True
        return any(self.contains(c, what) for c in i.called)

    def inner_collective(self, comp: str) -> tuple[Instr, str] | None:
        for i in self.comps.get(comp, ()):
            if i.opcode in COLLECTIVE_KINDS or i.opcode.removesuffix("-start") in COLLECTIVE_KINDS:
                return i, comp
            for c in i.called:
                found = self.inner_collective(c)
                if found:
                    return found
        return None

    def iterations(self) -> dict[str, int]:
        """``{computation: runs}`` for while-loop bodies: the product of the trip counts of the
        loops around it, each read from its condition (``counter < constant``, counter starting
        at a constant; ``fori_loop``'s form). Bodies whose count is not readable run once.
        Read once per module (``instr_flops`` asks for it per loop)."""
        if self._iterations is None:
            self._iterations = self._read_iterations()
        return self._iterations

    def _read_iterations(self) -> dict[str, int]:
        trips, parent = {}, {}
        for comp, instrs in self.comps.items():
            for i in instrs:
                if i.opcode != "while":
                    continue
                body = re.search(r"body=%?([\w.\-]+)", i.attrs)
                cond = re.search(r"condition=%?([\w.\-]+)", i.attrs)
                if body:
                    parent[body.group(1)] = comp
                    trips[body.group(1)] = self._trip_count(cond.group(1) if cond else "", comp, i)
        runs: dict[str, int] = {}

        def total(comp: str, depth: int = 0) -> int:
            if comp not in trips or depth > 16:
                return 1
            if comp not in runs:
                runs[comp] = (trips[comp] or 1) * total(parent[comp], depth + 1)
            return runs[comp]

        return {body: total(body) for body in trips}

    def _trip_count(self, cond: str, comp: str, loop: Instr) -> int | None:
        names = self.by_name.get(cond, {})
        root = next((i for i in reversed(self.comps.get(cond, ())) if i.opcode == "compare"), None)
        if root is None or "direction=LT" not in root.attrs or len(root.operands) != 2:
            return None
        counter, bound = (names.get(o) for o in root.operands)
        if counter is None or bound is None or bound.opcode != "constant":
            return None
        if counter.opcode == "get-tuple-element":  # jax 0.10's modules
            index = re.search(r"index=(\d+)", counter.attrs)
            k = int(index.group(1)) if index else 0
        elif counter.opcode == "parameter" and "#" in (root.refs[0] if root.refs else ""):  # jax 0.12's: param#k
            k = int(root.refs[0].rsplit("#", 1)[1])
        else:
            return None
        try:
            n = int(bound.operands[0])
        except (IndexError, ValueError):
            return None
        start = self._tuple_element_constant(comp, loop.operands[0] if loop.operands else "", k)
        return max(n - (start or 0), 0)

    def _tuple_element_constant(self, comp: str, name: str, k: int) -> int | None:
        i = self.by_name.get(comp, {}).get(name)
        if i is None or i.opcode != "tuple" or k >= len(i.operands):
            return None
        e = self.by_name[comp].get(i.operands[k])
        try:
            return int(e.operands[0]) if e is not None and e.opcode == "constant" else None
        except (IndexError, ValueError):
            return None

    def scheduled(self) -> list[str]:
        """Computations with their own schedule: everything not a fusion/async/reducer body."""
        inner = set()
        for instrs in self.comps.values():
            for i in instrs:
                if i.opcode in ("fusion", "async-start", "async-update", "async-done", "custom-call") or "to_apply=" in i.attrs:
                    inner.update(i.called)
        return [c for c in self.comps if c not in inner]


def _kind(opcode: str) -> str:
    return opcode.removesuffix("-start").removesuffix("-done")


def _iota(dims: Sequence[int], reshape: str, perm: str | None) -> np.ndarray:
    """``[dims]<=[reshape]T(perm)``: iota over ``reshape``, transposed by ``perm``, reshaped to ``dims``."""
    shape = [int(x) for x in reshape.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(x) for x in perm.split(",")])
    return ids.reshape(dims)


def _mesh_device_ids(spec: str, sizes: list[int]) -> np.ndarray | None:
    """The device at each mesh coordinate: iota unless ``device_ids=(...)`` says otherwise."""
    if not spec:
        return np.arange(math.prod(sizes)).reshape(sizes)
    m = _IOTA_SPEC.search(spec)
    if m:
        return _iota(sizes, m.group(1), m.group(2))
    ids = [int(x) for x in re.findall(r"\d+", re.sub(r"^\s*\[[0-9,\s]*\]", "", spec))]
    return np.array(ids).reshape(sizes) if len(ids) == math.prod(sizes) else None


def _mesh_groups(attrs: str) -> list[list[int]] | None:
    """``replica_groups=mesh['a'=2,'b'=4] {'b'}`` (XLA's named-mesh form, as jax 0.12 compiles) -> device groups.

    Devices at mesh coordinates that agree on every axis outside the braces
    form one group. A sub-axis ``'b':(p)k`` is the size-``k`` factor of axis
    ``b`` below its major size-``p`` factor. ``None`` when ``attrs`` has no
    mesh form (or one this reader cannot follow).
    """
    m = _MESH_GROUPS.search(attrs)
    if not m:
        return None
    mesh_axes = [(name.strip("'\""), int(size)) for name, size in _MESH_AXIS.findall(m.group(1))]
    if not mesh_axes:
        return None
    names, sizes = [a for a, _ in mesh_axes], [s for _, s in mesh_axes]
    ids = _mesh_device_ids(m.group(2) or "", sizes)
    if ids is None:
        return None
    refs = []  # (mesh axis index, pre-size, size)
    for name, pre, size in _GROUP_AXIS.findall(m.group(3)):
        name = name.strip("'\"")
        if name not in names:
            return None
        a = names.index(name)
        refs.append((a, int(pre), int(size)) if size else (a, 1, sizes[a]))
    # Split each mesh axis at every sub-axis boundary (a boundary: the product of the sizes above it).
    factors, grouped = [], []
    for a, n in enumerate(sizes):
        cuts = sorted({1, n} | {x for r in refs if r[0] == a for x in (r[1], r[1] * r[2])})
        if any(n % c for c in cuts):
            return None
        for lo, hi in zip(cuts, cuts[1:]):  # major to minor
            grouped.append(any(r[0] == a and r[1] <= lo and hi <= r[1] * r[2] for r in refs))
            factors.append(hi // lo)
    ids = ids.reshape(factors)
    keep = [d for d, g in enumerate(grouped) if not g]
    inner = [d for d, g in enumerate(grouped) if g]
    group_size = math.prod(factors[d] for d in inner)
    return ids.transpose(keep + inner).reshape(-1, group_size).tolist()


def _groups(attrs: str) -> list[list[int]]:
    mesh = _mesh_groups(attrs)
    if mesh is not None:
        return mesh
    m = _IOTA_GROUPS.search(attrs)
    if m:
        return _iota([int(x) for x in m.group(1).split(",")], m.group(2), m.group(3)).tolist()
    for key in ("replica_groups=", "source_target_pairs="):
        pos = attrs.find(key + "{")
        if pos >= 0:
            start = pos + len(key)
            body = attrs[start + 1 : _balanced(attrs, start) - 1]
            return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9,\s]*)\}", body)]
    return []


def _axes(groups: list[list[int]], mesh_shape: Sequence[int], axis_names: Sequence[str]) -> tuple[str, ...]:
    n = math.prod(mesh_shape)
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(i % n, tuple(mesh_shape)) for i in g]).reshape(len(g), -1)
        varying.update(a for a in range(len(mesh_shape)) if len(set(coords[:, a])) > 1)
    return tuple(axis_names[a] for a in sorted(varying))


def _operand_shape(table: dict[str, Instr], ref: str) -> str:
    """The shape of an operand as written: ``name``, or ``name#k`` (element ``k`` of a tuple)."""
    name, _, index = ref.partition("#")
    if name not in table:
        return ""
    return tuple_element(table[name].shape, int(index)) if index.isdigit() else table[name].shape


def _phase(op_name: str) -> str:
    return "bwd" if "transpose(" in op_name else "fwd"


def _feeds_compute(instrs: list[Instr], is_compute: list[bool], *, loop_body: bool = False) -> dict[str, bool]:
    """For every instruction: does any compute op (transitively) consume its value?

    In a loop body with compute, what reaches the root is carried into the next iteration (or
    out of the loop): the ring's transfers, consumed by the next step's kernel, count as feeding it."""
    pos = {i.name: k for k, i in enumerate(instrs)}
    feeds = [False] * len(instrs)
    if loop_body and instrs and any(is_compute):
        feeds[-1] = True  # the root: scheduled last
    for k in range(len(instrs) - 1, -1, -1):  # users come later in a schedule
        for o in instrs[k].operands:
            if o in pos and (is_compute[k] or feeds[k]):
                feeds[pos[o]] = True
    return {i.name: f for i, f in zip(instrs, feeds)}


# JAX primitives whose transposes inside a shard_map keep the forward's op_name: pvary's (a psum),
# psum_scatter's (an all-gather) and all_gather's (a reduce-scatter).
_TRANSPOSED_IN_SHARD_MAP = re.compile(r"/(psum_invariant|all_gather|reduce_scatter)$")


def _data_entry(start: Instr, instrs: list[Instr]) -> Instr:
    """The instruction that hands an async collective its data: the start, or (offloaded to the SparseCores,
    ``async-start()`` takes none) the async-update that brings the operand in."""
    if start.operands:
        return start
    return next((u for u in instrs if u.opcode == "async-update" and start.name in u.operands), start)


def _phase_from_producers(names: dict[str, Instr], start: Instr, depth: int = 6) -> str:
    """For ops without metadata: backward if any producer within ``depth`` steps is."""
    frontier, seen = list(start.operands), set()
    for _ in range(depth):
        nxt = []
        for o in frontier:
            if o in seen or o not in names:
                continue
            seen.add(o)
            if "transpose(" in names[o].op_name:
                return "bwd"
            nxt += names[o].operands
        frontier = nxt
    return "fwd"


def analyze_schedule(
    text: str, *, mesh_shape: Sequence[int], axis_names: Sequence[str],
    cp_axes: Iterable[str] = ("cp_colossal", "cp_ulysses"),
) -> Schedule:
    """Finds every collective in ``text`` (scheduled HLO), its mesh axes, bytes, phase and overlap.

    Args:
        text: the scheduled HLO text.
        mesh_shape, axis_names: the mesh the module was compiled for; logical device ``i`` sits
            at ``np.unravel_index(i, mesh_shape)``.
        cp_axes: the context-parallel axes.

    Returns:
        The :class:`Schedule`.
    """
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"mesh_shape={tuple(mesh_shape)} and axis_names={tuple(axis_names)} differ in length.")
    mod = _Module(text)
    runs = mod.iterations()
    out: list[Collective] = []
    for comp in mod.scheduled():
        found = _collectives_of(mod, comp, mesh_shape, axis_names)
        out += found if comp == mod.entry else [
            dataclasses.replace(c, in_loop=True, iterations=runs.get(comp, 1)) for c in found]
    return Schedule(collectives=tuple(out), cp_axes=tuple(cp_axes))


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The entry computation of a scheduled module as numbered steps (matmul fusions, and collective
    starts/dones), for drawing what runs beside what.

    Attributes:
      compute: ``(step, is_backward)`` of every step that computes (a matmul, or a fusion holding one,
        async collective fusions included).
      spans: ``(collective, start_step, done_step)`` of every collective of ``schedule`` in the entry
        computation, by start (a synchronous one starts and ends at one step).
      schedule: ``analyze_schedule``'s result for the same text.
      steps: the number of steps.
    """

    compute: tuple
    spans: tuple
    schedule: Schedule
    steps: int


def timeline(text: str, *, mesh_shape: Sequence[int], axis_names: Sequence[str]) -> Timeline:
    """``text`` (scheduled HLO) as a ``Timeline``: the steps of its entry computation in compiled order.

    Args:
        text: the scheduled HLO text.
        mesh_shape, axis_names: the mesh the module was compiled for, as :func:`analyze_schedule`.

    Returns:
        The :class:`Timeline`.
    """
    mod = _Module(text)
    schedule = analyze_schedule(text, mesh_shape=mesh_shape, axis_names=axis_names)
    by_start = {col.name: col for col in schedule.collectives}
    steps, compute, spans, open_, carried = 0, [], [], {}, {}
    for i in mod.comps[mod.entry]:
        role = _classify(mod, i)
        inner = set().union(*(carried.get(o, set()) for o in i.operands))
        # A matmul may sit in its own fusion or inside an async collective fusion (TPU fuses the
        # projection matmul with the steps of an all-gather); either way it is compute at this step.
        has_compute = i.opcode in ("convolution", "dot") or (
            i.opcode in ("fusion", "call", "while", "conditional") and any(mod.contains(c, "compute") for c in i.called))
        if role == "start" and i.name in by_start:
            open_[i.name] = steps
            carried[i.name] = {i.name}
        elif role == "pass" and inner:
            carried[i.name] = inner
            if not has_compute:
                continue
        elif role == "done" and inner:
            spans += [(by_start[s], open_.pop(s), steps) for s in inner if s in open_]
        elif role == "sync" and i.name in by_start:
            spans.append((by_start[i.name], steps, steps))
        elif not has_compute:
            continue
        if has_compute:
            compute.append((steps, "transpose(" in i.op_name))
        steps += 1
    return Timeline(tuple(compute), tuple(sorted(spans, key=lambda s: s[1])), schedule, steps)


def _classify(mod: _Module, i: Instr) -> str:
    """'start', 'done', 'pass' (carries an in-flight collective), 'sync', or ''."""
    op = i.opcode
    if op.endswith("-start") and _kind(op) in COLLECTIVE_KINDS:
        return "start"
    if op.endswith("-done") and _kind(op) in COLLECTIVE_KINDS:
        return "done"
    if op in COLLECTIVE_KINDS:
        return "sync"
    if op == "async-start":
        return "start" if any(mod.inner_collective(c) for c in i.called) else ""
    if op == "async-done":
        return "done"
    if op in ("async-update", "get-tuple-element", "tuple", "bitcast"):
        return "pass"
    if op == "fusion":
        comp = i.called[0] if i.called else ""
        if mod.contains(comp, "AsyncCollectiveStart"):
            return "start"
        if mod.contains(comp, "AsyncCollectiveDone"):
            return "done"
        if mod.inner_collective(comp):
            return "pass" if "async_collective_fusion" in comp else "sync"
    return ""


def _collectives_of(mod, comp, mesh_shape, axis_names) -> list[Collective]:
    instrs = mod.comps[comp]
    names = mod.by_name[comp]
    chains: dict[str, set[str]] = {}  # instruction -> in-flight starts it carries
    open_at: dict[str, int] = {}
    done_at: dict[str, int] = {}
    for pos, i in enumerate(instrs):
        role = _classify(mod, i)
        carried = set().union(*(chains.get(o, set()) for o in i.operands))
        if role == "start":
            open_at[i.name] = pos
            chains[i.name] = {i.name}
        elif role == "pass" and carried:
            chains[i.name] = carried
            if i.opcode == "async-update":
                # A SparseCore-offloaded collective's async-start takes no data (``async-start()``);
                # its async-update brings the operand in, so the transfer cannot begin before it.
                for s in carried:
                    if any(s not in chains.get(o, ()) for o in i.operands):
                        open_at[s] = pos
        elif role == "done":
            for s in carried:
                done_at.setdefault(s, pos)
    is_compute = [
        i.opcode in _COMPUTE_OPS
        or (i.opcode == "custom-call" and bool(_KERNEL_TARGETS.search(i.target)))
        or (i.opcode in ("fusion", "call", "while", "conditional") and any(mod.contains(c, "compute") for c in i.called))
        for i in instrs
    ]
    feeds = _feeds_compute(instrs, is_compute, loop_body=comp in mod.iterations())
    out = []
    for pos, i in enumerate(instrs):
        role = _classify(mod, i)
        if role == "start":
            end = done_at.get(i.name, len(instrs))
            inside = tuple(instrs[k].name for k in range(open_at[i.name] + 1, end) if is_compute[k])
            c = _describe(mod, comp, i, names, instrs, end, inside, True, mesh_shape, axis_names)
            c = dataclasses.replace(c, flops_inside=_sum_flops(mod, comp, [names[n] for n in inside]),
                                    bytes_inside=_window_bytes(mod, comp, instrs[open_at[i.name] + 1:end]))
            result = instrs[end].name if end < len(instrs) else i.name
        elif role == "sync":
            c = _describe(mod, comp, i, names, instrs, pos, (), False, mesh_shape, axis_names)
            result = i.name
        else:
            continue
        out.append(dataclasses.replace(c, feeds_compute=feeds.get(result, False)))
    return out


def _window_bytes(mod, comp: str, window) -> float:
    """HBM bytes the instructions of ``window`` read and write on the core: ``instr_bytes`` each, a loop's
    bodies once per trip; async starts (copies, other collectives: their own engines), dones and
    synchronous collectives left out (a TPU collective fusion's continuation, which holds a matmul, counts)."""
    trips, total = mod.iterations(), 0.0
    for i in window:
        if i.opcode.endswith("-start") or i.opcode in ("async-start", "async-update") or \
                _classify(mod, i) in ("start", "done", "sync"):
            continue
        if i.opcode == "while":
            total += sum(_body_bytes(mod, body) * (trips.get(body, 1) or 1) for body in i.called)
        else:
            total += instr_bytes(mod, comp, i)
    return total


_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_LHS_DILATE = re.compile(r"lhs_dilate=([0-9x]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(shape: str) -> list[int]:
    m = re.search(r"\[([0-9,]*)\]", shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def instr_flops(mod, comp: str, i: Instr, depth: int = 0) -> float | None:
    """Estimated FLOPs of one instruction from its shapes: a convolution ``2 x output elements x the
    kernel's input-feature and window sizes``, a dot ``2 x output elements x the contracted sizes``;
    fusions, calls and loop bodies sum what they hold (a body once per trip when readable). ``None``
    when a kernel custom call is among them (its FLOPs are not in the HLO); 0 for anything else."""
    table = mod.by_name.get(comp, {})
    operands = i.refs or i.operands
    if i.opcode == "convolution" and len(operands) == 2:
        labels = _DIM_LABELS.search(i.attrs)
        rhs = _dims(_operand_shape(table, operands[1]))
        if labels is None or len(labels.group(2)) != len(rhs):
            return 0.0
        dilate = _LHS_DILATE.search(i.attrs)
        dilate = [int(d) for d in dilate.group(1).split("x")] if dilate else []
        # A base-dilated window (TPU writes some batched matmuls so: window 8 with lhs_dilate 8) meets
        # one input element per lhs_dilate window positions: only those taps multiply.
        taps = [n if l == "i" else -(-n // (dilate[int(l)] if int(l) < len(dilate) else 1))
                for n, l in zip(rhs, labels.group(2)) if l == "i" or l.isdigit()]
        return 2.0 * math.prod(_dims(i.shape)) * math.prod(taps)
    if i.opcode == "dot" and operands:
        lhs, contracting = _dims(_operand_shape(table, operands[0])), _LHS_CONTRACTING.search(i.attrs)
        ks = [int(k) for k in contracting.group(1).split(",") if k] if contracting else []
        return 2.0 * math.prod(_dims(i.shape)) * math.prod(lhs[k] for k in ks if k < len(lhs))
    if i.opcode == "custom-call" and _KERNEL_TARGETS.search(i.target):
        return None
    if depth > 8 or not i.called:
        return 0.0
    trips = mod.iterations() if i.opcode == "while" else {}
    total = 0.0
    for c in i.called:
        inner = _sum_flops(mod, c, mod.comps.get(c, ()), depth + 1)
        if inner is None:
            return None
        total += inner * (trips.get(c, 1) or 1)
    return total


def _sum_flops(mod, comp: str, instrs, depth: int = 0) -> float | None:
    total = 0.0
    for i in instrs:
        f = instr_flops(mod, comp, i, depth)
        if f is None:
            return None
        total += f
    return total


# Ops that move no data through HBM themselves (structure, aliases, loops counted by their bodies,
# the done half of an async pair whose start was counted).
_NO_TRAFFIC = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "async-done", "async-update", "copy-done",
    *(k + "-done" for k in COLLECTIVE_KINDS),
})


def instr_bytes(mod, comp: str, i: Instr) -> int:
    """HBM bytes one scheduled instruction reads and writes: its operands and results, once each
    (as the compiler's cost analysis counts a fusion, or a custom call without a cost estimate).
    The start of an async pair (a copy, a collective) returns a tuple holding its operand beside
    its destination: that tuple is what it reads and writes.

    Slices and updates in place count what they touch, as the compiler's cost analysis does: a
    (dynamic-)slice reads its result's bytes of its operand, not the whole operand; a
    dynamic-update-slice writes into its operand 0's buffer (copy insertion made the two one
    buffer), so it reads and writes its update, not the buffer. In a fusion: a parameter only sliced
    reads its slices; the parameter an in-place dynamic-update-slice writes into (the update's
    operand 0, the fusion's result or a tuple element of it, through bitcasts) is read not at all,
    and that result is written as the update's bytes (a scan's carried output buffer, per trip)."""
    if i.opcode in _NO_TRAFFIC:
        return 0
    if i.opcode.endswith("-start") or i.opcode == "async-start":
        return array_bytes(i.shape)
    table = mod.by_name[comp]
    sizes = [array_bytes(_operand_shape(table, r)) for r in i.refs]
    if i.opcode in ("slice", "dynamic-slice") and sizes:
        return 2 * array_bytes(i.shape) + sum(sizes[1:])
    if i.opcode == "dynamic-update-slice" and len(sizes) >= 2:
        return 2 * sizes[1] + sum(sizes[2:])
    if i.opcode == "fusion" and i.called and i.called[0] in mod.comps:
        return _fusion_bytes(mod, i.called[0], sizes, i.shape)
    return sum(sizes) + array_bytes(i.shape)


def _fusion_bytes(mod, comp: str, sizes: list[int], shape: str) -> int:
    """A fusion's HBM bytes (``instr_bytes``): each operand's reads (``sizes``: their whole bytes),
    its results' writes, both less what in-place updates and slices leave untouched."""
    instrs, table = mod.comps[comp], mod.by_name[comp]
    users: dict[str, list[Instr]] = {}
    for u in instrs:
        for o in dict.fromkeys(u.operands):
            users.setdefault(o, []).append(u)
    root = next((r for r in instrs if r.root), instrs[-1] if instrs else None)
    if root is None:
        return sum(sizes) + array_bytes(shape)
    users.setdefault(root.name, []).append(root)  # the result: read whole when it is a parameter (bitcast)
    is_tuple = root.opcode == "tuple"
    outputs = [table.get(o) for o in root.operands] if is_tuple else [root]
    in_place, written = set(), 0
    for k, out in enumerate(outputs):
        full = array_bytes(tuple_element(shape, k) if is_tuple else shape)
        dus = _through_bitcasts(table, out)
        if dus is not None and dus.opcode == "dynamic-update-slice" and len(dus.operands) >= 2:
            buffer = _through_bitcasts(table, table.get(dus.operands[0]))
            if buffer is not None and buffer.opcode == "parameter":  # aliased with the result: written in place
                in_place.add(dus.name)
                written += min(array_bytes(_operand_shape(table, dus.refs[1])) if len(dus.refs) >= 2 else full, full)
                continue
        written += full
    read = 0
    for p in instrs:
        if p.opcode != "parameter":
            continue
        try:
            k = int(p.operands[0])
        except (IndexError, ValueError):
            continue
        if k < len(sizes):
            read += _param_read(mod, comp, p.name, sizes[k], users, in_place)
    return read + written


def _through_bitcasts(table: dict[str, Instr], i: Instr | None) -> Instr | None:
    """The instruction a chain of bitcasts starts from."""
    for _ in range(16):
        if i is None or i.opcode != "bitcast" or not i.operands:
            return i
        i = table.get(i.operands[0])
    return i


def _param_read(mod, comp: str, name: str, full: int, users: dict[str, list[Instr]], in_place: set[str],
                depth: int = 0) -> int:
    """HBM bytes a fusion reads of its value ``name`` (a parameter, or a bitcast of one) whose bytes are
    ``full``: the results of the slices that take it as operand 0, nothing as the buffer an in-place
    update writes into (``in_place``), its whole bytes once for any other use."""
    partial = 0
    for u in users.get(name, ()):
        if u.opcode == "bitcast":
            part = _param_read(mod, comp, u.name, full, users, in_place, depth + 1) if depth < 16 else full
        elif u.opcode in ("slice", "dynamic-slice") and u.operands[0] == name and name not in u.operands[1:]:
            part = array_bytes(u.shape)
        elif u.opcode == "dynamic-update-slice" and u.name in in_place and u.operands[0] == name \
                and name not in u.operands[1:]:
            part = 0
        else:
            return full
        if part >= full:
            return full
        partial += part
    return min(partial, full)


def loop_bytes(text_or_module) -> float:
    """HBM bytes that a cost analysis counting each loop body once leaves out: every body's traffic
    (``instr_bytes``) for all its runs but one, runs read from the loop conditions (bodies whose trip
    count is data-dependent, like the blockwise kernel's block loops, run once: a lower bound).

    Args:
        text_or_module: a scheduled HLO module's text (``compiled.as_text()``) or its parsed module.

    Returns:
        The bytes, a float.
    """
    mod = text_or_module if isinstance(text_or_module, _Module) else _Module(text_or_module)
    return float(sum((runs - 1) * _body_bytes(mod, body) for body, runs in mod.iterations().items() if runs > 1))


def _body_bytes(mod, body: str) -> int:
    """HBM bytes one run of the computation ``body`` reads and writes (``instr_bytes`` of each instruction)."""
    return sum(instr_bytes(mod, body, i) for i in mod.comps.get(body, ()))


def _describe(mod, comp, i, names, instrs, done_pos, inside, is_async, mesh_shape, axis_names) -> Collective:
    """The collective's kind, axes, bytes and phase from the op that really holds it."""
    if i.opcode in COLLECTIVE_KINDS or i.opcode.endswith("-start") and _kind(i.opcode) in COLLECTIVE_KINDS:
        core, core_comp = i, comp
    else:
        core, core_comp = mod.inner_collective(i.called[0])
    kind = _kind(core.opcode)
    if kind == "all-reduce" and core is not i and i.called and i.called[0].startswith("all-reduce-scatter"):
        kind = "reduce-scatter"  # TPU's all-reduce-scatter fusion: an all-reduce and a slice, run as a reduce-scatter
    table = mod.by_name[core_comp]
    refs = core.refs or core.operands
    if kind == "ragged-all-to-all":  # (operand, output, offsets and sizes): the data is the first
        refs = refs[:1]
    in_bytes = sum(array_bytes(_operand_shape(table, r)) for r in refs)
    out_shape = core.shape
    if core is i and i.opcode.endswith("-start") and done_pos < len(instrs):
        out_shape = instrs[done_pos].shape  # the done's result, not the start's tuple
    groups = _groups(core.attrs)
    op_name = core.op_name or i.op_name
    phase = _phase(op_name) if op_name else _phase_from_producers(names, i)
    if phase == "fwd" and _TRANSPOSED_IN_SHARD_MAP.search(op_name):
        # Inside a shard_map, the transposes of pvary (a psum), psum_scatter (an all-gather) and all_gather (a
        # reduce-scatter) keep the forward's name: such a collective is the backward's when its data is.
        phase = _phase_from_producers(names, _data_entry(i, instrs), depth=1)  # (deeper, CSE mixes the two)
    return Collective(
        name=i.name, kind=kind, axes=_axes(groups, mesh_shape, axis_names),
        group_size=max((len(g) for g in groups), default=1) if core.opcode != "collective-permute" else 2,
        bytes=max(in_bytes, array_bytes(out_shape)), phase=phase, is_async=is_async,
        compute_inside=inside, op_name=op_name,
    )
