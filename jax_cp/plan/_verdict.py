"""The planner's verdict: which compiled layout to run, and why, in one line.

Pure functions of plain numbers (nothing is compiled here): the lowest estimated
step wins; steps within ``TIE`` of the lowest tie, and ties go to the least peak
memory per device, then (memory within ``TIE`` too) to the fewest CP collective bytes.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Option", "Verdict", "TIE", "verdict", "rule_check"]

TIE = 0.02  # estimated steps (then peak memories) within this share of the lowest tie


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One compiled layout as the verdict weighs it; figures per device.

    Attributes:
        label: the layout's name.
        step_s: estimated step time.
        memory_bytes: peak memory.
        cp_bytes: context-parallel collective bytes, forward + backward, loop trips counted.
        fits: within the memory budget.
    """

    label: str
    step_s: float  # estimated step time
    memory_bytes: float  # peak memory
    cp_bytes: float  # context-parallel collective bytes, forward + backward, loop trips counted
    fits: bool = True  # within the memory budget

    def __post_init__(self):
        for name in ("step_s", "memory_bytes", "cp_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Option {self.label!r}: {name}={getattr(self, name)} must be >= 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """The option to run (``None`` when none fits), the one it was weighed against, and what decided.

    ``decided_by``: ``"time"``, ``"memory"``, ``"CP bytes"`` (the ties), ``"fits"`` (the only one
    that fits), ``"single"`` (one option) or ``"nothing fits"``.

    Attributes:
        pick: the option to run (``None`` when none fits).
        against: the one it was weighed against.
        decided_by: what decided (above).
        why: the figures behind it, with the pick as subject (``"est. step 39.98 ms ties ..."``).
    """

    pick: Option | None
    against: Option | None
    decided_by: str
    why: str  # the figures behind it, with the pick as subject ("est. step 39.98 ms ties ...")

    @property
    def line(self) -> str:
        """``verdict: run PICK: WHY`` (``verdict: WHY`` when nothing fits)."""
        return f"verdict: {self.why}" if self.pick is None else f"verdict: run {self.pick.label}: {self.why}"

    def __str__(self) -> str:
        return self.line


def _ms(s: float) -> str:
    x = s * 1e3
    return f"{x:.2f} ms" if x >= 0.1 else f"{x:.2g} ms"


def _bytes(*values: float) -> str:
    """``"593 vs 932 MiB"``: the values in the unit of the largest."""
    top, unit, scale = max(values), "B", 1
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if top < 1024 * scale:
            break
        unit, scale = name, scale * 1024
    nums = [v / scale for v in values]
    return " vs ".join(f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in nums) + f" {unit}"


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _ratio(a: Option, b: Option) -> str:
    if b.cp_bytes == 0:
        return "no CP bytes either" if a.cp_bytes == 0 else f"{_bytes(a.cp_bytes)} of CP bytes against none"
    return f"{a.cp_bytes / b.cp_bytes:.2f}x the CP bytes"


def verdict(options, *, tie: float = TIE) -> Verdict:
    """Which of ``options`` to run, and the one line that says why.

    Only options that fit count. The lowest estimated step wins unless others are within
    ``tie`` of it; among those, the least peak memory, and with memories within ``tie`` too,
    the fewest CP bytes (then the lower step).

    Args:
        options: the ``Option`` s to weigh.
        tie: the share of the lowest within which figures tie.

    Returns:
        The :class:`Verdict`.
    """
    options = list(options)
    if not options:
        raise ValueError("verdict needs at least one option; got none.")
    if not 0 <= tie < 1:
        raise ValueError(f"tie={tie} must be a share in [0, 1), e.g. 0.02.")
    fitting = [o for o in options if o.fits]
    if not fitting:
        small = min(options, key=lambda o: o.memory_bytes)
        which = (f"none of the {len(options)} fits the memory budget; the smallest, {small.label}, needs"
                 if len(options) > 1 else f"{small.label} does not fit the memory budget: it needs")
        return Verdict(pick=None, against=small, decided_by="nothing fits", why=(
            f"{which} {_bytes(small.memory_bytes)} per device; spread it further (more devices, FSDP), "
            "rematerialise, or plan a shorter sequence or a smaller batch"))
    fastest = min(fitting, key=lambda o: o.step_s)
    tied = [o for o in fitting if o.step_s <= fastest.step_s * (1 + tie)]
    least = min(o.memory_bytes for o in tied)
    light = [o for o in tied if o.memory_bytes <= least * (1 + tie)]
    pick = min(light, key=lambda o: (o.cp_bytes, o.step_s))
    if len(fitting) == 1:
        rest = len(options) - 1
        why = (f"est. step {_ms(pick.step_s)}, {_bytes(pick.memory_bytes)} per device"
               + (f"; the only one of {len(options)} that fits the memory budget" if rest else ""))
        return Verdict(pick=pick, against=None, decided_by="fits" if rest else "single", why=why)
    if len(tied) == 1:
        against = min((o for o in fitting if o is not pick), key=lambda o: o.step_s)
        decided = "time"
        why = (f"est. step {_ms(pick.step_s)}, the lowest ({against.label}: {_ms(against.step_s)}, "
               f"+{_pct(against.step_s / pick.step_s - 1)}); it uses "
               f"{_bytes(pick.memory_bytes, against.memory_bytes)} per device and {_ratio(pick, against)}")
    else:
        pool = light if len(light) > 1 else tied
        against = min((o for o in pool if o is not pick), key=lambda o: o.step_s)
        ties = f"est. step {_ms(pick.step_s)} ties {against.label} {_ms(against.step_s)} within {_pct(tie)}"
        if len(light) == 1:
            decided = "memory"
            why = (f"{ties}; it uses {_bytes(pick.memory_bytes, against.memory_bytes)} per device and "
                   f"{_ratio(pick, against)}")
        else:
            decided = "CP bytes"
            why = (f"{ties}, and so does memory ({_bytes(pick.memory_bytes, against.memory_bytes)} per device); "
                   f"it moves {_ratio(pick, against)}")
    return Verdict(pick=pick, against=against, decided_by=decided, why=why)


def rule_check(measured: tuple[float, float], got: tuple[float | None, float | None], *,
               slack: float = 0.005) -> str:
    """One line comparing a compiled plan's share of CP bytes hidden (fwd, bwd) with what the ``auto``
    rule's note claims at the shape it was measured at (``Choice.measured_overlap``); ``""`` without CP bytes."""
    if None in got:
        return ""
    (mf, mb), (gf, gb) = measured, got
    hidden = f"this plan hides {gf:.2f} / {gb:.2f} of its CP bytes (fwd / bwd)"
    if gf >= mf - slack and gb >= mb - slack:
        return f"{hidden}, as the rule measured"
    return (f"{hidden}, below the rule's {mf:.2f} / {mb:.2f} at the shape in brackets: the grouping was picked "
            "there, not for this shape; strategy auto compiles the groupings for this one (or set "
            "overlap_chunks / fused_qkv_chunks)")
