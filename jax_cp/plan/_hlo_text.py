"""HLO module text -> instructions: a small reader for ``compiled.as_text()``.

Reads each computation's instructions in order (for a scheduled module, the
schedule): name, result shape, opcode, operand names and the raw attributes.

Both operand spellings are read: ``get-tuple-element`` instructions (the
modules jax 0.10 compiles) and ``%name#k``, element ``k`` of a tuple-valued
operand (jax 0.12's, which have no get-tuple-elements).
"""
from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["Instr", "parse_module", "array_bytes", "tuple_element"]

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')

def array_bytes(shape: str) -> int:
    """Bytes of every array in a shape string (tuples summed; layouts ignored)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _DTYPE_BITS.get(dtype, 8 if dtype.startswith("f8") else 0)
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def tuple_element(shape: str, index: int) -> str:
    """Element ``index`` of a tuple shape string (the shape itself when it is not a tuple)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return shape
    parts = _split_top(shape[1 : _balanced(shape, 0) - 1])
    return parts[index].strip() if 0 <= index < len(parts) else ""


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Instr:
    """One HLO instruction: result shape, opcode, operand names, raw attribute text.

    ``operands`` are the producing instructions' names; ``refs`` the operands as
    written, ``name#k`` for element ``k`` of a tuple-valued producer; ``root``: whether
    it is its computation's ROOT.
    """

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    refs: tuple[str, ...] = ()
    root: bool = False  # the computation's ROOT

    @property
    def called(self) -> tuple[str, ...]:
        out = []
        for group in _CALLED.findall(self.attrs):
            out += [c.strip().lstrip("%") for c in group.strip("{}").split(",") if c.strip()]
        return tuple(out)

    @property
    def target(self) -> str:
        m = _TARGET.search(self.attrs)
        return m.group(1) if m else ""

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""


def _parse_instr(line: str) -> Instr | None:
    line = _COMMENT.sub("", line).strip()
    root = line.startswith("ROOT ")
    if root:
        line = line[5:]
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = 0
        while end < len(rest) and not rest[end].isspace():
            end = _balanced(rest, end) if rest[end] in "{[(" else end + 1
    shape, rest = rest[:end], rest[end:]
    m = _OPCODE.match(rest)
    if not m:
        return None
    open_paren = m.end() - 1
    close = _balanced(rest, open_paren)
    refs = tuple(
        tok.split()[-1].lstrip("%") for tok in _split_top(rest[open_paren + 1 : close - 1]) if tok.strip()
    )
    operands = tuple(r.split("#", 1)[0] for r in refs)
    return Instr(name=name, shape=shape, opcode=m.group(1), operands=operands, attrs=rest[close:], refs=refs, root=root)


def _split_top(text: str) -> list[str]:
    """Splits on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """HLO module text -> ({computation: instructions in order}, entry name).

    An instruction may span lines (Mosaic kernels carry multi-line backend
    configs): lines that start neither an instruction nor close the
    computation continue the previous one.

    Args:
        text: the module's text (``compiled.as_text()``).

    Returns:
        ``(computations, entry)``: each computation's instructions in order, and the entry's name.
    """
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
        elif line.strip() == "}" or line.startswith("}, "):  # "}, execution_thread=..." closes one too
            current = None
        elif line.lstrip().startswith(("%", "ROOT ")) or not comps[current]:
            comps[current].append(line)
        else:
            comps[current][-1] += "\n" + line
    if not entry:
        raise ValueError("no ENTRY computation found in the HLO text; pass compiled.as_text().")
    parsed = {c: [i for i in map(_parse_instr, lines) if i is not None] for c, lines in comps.items()}
    return parsed, entry
