"""``AttentionSpec``: the one validated description of an attention layer.

Heads, head dims, mask, chunks, K/V exchange and kernel, checked once on
creation; the modules, ``dot_product_attention``, the planner and ``models/``
derive from it, and every shape or divisibility error is raised here.
``Layout`` is how a spec's heads land on a mesh.
"""
from __future__ import annotations

import copy
import dataclasses

import jax.numpy as jnp

from jax_cp import exchanges as _exchanges
from jax_cp import kernels as _kernels
from jax_cp._chips import CHIPS
from jax_cp._checks import check_positive_int, check_scale
from jax_cp._defaults import AUTO, Choice, chip_of, choose, choose_kernel
from jax_cp._masks import Window, normalize_window, spans_ignored_reason
from jax_cp._mesh import MeshDims, lcm, mesh_dims
from jax_cp._params import DERIVED, derive_dims

__all__ = ["AttentionSpec", "Layout", "check_seq_batch"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """One attention layer, mesh-independent; validated on creation.

    ``overlap_chunks``, ``fused_qkv_chunks`` and ``kv_exchange`` may be ``"auto"``
    (the default): :meth:`resolve` fills them in for a mesh (``jax_cp._defaults.choose``).

    Attributes:
        num_heads: query heads.
        num_kv_heads: key/value heads; ``None`` means ``num_heads``.
        head_dim: ``None`` means ``in_features // num_heads``.
        in_features: the model width (``None`` for :func:`jax_cp.dot_product_attention`, which
            has no projections).
        out_features: the output projection's width, as flax's ``MultiHeadAttention``;
            ``None`` means ``in_features``.
        v_head_dim: ``None`` means ``head_dim`` (MLA models give values a head dim of their own).
        is_causal, local_window_size, scale: the mask and the logit scale. ``local_window_size`` is
            ``w`` or ``(left, right)``, bounds inclusive as jax.nn's: a query at position ``p`` sees
            keys at ``p - left`` to ``p + right``; a window ``W`` meaning ``|p_q - p_k| < W`` (Gemma,
            Hugging Face, Mistral) is ``(W - 1, W - 1)``, or ``(W - 1, 0)`` causal. ``scale``: a
            number (``None``: ``head_dim ** -0.5``).
        use_qk_norm, rope_theta, use_bias: RMS norm of queries and keys, RoPE base, biases.
        overlap_chunks, fused_qkv_chunks: head chunks (see :class:`jax_cp.CPAttention`), or ``"auto"``.
        kernel: the local attention kernel (stored as the value).
        kv_exchange: a ``jax_cp.exchanges`` value or its name (stored as the value), or ``"auto"``.
        block_q, block_kv: the blockwise kernel's tiles (``None``: chosen from the local batch,
            heads and platform, ``jax_cp.kernels.auto_blocks``); splash and cuDNN pick their own.
        logits_soft_cap: ``c`` caps the scaled logits to ``c * tanh(logits / c)`` before the mask.
        use_sinks: gives the layer a ``sinks [num_heads]`` parameter: one learned logit per
            query head joining its softmax denominator (no value).
        record_max_logits: each call also yields the per-head maximum of the logits that
            entered the softmax (for QK-clip).
        return_residual: (``dot_product_attention``'s) each call also yields the log-sum-exp
            of every row.

    Raises:
        ValueError: on creation, a field is invalid.
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    in_features: int | None = None
    out_features: int | None = None
    v_head_dim: int | None = None
    is_causal: bool = False
    local_window_size: Window | int = None
    scale: float | None = None
    use_qk_norm: bool = False
    rope_theta: float | None = None
    use_bias: bool = False
    overlap_chunks: int | str = AUTO
    fused_qkv_chunks: int | str = AUTO
    kernel: str = "auto"
    kv_exchange: _exchanges.KVExchange | str = AUTO
    block_q: int | None = None
    block_kv: int | None = None
    logits_soft_cap: float | None = None
    use_sinks: bool = False
    record_max_logits: bool = False
    return_residual: bool = False
    # The fields __post_init__ filled in from others (e.g. head_dim from in_features): ``replace``
    # derives them again, so a new in_features or num_heads does not keep a stale head dim.
    derived: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        set_ = partial_setattr(self)
        set_("derived", tuple(n for n in DERIVED if getattr(self, n) is None))
        dims = derive_dims(num_heads=self.num_heads, in_features=self.in_features, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, out_features=self.out_features, v_head_dim=self.v_head_dim,
                           rope_theta=self.rope_theta)
        for name, value in dims.items():
            set_(name, value)
        if self.overlap_chunks != AUTO:
            check_positive_int("overlap_chunks", self.overlap_chunks)
        set_("local_window_size", normalize_window(self.local_window_size))
        set_("scale", check_scale(self.scale))
        set_("kernel", _kernels.resolve(self.kernel))
        _kernels.check_block("block_q", self.block_q)
        _kernels.check_block("block_kv", self.block_kv)
        set_("logits_soft_cap", _kernels.check_soft_cap(self.logits_soft_cap))
        for name in ("use_sinks", "record_max_logits", "return_residual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.kv_exchange != AUTO:
            set_("kv_exchange", _exchanges.resolve(self.kv_exchange))
            self.kv_exchange.check_kernel(self.kernel)
        if self.fused_qkv_chunks != AUTO:
            self._check_fused()

    @property
    def is_resolved(self) -> bool:
        return AUTO not in (self.overlap_chunks, self.fused_qkv_chunks, self.kv_exchange, self.kernel)

    def _check_fused(self):
        f, ex, n = self.fused_qkv_chunks, self.kv_exchange, self.overlap_chunks
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= (f if n == AUTO else n):
            raise ValueError(f"fused_qkv_chunks={f!r} must be an integer from 0 to "
                             f"overlap_chunks={self.overlap_chunks} (how many leading head chunks send "
                             "Q, K and V in one all-to-all).")
        if f and ex != AUTO and not ex.fuses_qkv:
            others = " or ".join(repr(x.name) for x in _exchanges.EXCHANGES if x.fuses_qkv)
            raise ValueError(f"fused_qkv_chunks={f} cannot be combined with kv_exchange={ex.name!r}: "
                             f"{ex.no_fuse_reason}. Use kv_exchange={others}, or fused_qkv_chunks=0.")

    def replace(self, **changes) -> "AttentionSpec":
        """A copy with ``changes``, validated again; fields that were derived are derived again."""
        again = {name: None for name in self.derived if name not in changes}
        return dataclasses.replace(self, **again, **changes)

    def _filled(self, **resolved) -> "AttentionSpec":
        """A copy with the values ``resolve`` chose, not validated again: the rule only chooses valid ones."""
        spec = copy.copy(self)
        for name, value in resolved.items():
            object.__setattr__(spec, name, value)
        return spec

    def resolve(self, mesh, *, batch: int | None = None, seq_len: int | None = None, itemsize: int = 2,
                dtype=None, has_segments: bool = False,
                has_spans: bool = False) -> tuple["AttentionSpec", Choice | None]:
        """This spec with every ``"auto"`` filled in for ``mesh`` (explicit values kept), and the
        ``Choice`` behind the grouping (``None`` when exchange and chunks were explicit).

        The one resolution step of a call: the layers, ``dot_product_attention`` and the planner all
        call it. ``batch``/``seq_len`` enable the memory rule (the ring when all-gathered K/V would
        not fit) and, with ``seq_len``, the long-sequence entries (``_defaults.SPLASH_LONG_RULES``).
        The kernel is chosen here too (``_defaults.choose_kernel``), for inputs of ``dtype``
        (default: the float type of ``itemsize`` bytes) with or without segment ids and span ids.
        Span ids (``has_spans``) under a mask they cannot change are a ValueError (``check_spans``).
        """
        if has_spans:
            self.check_spans()
        if self.is_resolved:
            return self, None
        dims = mesh_dims(mesh)
        platform, chip = chip_of(mesh.devices.flat[0])
        c = None
        if AUTO in (self.overlap_chunks, self.fused_qkv_chunks, self.kv_exchange):
            c = self._choice(dims, platform, chip, batch, seq_len, itemsize)
        ex = self.kv_exchange
        if ex == AUTO:  # the rule's exchange, unless an explicit kernel or fusing rules it out
            ex = c.kv_exchange
            if self.fused_qkv_chunks not in (AUTO, 0) and not ex.fuses_qkv or not _runs(ex, self.kernel):
                ex = _exchanges.DEFAULT
        n = c.overlap_chunks if self.overlap_chunks == AUTO else self.overlap_chunks
        f = self.fused_qkv_chunks
        if self.overlap_chunks == AUTO and f != AUTO and f > n:  # explicit fused chunks: at least as many chunks
            n = f
        if f == AUTO:
            f = min(c.fused_qkv_chunks, n) if ex.fuses_qkv else 0
        kernel, _ = choose_kernel(
            self.kernel, platform=platform, kv_exchange=ex, is_causal=self.is_causal,
            local_window_size=self.local_window_size, has_segments=has_segments or ex.supplies_segments,
            dtype=_FLOAT_OF_SIZE.get(itemsize, jnp.bfloat16) if dtype is None else jnp.dtype(dtype),
            head_dim=self.head_dim, v_head_dim=self.v_head_dim, logits_soft_cap=self.logits_soft_cap,
            use_sinks=self.use_sinks, record_max_logits=self.record_max_logits, return_residual=self.return_residual,
            kv_len=None if seq_len is None else ex.keys_per_call(seq_len, dims.c), spans=has_spans)
        return self._filled(kv_exchange=ex, overlap_chunks=n, fused_qkv_chunks=f, kernel=kernel), c

    def check_spans(self) -> None:
        """A ValueError when span ids would change nothing under this layer's mask: spans let a query
        see later keys of its span, so they need ``is_causal`` and a window reaching right."""
        reason = spans_ignored_reason(self.is_causal, self.local_window_size)
        if reason is not None:
            left = self.local_window_size[0] if self.local_window_size else None
            fix = (f"local_window_size=({left}, {left}) with is_causal=True, so a span's tokens see each other "
                   f"within the window (a window W meaning |p_q - p_k| < W is (W - 1, W - 1))" if self.is_causal
                   else "is_causal=True for spans inside a causal stream")
            raise ValueError(f"span_ids cannot change this mask: {reason}. Drop span_ids, or use {fix}.")

    def _choice(self, dims: MeshDims, platform: str, chip: str | None, batch, seq_len, itemsize) -> Choice:
        """The rule's grouping for this layer on a mesh of ``dims`` (``_defaults.choose``)."""
        kv_bytes = hbm = None
        if batch and seq_len:
            kv_local = lcm(self.num_kv_heads, dims.t * dims.u) // (dims.t * dims.u)
            kv_bytes = (batch // dims.dp) * seq_len * kv_local * (self.head_dim + self.v_head_dim) * itemsize
            hbm = _hbm_bytes(chip)
        return choose(platform=platform, chip=chip, c=dims.c, u=dims.u, t=dims.t, num_heads=self.num_heads,
                      kv_bytes_per_device=kv_bytes, hbm_bytes=hbm, kernel=self._tpu_kernel(platform),
                      tokens_per_device=seq_len // (dims.c * dims.u) if seq_len else None)

    def _tpu_kernel(self, platform: str) -> _kernels.Kernel:
        """The local kernel the layer runs on ``platform`` as the rule sees it: splash where ``auto`` (or
        an explicit ``"splash"``) runs it on a TPU, else blockwise (the schedules differ: separate rules)."""
        splash = _kernels.SPLASH.unsupported_reason(window=self.local_window_size, max_logits=self.record_max_logits,
                                                    residual=self.return_residual) is None
        runs_splash = platform == "tpu" and self.kernel in (AUTO, _kernels.SPLASH) and splash
        return _kernels.SPLASH if runs_splash else _kernels.BLOCKWISE

    def layout(self, dims: MeshDims) -> "Layout":
        """How the heads land on a mesh of ``dims``; a ValueError when they do not divide."""
        tu, n = dims.t * dims.u, 1 if self.overlap_chunks == AUTO else self.overlap_chunks
        if self.num_heads % tu:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by tp*cp_ulysses={dims.t}*{dims.u}={tu}; "
                "choose a head count divisible by it or a smaller tp/cp_ulysses."
            )
        if self.num_heads % (tu * n):
            raise ValueError(
                f"overlap_chunks={n} does not divide the {self.num_heads // tu} query heads per device "
                f"(num_heads={self.num_heads}, tp*cp_ulysses={tu}); choose a divisor of it."
            )
        return Layout(dims, lcm(self.num_kv_heads, tu * n), self.num_kv_heads % dims.t == 0)

    def ties_chunks(self, dims: MeshDims) -> bool:
        """The chunk-to-chunk gradient tie: hybrid layouts (c > 1 and u > 1), where the exchange allows it."""
        return dims.c > 1 and dims.u > 1 and self.kv_exchange.ties_chunks


def _hbm_bytes(chip: str | None) -> int | None:
    return CHIPS[chip].device_hbm_bytes if chip in CHIPS else None


def _runs(exchange, kernel: str) -> bool:
    try:
        exchange.check_kernel(kernel)
    except ValueError:
        return False
    return True


_FLOAT_OF_SIZE = {2: jnp.bfloat16, 4: jnp.float32, 8: jnp.float64}


def partial_setattr(obj):
    return lambda name, value: object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a layer's heads land on a mesh: kv repetition and whether kv weights split over tp."""

    dims: MeshDims
    kv_expanded: int  # kv heads after minimal repetition, a multiple of t*u*chunks
    kv_sharded: bool  # kv weights split over tp (else replicated, sliced per tp rank)


def check_seq_batch(batch: int, seq_len: int, dims: MeshDims, name: str = "seq_len") -> None:
    if seq_len % dims.cp:
        raise ValueError(
            f"{name}={seq_len} is not divisible by cp_colossal*cp_ulysses={dims.c}*{dims.u}={dims.cp}; "
            "pad the sequence to a multiple of it."
        )
    if batch % dims.dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dims.dp}; use a batch that is a multiple of dp.")
