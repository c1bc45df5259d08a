"""``"auto"``: the measured best grouping of a layer for the chip and layout it runs on.

``overlap_chunks``, ``fused_qkv_chunks`` and ``kv_exchange`` default to ``"auto"``
and are resolved when the layer is traced, from the mesh's devices (platform,
TPU generation) and the layout (``c, u, t``, heads, kv heads, tokens per device):
``choose`` below is the one rule, a table of what the TPU compiler's schedule
hid best (benchmarks/RESULTS.md "Overlap (planner)", Llama-3-8B layer, the flags
``plan.recommended_xla_flags`` gives), plus memory: the ring when what a gathering exchange adds to
a step (the gathered K/V, their copies and, in the backward, their gradients for the whole
sequence: ``gathered_bytes``) would take more than an eighth of a device's HBM or the sequence is
split over ``RING_FROM_RANKS`` colossal ranks or more, and, with splash, the tokens per device
(``SPLASH_LONG_RULES``). Explicit values win.
"""
from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp

from jax_cp import exchanges, kernels as _kernels
from jax_cp._chips import CHIPS
from jax_cp._masks import Window, normalize_window
from jax_cp.exchanges import AllGather, AllToAll, KVExchange, Ring

__all__ = ["AUTO", "Choice", "choose", "choose_kernel", "chip_of", "describe_kernel", "gathered_bytes", "int_or_auto", "MEASURED_AT", "RULES", "SPLASH_RULES",
           "SPLASH_LONG_RULES"]

AUTO = "auto"
KV_MEMORY_SHARE = 0.125  # what a gathering exchange holds beyond this share of HBM: the ring
GATHER_PEAK_FACTOR = 6  # bytes a gathering exchange adds to a step's peak per byte of gathered K/V
# Colossal ranks from which the ring is taken whatever the memory: each of its c - 1 steps moves S/c tokens'
# K/V under a kernel step, where a gathering exchange moves the whole sequence's at once. Llama 3.1 8B training
# step, v5p:4x4x4, B = 1, S = 256K, c = 64 (docs/guides/maxtext.md): the ring exposes 13.1 ms at a 5.17 GiB
# peak, the all-to-all 78.5 ms at 9.94 GiB. The table's layouts were measured at c <= 16.
RING_FROM_RANKS = 32


def gathered_bytes(kv_bytes: float) -> float:
    """What an all-gather or all-to-all K/V exchange adds to a training step's peak memory per device,
    beyond the ring's, for ``kv_bytes`` of all-gathered K/V (one layer): ``GATHER_PEAK_FACTOR`` times
    them, an upper bound. The compiled 1M-token Llama 3.1 8B step on v5p (B = 1, c = 64, bfloat16, FSDP,
    remat, layers scanned; docs/guides/maxtext.md), 2 layers: the all-to-all's 13.08 GiB against the
    ring's 6.67 for 4 GiB of K/V (1.6x: its c copies in and out, the kernel's K and V layouts, the
    backward's dK/dV in bfloat16); 5.8x with an unrolled step whose dK/dV travelled in float32. The rule
    keeps 6: past it the ring also exposes less at these lengths (1M, c = 64: 24.5 against 258.6 ms)."""
    return GATHER_PEAK_FACTOR * kv_bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    """A resolved grouping and the measurement (or reason) behind it.

    ``measured_overlap``: the share of CP bytes (fwd, bwd) the rule's grouping hid where it was
    measured, ``measured_at`` (``MEASURED_AT``); ``None`` where no measurement applies. The planner
    compares them with the plan's own figures, since other shapes can hide less.
    """

    kv_exchange: KVExchange
    overlap_chunks: int
    fused_qkv_chunks: int
    why: str
    measured_overlap: tuple[float, float] | None = None  # fwd / bwd CP bytes hidden where the rule was measured
    measured_at: str = ""  # the topology and layer shape behind measured_overlap (MEASURED_AT)


# chip -> layout kind -> (kv_exchange, overlap_chunks, fused_qkv_chunks, measured fwd / bwd overlap)
RULES = {
    "v5e": {
        "ulysses": (AllGather(), 4, 1, "v5e (1,4,2) 1.00 / 1.00"),
        # all_to_all in one chunk: 1.00 / 1.00 with either kernel, like all_gather in 2 chunks with the
        # blockwise one, which with splash leaves half of the forward exposed at small shapes (v5e:2x4).
        "colossal": (AllToAll(), 1, 0, "v5e (4,1,4) 1.00 / 1.00, v5e:2x4 (4,1,2) 1.00 / 1.00"),
        "hybrid": (AllToAll(), 2, 0, "v5e (2,2,4), (2,2,2), (2,4,2), (4,2,2), (4,4,1), (2,8,1) 1.00 / 1.00"),
    },
    "v5p": {
        "ulysses": (AllGather(), 2, 2, "v5p (1,4,4) 1.00 / 1.00"),
        # all_to_all in one chunk: 1.00 / 1.00 in bytes and time with either kernel, at less memory and a
        # lower estimated step than all_gather in 2 chunks, which hides nothing of its forward on v5p:2x2x2.
        "colossal": (AllToAll(), 1, 0, "v5p (4,1,4) 1.00 / 1.00, v5p:2x2x2 (4,1,2) 1.00 / 1.00"),
        "hybrid": (Ring(), 2, 2, "v5p (4,4,4) 1.00 / 1.00"),
    },
}
# With the splash kernel in the layer (what kernel="auto" runs on TPU): its custom calls schedule
# differently from the blockwise kernel's fusions, so it has a rule of its own (benchmarks/RESULTS.md,
# defaults with splash; bytes fwd / bwd at S = 8K, 32K and 128K); kinds absent here keep the blockwise entry.
# "<kind>, t=1": the entry for layouts without tp, where it differs (more heads per device, no tp psum).
SPLASH_RULES = {
    "v5e": {"ulysses": (AllGather(), 2, 1, "v5e (1,4,2) with splash 1.00 / 1.00, v5e:2x4 (1,4,2) 1.00 / 1.00"),
            "hybrid": (AllToAll(), 2, 0, "v5e (2,2,4) with splash 1.00 / 1.00")},
    "v5p": {"ulysses": (AllGather(), 2, 2, "v5p (1,4,4) with splash 1.00 / 1.00 at S = 8K and 32K"),
            "hybrid": (Ring(), 2, 1, "v5p (4,4,4) with splash 1.00 / 1.00 in bytes and time (forward "
                                     "time 0.87 with positions passed)"),
            # without tp both fused chunks leave the second fused all-to-all empty from B = 32 (0.70 / 1.00)
            "ulysses, t=1": (AllGather(), 2, 1, "v5p (1,4,1) with splash 1.00 / 1.00 in bytes and time at "
                                                "S = 8K, 32K and 128K with B = 16, and at 8K with B = 32 and 64")},
}
# Long sequences with splash: from this many tokens per device (S / (c u)) on, the entry replaces the
# SPLASH_RULES one: the attention kernels outgrow the projections, and the schedule changes with them.
# Chosen with the masks built at run time (positions or segment ids passed by the caller), where
# fusing only the first chunk hides more than fusing both; with the default positions both hide
# everything (benchmarks/RESULTS.md, long sequences with splash).
SPLASH_LONG_RULES = {
    "v5p": {"ulysses": (16384, (AllGather(), 2, 1, "v5p (1,4,4) with splash at >= 16K tokens per device: "
                                                   "0.75-1.00 / 1.00 in bytes, 0.75 / 1.00 in time"))},
}
# Where a chip's bare name in the notes above was measured (benchmarks/RESULTS.md "Overlap (planner)"):
# other shapes, a batch of 1 included, can hide less with the same grouping; the planner says so.
MEASURED_AT = {
    "v5e": "v5e:4x4, a Llama-3-8B layer (D=4096, 32 heads, 8 kv heads), B=2, S = 8K, 32K and 128K",
    "v5p": "v5p:4x4x4, a Llama-3-8B layer (D=4096, 32 heads, 8 kv heads), B=4, S = 8K, 32K and 128K",
}
_OVERLAP = re.compile(r"(\d\.\d\d)(?:-\d\.\d\d)? / (\d\.\d\d)")  # a note's first "fwd / bwd" (its lower end)


def _measured_overlap(note: str) -> tuple[float, float] | None:
    """The first ``fwd / bwd`` overlap pair of a rule's note (``0.75-1.00 / 1.00`` reads 0.75, 1.00)."""
    m = _OVERLAP.search(note)
    return None if m is None else (float(m.group(1)), float(m.group(2)))


# Not measured: other TPU generations take the v5e rule (the same lite-chip scheduler flags).
TPU_FALLBACK = "v5e"


def chip_of(device) -> tuple[str, str | None]:
    """``(platform, chip)`` of a device: ``("tpu", "v5e")``, ``("gpu", None)``, ``("cpu", None)``."""
    platform = getattr(device, "platform", "cpu")
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform != "tpu":
        return platform, None
    kind = getattr(device, "device_kind", "")
    return platform, next((name for name, chip in CHIPS.items() if chip.device_kind == kind), None)


def int_or_auto(text: str):
    """``"auto"`` or an integer: the command-line type of the chunk options."""
    return text if text == AUTO else int(text)


def _divisor_at_most(n: int, limit: int) -> int:
    return max([k for k in range(1, min(n, limit) + 1) if n % k == 0] or [1])  # n < 1: the layout check says why


def choose(*, platform: str, chip: str | None, c: int, u: int, t: int, num_heads: int,
           kv_bytes_per_device: float | None = None, hbm_bytes: float | None = None,
           kernel=_kernels.BLOCKWISE, tokens_per_device: int | None = None) -> Choice:
    """The grouping for a layout (pure: no devices needed; tests call it per platform and layout).

    ``kv_bytes_per_device``: all-gathered K/V of one layer on one device; with ``hbm_bytes`` it
    decides whether the O(S/c) ring is needed (where ``gathered_bytes`` exceeds ``KV_MEMORY_SHARE``
    of HBM: the rest of a step, its other layers' saved activations included, needs the remainder).
    ``kernel``: the local kernel the layer runs (``"splash"`` takes ``SPLASH_RULES`` where they have
    the layout kind, and ``SPLASH_LONG_RULES`` from their ``tokens_per_device``, ``S / (c u)``, on). A table's
    ``"<kind>, t=1"`` entry, where there is one, is the rule for ``t == 1``.
    """
    if c == 1 and u == 1:
        return Choice(AllGather(), 1, 0, "no context parallelism: nothing to hide")
    if platform != "tpu":
        # CPU collectives are copies and chunks only add ops; GPU schedules are not measured yet.
        return Choice(AllGather(), 1, 0, f"{platform}: the plain layer (no measured gain from chunking)")
    kind = "ulysses" if c == 1 else "colossal" if u == 1 else "hybrid"
    known = chip if chip in RULES else TPU_FALLBACK
    table = RULES[known]
    if kernel == _kernels.SPLASH:
        table = table | SPLASH_RULES.get(known, {})
        long = SPLASH_LONG_RULES.get(known, {}).get(kind)
        if long and tokens_per_device and tokens_per_device >= long[0]:
            table = table | {kind: long[1]}
    exchange, n, fused, measured = (t == 1 and table.get(f"{kind}, t=1")) or table[kind]
    why = (f"measured {measured}" + ("" if chip in RULES else f" (chip {chip or 'unknown'}: the {TPU_FALLBACK} rule)")
           + f" [{known} = {MEASURED_AT[known]}]")
    claim = _measured_overlap(measured)
    held = gathered_bytes(kv_bytes_per_device) if kv_bytes_per_device else 0.0
    ring = None  # why the ring replaces the table's gathering exchange
    if c > 1 and exchange != Ring() and hbm_bytes and held > KV_MEMORY_SHARE * hbm_bytes:
        ring = (f"a gathering exchange would add {held / 2**30:.1f} GiB (for {kv_bytes_per_device / 2**30:.1f} GiB "
                f"of gathered K/V) > {KV_MEMORY_SHARE:.1%} of {hbm_bytes / 2**30:.0f} GiB HBM: the ring")
    elif c >= RING_FROM_RANKS and exchange != Ring():
        ring = (f"cp_colossal={c} >= {RING_FROM_RANKS} ranks: the ring, each step's K/V under a kernel step (v5p, "
                f"c = 64, 256K: 13.1 ms exposed against the all-to-all's 78.5)")
    if ring:
        exchange, fused, claim = Ring(), fused if u > 1 else 0, None  # not the measured exchange
        why = f"{ring}; chunks as {why}"
    per_device = num_heads // (t * u)
    n = _divisor_at_most(per_device, n)
    fused = min(fused, n) if exchange.fuses_qkv else 0
    return Choice(exchange, n, fused, why, claim, MEASURED_AT[known] if claim else "")


def choose_kernel(kernel=_kernels.AUTO, *, platform: str, kv_exchange, is_causal: bool = False,
                  local_window_size: Window = None, has_segments: bool = False, dtype=jnp.bfloat16,
                  head_dim: int = 128, v_head_dim: int | None = None, logits_soft_cap=None, use_sinks: bool = False,
                  record_max_logits: bool = False, return_residual: bool = False,
                  kv_len: int | None = None, spans: bool = False) -> tuple[_kernels.Kernel, str]:
    """``(kernel, why)``: the kernel a call's exchange steps run on ``platform``, and why.

    The one place ``"auto"`` becomes a kernel (``AttentionSpec.resolve`` calls it for the layers,
    ``dot_product_attention`` and the planner; :func:`describe_kernel` prints it). ``kv_exchange``:
    the resolved exchange value; ``kv_len``: the keys one kernel call sees (a ring step's chunk, or
    every key after an all-gather; ``None``: not known, assumed to fit); ``spans``: span ids are
    given (every kernel but cuDNN takes them). An explicit kernel that cannot serve the call raises
    its ``ValueError``.
    """
    kernel = _kernels.resolve(kernel)
    kv_exchange.check_kernel(kernel)  # e.g. the ring refuses kernels without a log-sum-exp
    window = normalize_window(local_window_size)
    needs = dict(is_causal=is_causal, window=window, has_segments=has_segments, dtype=dtype, head_dim=head_dim,
                 soft_cap=logits_soft_cap is not None, sinks=use_sinks, max_logits=record_max_logits)
    chosen = _kernels.select_kernel(kernel, platform=platform, **needs, residual=return_residual,
                                    v_head_dim=v_head_dim, kv_len=kv_len, spans=spans)
    if kernel != _kernels.AUTO:
        return chosen, "explicit"
    runs, why = kv_exchange.step_kernel(chosen)
    if why:
        return runs, f"auto on {platform} with kv_exchange={kv_exchange.name!r}: {why}"
    if chosen == _kernels.BLOCKWISE:
        why = {"tpu": _kernels.SPLASH.why_not(window=window, kv_len=kv_len, max_logits=record_max_logits,
                                              residual=return_residual, spans=spans, is_causal=is_causal),
               "gpu": _kernels.PALLAS_GPU.why_not(head_dim=head_dim, spans=spans)}.get(platform)
        return chosen, f"auto on {platform}: " + (why or "the portable kernel")
    if chosen == _kernels.PALLAS_GPU:
        return chosen, f"auto on gpu: {_kernels.CUDNN.why_not(**needs, spans=spans)}"
    return chosen, f"auto on {platform}"


def describe_kernel(*, kernel=_kernels.AUTO, platform: str | None = None, kv_exchange=None,
                    is_causal: bool = False, local_window_size: Window = None, has_segments: bool = False,
                    dtype=jnp.bfloat16, head_dim: int = 128, logits_soft_cap=None, use_sinks: bool = False,
                    record_max_logits: bool = False, kv_len: int | None = None, spans: bool = False) -> str:
    """One line: the kernel a call runs on ``platform`` and why.

    ``"auto"`` never chooses silently. The decision is :func:`choose_kernel`'s, the one the
    layers make.

    Args:
        kernel: ``"auto"``, a kernel name or value.
        platform: the platform (default: the default backend).
        kv_exchange: a ``jax_cp.exchanges`` value or name (default: the default exchange).
        is_causal, local_window_size, has_segments: the mask.
        dtype, head_dim: the inputs' dtype and head size.
        logits_soft_cap, use_sinks, record_max_logits: the call's soft cap, sinks, max logits.
        kv_len: the keys one kernel call sees (a ring step's chunk, or every key after an
            all-gather; ``None``: not known).
        spans: the call has span ids (``span_ids``): every kernel but cuDNN takes them.

    Returns:
        e.g. ``"splash (auto on tpu)"``, or ``"blockwise (auto on tpu:
        local_window_size=(128, 0) over 131072 keys in one kernel call ...)"``.

    Raises:
        ValueError: an explicit kernel cannot serve the call.
    """
    exchange = exchanges.resolve(exchanges.DEFAULT if kv_exchange is None else kv_exchange)
    chosen, why = choose_kernel(kernel, platform=platform or _kernels.target_platform(), kv_exchange=exchange,
                                is_causal=is_causal, local_window_size=local_window_size, has_segments=has_segments,
                                dtype=dtype, head_dim=head_dim, logits_soft_cap=logits_soft_cap, use_sinks=use_sinks,
                                record_max_logits=record_max_logits, kv_len=kv_len, spans=spans)
    return f"{chosen} ({why})"
