"""Blockwise online-softmax attention in plain JAX: memory linear in the sequence.

Forward: for each query block, loop over the key blocks its mask can reach
(decided from per-block position and segment ranges, so hidden blocks cost
nothing), merging them with an online softmax in float32 (float64 for float64
inputs: ``acc_dtype``). Backward (flash-attention-2 style): keep only the
log-sum-exp, recompute scores block by block. ``forward``/``backward`` expose
the (output, lse) halves for the ring.
Letters: B batch, T queries, S keys, H query heads, K kv heads, G=H/K, d head
dim, N/M query/key blocks, Q/C query/key block size.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._checks import check_scale
from jax_cp._masks import Window, normalize_window, visible
from jax_cp._softmax import NEG, acc_dtype, check_soft_cap, fold_sinks, head_max, sinks_grad, varying_sinks
from jax_cp._platform import target_platform
from jax_cp._remat import name_attention_residuals
from jax_cp._vma import varying
from jax_cp.kernels._base import scaled_query

__all__ = ["blockwise_attention", "Spec", "Meta", "make_spec", "auto_blocks", "check_block", "forward", "backward"]

_IMAX, _IMIN = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min


class Meta(NamedTuple):
    """Per-token mask metadata of one side: positions, segment ids (or None), validity."""

    pos: jax.Array  # [B, L] int32
    seg: jax.Array | None  # [B, L] int32
    valid: jax.Array | None = None  # [B, L] bool; None means all valid
    span: jax.Array | None = None  # [B, L] int32 bidirectional span ids (0: none), or None


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static choices of one call: mask kind, softmax scale, block sizes."""

    is_causal: bool
    window: Window
    scale: float
    block_q: int | None  # None: auto_blocks
    block_kv: int | None
    soft_cap: float | None = None  # logits -> soft_cap * tanh(logits / soft_cap), before the mask
    max_logits: bool = False  # forward also returns each row's largest visible logit
    residual: bool = False  # the attention also returns its log-sum-exp (differentiable)
    # (forward, backward) of a kernel running this algorithm as fused code of its own (the Pallas GPU
    # kernel, which hands them in), with the contracts of ``forward``/``backward``; None: this module.
    fused: tuple | None = None

    def logits_and_slope(self, s):
        """``(logits, d logits / d s)`` of the raw scores ``s``: scaled, then soft-capped if set (one
        formula for the forward and the backward's recompute); without a cap the slope is ``scale``."""
        if self.soft_cap is None:
            return s * self.scale, self.scale
        t = jnp.tanh(s * (self.scale / self.soft_cap))
        return self.soft_cap * t, self.scale * (1.0 - t * t)


def check_block(name: str, value) -> int | None:
    """A block size: a positive int, or ``None`` (``auto_blocks`` picks it from the shapes).

    Args:
        name: the argument's name, for the message.
        value: the block size given.

    Returns:
        ``value``.

    Raises:
        ValueError: ``value`` is neither a positive int nor ``None``.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int (e.g. 512) or None (chosen from the shapes "
                         "and the platform).")
    return value


def make_spec(head_dim: int, *, is_causal=False, local_window_size=None, scale=None,
              block_q: int | None = None, block_kv: int | None = None, logits_soft_cap=None,
              return_max_logits: bool = False, return_residual: bool = False, fused: tuple | None = None) -> Spec:
    return Spec(bool(is_causal), normalize_window(local_window_size),
                head_dim**-0.5 if scale is None else check_scale(scale),
                check_block("block_q", block_q), check_block("block_kv", block_kv),
                check_soft_cap(logits_soft_cap), bool(return_max_logits), bool(return_residual), fused)


# The default blocks, measured (benchmarks/kernel_speed.py, RESULTS "Local attention kernels"): on
# the CPU, 1024 query rows x 512 keys ran at or near the plain-matmul rate at 1 to 8 local heads
# (smaller tiles were slower: each loop step has a fixed cost and the dots run best large); the
# score tile is capped at CPU_TILE_BYTES for many heads or a large batch. Elsewhere the blockwise
# kernel is the fallback under splash/cuDNN and keeps 512 x 512 (what the TPU schedules in
# benchmarks/RESULTS.md were compiled with).
CPU_BLOCKS = (1024, 512)
CPU_TILE_BYTES = 16 * 2**20
OTHER_BLOCKS = (512, 512)


def auto_blocks(batch: int, heads: int, platform: str | None = None, *, q_len: int | None = None,
                masked: bool = False) -> tuple[int, int]:
    """``(block_q, block_kv)`` for ``batch x heads`` local score tiles on ``platform``.

    On CPU, a ``masked`` (causal or windowed) call's query blocks are at most half its ``q_len``
    queries: a load-balanced chunk is two runs of positions, which one block spanning both would
    never let a key block skip (ring, 8 heads, 8K causal load-balanced, fwd+bwd: 4.6 s at 1024-row
    blocks, 3.0 s at 512; without load balancing 4.4 and 3.0 s).

    Args:
        batch: the local batch.
        heads: the local heads.
        platform: the platform (default: the platform being compiled for).
        q_len: the local queries.
        masked: the call is causal or windowed.

    Returns:
        ``(block_q, block_kv)``.
    """
    if platform is None:
        platform = target_platform()
    if platform != "cpu":
        return OTHER_BLOCKS
    bq, bk = CPU_BLOCKS
    while bq > 128 and (batch * heads * bq * bk * 4 > CPU_TILE_BYTES or masked and q_len and bq > q_len // 2):
        bq //= 2
    return bq, bk


def _padded_blocks(spec: Spec, q_BTHd, k_BSKd) -> tuple[int, int, int, int]:
    """``(block_q, padded T, block_kv, padded S)``: the spec's blocks (``auto_blocks`` for those it
    leaves ``None``), clamped to the lengths."""
    (B, T, H), S = q_BTHd.shape[:3], k_BSKd.shape[1]
    block_q, block_kv = spec.block_q, spec.block_kv
    if block_q is None or block_kv is None:
        auto_q, auto_kv = auto_blocks(B, H, q_len=T, masked=spec.is_causal or spec.window is not None)
        block_q, block_kv = block_q or auto_q, block_kv or auto_kv
    return (*_blocks(T, block_q), *_blocks(S, block_kv))


def _blocks(length: int, block: int) -> tuple[int, int]:
    """Block size clamped to the sequence, and the padded length."""
    block = min(block, length)
    return block, -(-length // block) * block


def _pad(x, length: int, value=0):
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _pad_meta(m: Meta, length: int) -> Meta:
    """Pads to ``length`` with invalid tokens; negative segment ids (padding) are invalid too."""
    valid = jnp.ones(m.pos.shape, bool) if m.valid is None else m.valid
    if m.seg is not None:
        valid &= m.seg >= 0
    return Meta(_pad(m.pos, length), _pad(m.seg, length), _pad(valid, length, False), _pad(m.span, length))


def _ranges(x_BL, valid_BL, block: int):
    """Min and max of ``x`` over the valid entries of each block: ``[B, L/block]`` each."""
    B, L = x_BL.shape
    x, v = x_BL.reshape(B, L // block, block), valid_BL.reshape(B, L // block, block)
    return jnp.where(v, x, _IMAX).min(-1), jnp.where(v, x, _IMIN).max(-1)


def block_visible(qm: Meta, km: Meta, spec: Spec, bq: int, bk: int):
    """``vis_NM``: may any query of block n see any key of block m (for some batch row)."""
    qlo, qhi = (a[:, :, None] for a in _ranges(qm.pos, qm.valid, bq))
    klo, khi = (a[:, None, :] for a in _ranges(km.pos, km.valid, bk))
    vis = (qlo <= qhi) & (klo <= khi)  # both blocks hold a valid token
    if spec.is_causal and qm.span is not None:  # a span can make a block above the diagonal visible
        in_q, in_k = qm.valid & (qm.span != 0), km.valid & (km.span != 0)
        alo, ahi = (a[:, :, None] for a in _ranges(qm.span, in_q, bq))
        blo, bhi = (a[:, None, :] for a in _ranges(km.span, in_k, bk))
        vis &= (klo <= qhi) | ((alo <= bhi) & (blo <= ahi))
    elif spec.is_causal:
        vis &= klo <= qhi
    if spec.window is not None:
        left, right = spec.window
        vis &= (khi >= qlo - left) & (klo <= qhi + right)
    if qm.seg is not None:
        slo, shi = (a[:, :, None] for a in _ranges(qm.seg, qm.valid, bq))
        tlo, thi = (a[:, None, :] for a in _ranges(km.seg, km.valid, bk))
        vis &= (tlo <= shi) & (thi >= slo)
    return vis.any(0)


def _schedule(vis_NM):
    """Per row: the visible column indices first (``order``), and how many (``count``)."""
    return jnp.argsort(~vis_NM, axis=1, stable=True).astype(jnp.int32), vis_NM.sum(1).astype(jnp.int32)


def _block_mask(qb: tuple, kb: tuple, spec: Spec, has_seg: bool):
    """``[B, 1, 1, Q, C]`` visibility of one block pair, padding included, from each side's
    ``_meta_blocks`` (``(pos, seg, valid[, span])``; ``seg`` is a placeholder, ignored, without
    segment ids)."""
    (qpos, qseg, qval, *qspan), (kpos, kseg, kval, *kspan) = qb, kb
    qseg, kseg = (qseg, kseg) if has_seg else (None, None)
    m = visible(qpos, kpos, qseg, kseg, is_causal=spec.is_causal, window=spec.window,
                q_span_BT=qspan[0] if qspan else None, kv_span_BS=kspan[0] if kspan else None)
    return (m & qval[:, :, None] & kval[:, None, :])[:, None, None]


def _split(x, block: int):
    """``[B, L, ...] -> [L/block, B, block, ...]``."""
    B, L = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, L // block, block, *x.shape[2:]), 1, 0)


def _meta_blocks(m: Meta, block: int) -> tuple:
    """``(pos, seg, valid[, span])`` cut into ``[L/block, B, block]`` blocks (span only when given)."""
    seg = m.pos if m.seg is None else m.seg  # placeholder when absent (ignored by the mask)
    span = () if m.span is None else (_split(m.span, block),)
    return _split(m.pos, block), _split(seg, block), _split(m.valid, block), *span


def _blocks_major(x, block: int, axes):
    """``x [B, L, *rest]`` cut into ``L/block`` blocks and transposed once, before the block loops,
    to ``[L/block, *axes order]``: ``axes`` orders ``(0 batch, 1 in-block position, 2.. rest)``."""
    B, L = x.shape[:2]
    x = x.reshape(B, L // block, block, *x.shape[2:])
    return jnp.transpose(x, (1, *(a if a == 0 else a + 1 for a in axes)))


def _safe(m):
    """A softmax shift that is ``0`` for rows that saw no key (``m = NEG``): their masked scores
    (``NEG``) then give ``exp(NEG) = 0`` with no second select on the score tile."""
    return jnp.where(m > 0.5 * NEG, m, 0.0)


def _init_state(refs, shape, d: int, spec: Spec, o0, lse0, dtype):
    """The loop's softmax state ``(m, l, acc[, max])`` in ``dtype`` for one query block of
    ``shape = (B, K, G, Q)``."""
    if o0 is None:
        init = varying(refs, jnp.full(shape, NEG, dtype), jnp.zeros(shape, dtype), jnp.zeros((*shape, d), dtype))
    else:  # continue from a normalised (o, lse): the softmax state (m=lse, l=1, acc=o)
        init = (lse0, *varying(refs, jnp.ones(shape, dtype)), o0)
    return init + (varying(refs, jnp.full(shape, NEG, dtype)) if spec.max_logits else ())


def _fwd_padded(q_BTHd, k_BSKd, v_BSKd, qm: Meta, km: Meta, spec: Spec, bq: int, bk: int, state=None):
    """Head-major blocks, laid out once so every dot in the loop is a plain batched matmul
    (``[B K, G Q, d] @ [B K, d, C]``, ``[B K, G Q, C] @ [B K, C, d]``): no per-block transpose."""
    B, T, H, d = q_BTHd.shape
    K, dv = k_BSKd.shape[2], v_BSKd.shape[-1]  # dv: the value head dim (MLA: not d)
    G, acc_t = H // K, acc_dtype(q_BTHd.dtype)
    has_seg = qm.seg is not None
    order_NM, count_N = _schedule(block_visible(qm, km, spec, bq, bk))
    q_NBKGQd = _blocks_major(q_BTHd.reshape(B, T, K, G, d), bq, (0, 2, 3, 1, 4))
    kT_MBKdC = _blocks_major(k_BSKd, bk, (0, 2, 3, 1))
    v_MBKCd = _blocks_major(v_BSKd, bk, (0, 2, 1, 3))
    kb = _meta_blocks(km, bk)
    refs = (q_BTHd, k_BSKd, v_BSKd, qm, km, state)

    def q_block(xs):
        q, qb, order, count, o0, lse0 = xs

        def body(n, carry):
            m, l, acc = carry[:3]
            j = order[n]
            s = jnp.einsum("bkgqd,bkdc->bkgqc", q, kT_MBKdC[j], preferred_element_type=acc_t)
            mask = _block_mask(qb, tuple(a[j] for a in kb), spec, has_seg)
            s = jnp.where(mask, spec.logits_and_slope(s)[0], NEG)  # the one select on the tile
            row = s.max(-1)
            m_new = jnp.maximum(m, row)
            shift = _safe(m_new)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            v = v_MBKCd[j]
            pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), v, preferred_element_type=acc_t)
            stat = (jnp.maximum(carry[3], row),) if spec.max_logits else ()  # the visible logits' max
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv, *stat

        m, l, acc, *stat = lax.fori_loop(0, count, body, _init_state(refs, (B, K, G, bq), dv, spec, o0, lse0, acc_t))
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]
        return o, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG), *stat  # [B, K, G, Q, (d)]

    qb = _meta_blocks(qm, bq)
    o0 = lse0 = None
    if state is not None:
        o0 = _blocks_major(state[0].reshape(B, T, K, G, dv), bq, (0, 2, 3, 1, 4))
        lse0 = _blocks_major(state[1].reshape(B, T, K, G), bq, (0, 2, 3, 1))
    o, *rows = lax.map(q_block, (q_NBKGQd, qb, order_NM, count_N, o0, lse0))
    o = jnp.transpose(o, (1, 0, 4, 2, 3, 5)).reshape(B, T, H, dv)  # [N, B, K, G, Q, dv] -> [B, T, H, dv]
    return o, *(jnp.transpose(r, (1, 0, 4, 2, 3)).reshape(B, T, H) for r in rows)  # lse (and max): [B, T, H]


def _bwd_padded(q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm, km, spec: Spec, bq: int, bk: int,
                dq_BTHd=None):
    """Flash-attention-2 backward over the same head-major blocks; ``q`` and ``do`` are also kept
    transposed (``[B K, d, G Q]``) so that ``dK^T``/``dV^T`` accumulate by plain batched matmuls."""
    B, T, H, d = q_BTHd.shape
    K, dv, G, acc_t = k_BSKd.shape[2], v_BSKd.shape[-1], H // k_BSKd.shape[2], acc_dtype(q_BTHd.dtype)
    has_seg = qm.seg is not None
    refs = (q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm, km)
    order_MN, count_M = _schedule(block_visible(qm, km, spec, bq, bk).T)
    # [N, B, K, G, Q, d] and [N, B, K, d, G, Q] (d: the array's own head dim; do's is the value one)
    rows = lambda a: _blocks_major(a.reshape(B, T, K, G, a.shape[-1]), bq, (0, 2, 3, 1, 4))
    cols = lambda a: _blocks_major(a.reshape(B, T, K, G, a.shape[-1]), bq, (0, 2, 4, 3, 1))
    q_N, qT_N, do_N, doT_N = rows(q_BTHd), cols(q_BTHd), rows(do_BTHd), cols(do_BTHd)
    lse_N, delta_N = (_blocks_major(a.reshape(B, T, K, G), bq, (0, 2, 3, 1)) for a in (lse_BTH, delta_BTH))
    qb = _meta_blocks(qm, bq)

    def kv_block(dq_N, xs):
        k, kT, vT, kb, order, count = xs

        def body(n, carry):
            dq_N, dkT, dvT = carry
            i = order[n]
            s = jnp.einsum("bkgqd,bkdc->bkgqc", q_N[i], kT, preferred_element_type=acc_t)
            mask = _block_mask(tuple(a[i] for a in qb), kb, spec, has_seg)
            logits, slope = spec.logits_and_slope(s)
            p = jnp.exp(jnp.where(mask, logits, NEG) - _safe(lse_N[i])[..., None])
            do = do_N[i]
            dvT = dvT + jnp.einsum("bkdgq,bkgqc->bkdc", doT_N[i], p.astype(do.dtype), preferred_element_type=acc_t)
            dp = jnp.einsum("bkgqd,bkdc->bkgqc", do, vT, preferred_element_type=acc_t)
            ds = (p * (dp - delta_N[i][..., None]) * slope).astype(q_BTHd.dtype)
            dkT = dkT + jnp.einsum("bkdgq,bkgqc->bkdc", qT_N[i], ds, preferred_element_type=acc_t)
            dq = jnp.einsum("bkgqc,bkcd->bkgqd", ds, k, preferred_element_type=acc_t)
            return dq_N.at[i].add(dq), dkT, dvT

        zeros = jnp.zeros((B, K, d, bk), acc_t)
        zeros_v = zeros if dv == d else jnp.zeros((B, K, dv, bk), acc_t)
        dq_N, dkT, dvT = lax.fori_loop(0, count, body, (dq_N, *varying(refs, zeros, zeros_v)))
        return dq_N, (dkT, dvT)

    xs = (_blocks_major(k_BSKd, bk, (0, 2, 1, 3)), _blocks_major(k_BSKd, bk, (0, 2, 3, 1)),
          _blocks_major(v_BSKd, bk, (0, 2, 3, 1)), _meta_blocks(km, bk), order_MN, count_M)
    if dq_BTHd is None:
        dq0, = varying(refs, jnp.zeros((T // bq, B, K, G, bq, d), acc_t))
    else:
        dq0 = rows(dq_BTHd)
    dq_N, (dkT, dvT) = lax.scan(kv_block, dq0, xs)
    dq = jnp.transpose(dq_N, (1, 0, 4, 2, 3, 5)).reshape(B, T, H, d)
    from_T = lambda a: jnp.transpose(a, (1, 0, 4, 2, 3)).reshape(B, -1, K, a.shape[3])  # [M, B, K, d, C] -> [B, S, K, d]
    return dq, from_T(dkT), from_T(dvT)


def forward(q_BTHd, k_BSKd, v_BSKd, qm: Meta, km: Meta, spec: Spec, state=None):
    """``(o_BTHd, lse_BTH)`` in ``acc_dtype``; rows that see no key: ``o = 0``, ``lse = NEG``.
    With ``spec.max_logits`` also ``max_BTH``: each row's largest visible logit (``NEG`` if none).

    ``state=(o, lse)`` of earlier keys continues that softmax (the ring's merge,
    without a second output buffer); the max covers this call's keys only.
    With ``spec.fused`` (the Pallas GPU kernel) that kernel computes it, with the same contract.
    """
    if spec.fused is not None:
        return spec.fused[0](q_BTHd, k_BSKd, v_BSKd, qm, km, spec, state)
    T, S = q_BTHd.shape[1], k_BSKd.shape[1]
    bq, Tp, bk, Sp = _padded_blocks(spec, q_BTHd, k_BSKd)
    if state is not None:
        state = (_pad(state[0], Tp), _pad(state[1], Tp, NEG))
    out = _fwd_padded(_pad(q_BTHd, Tp), _pad(k_BSKd, Sp), _pad(v_BSKd, Sp),
                      _pad_meta(qm, Tp), _pad_meta(km, Sp), spec, bq, bk, state)
    return tuple(x[:, :T] for x in out)


def backward(q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm: Meta, km: Meta, spec: Spec, dq=None):
    """``(dq, dk, dv)`` in ``acc_dtype`` given the final ``lse`` and ``delta = sum(do * o, -1)``.

    Linear in the keys: calling it per key chunk with the global ``lse`` and
    ``delta`` and summing gives the full gradient (what the ring does; ``dq``
    is added to, in place).
    """
    if spec.fused is not None:
        return spec.fused[1](q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm, km, spec, dq)
    T, S = q_BTHd.shape[1], k_BSKd.shape[1]
    bq, Tp, bk, Sp = _padded_blocks(spec, q_BTHd, k_BSKd)
    dq, dk, dv = _bwd_padded(_pad(q_BTHd, Tp), _pad(k_BSKd, Sp), _pad(v_BSKd, Sp), _pad(do_BTHd, Tp),
                             _pad(lse_BTH, Tp), _pad(delta_BTH, Tp), _pad_meta(qm, Tp), _pad_meta(km, Sp),
                             spec, bq, bk, None if dq is None else _pad(dq, Tp))
    return dq[:, :T], dk[:, :S], dv[:, :S]


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, qm, km, sinks, spec):
    return _attention_fwd(q, k, v, qm, km, sinks, spec)[0]


def _attention_fwd(q, k, v, qm, km, sinks, spec):
    o, lse, *row_max = forward(q, k, v, qm, km, spec)
    o, lse = fold_sinks(o, lse, sinks)
    o, lse = name_attention_residuals(o.astype(q.dtype), lse)
    return outputs(spec, o, lse, row_max), (q, k, v, o, lse, qm, km, sinks)


def _attention_bwd(spec, res, do):
    q, k, v, o, lse, qm, km, sinks = res
    do, delta = output_cotangent(spec, do, o)
    dq, dk, dv = backward(q, k, v, do, lse, delta, qm, km, spec)
    zero_meta = lambda m: jax.tree.map(lambda _: None, m)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_meta(qm), zero_meta(km),
            sinks_grad(sinks, lse, delta))


def outputs(spec: Spec, o, lse_BTH, row_max):
    """What the attention returns: ``o``, then what ``spec`` asks for: the per-head max logit
    (``head_max``), the log-sum-exp ``[B, T, H]`` in ``acc_dtype`` (``-inf`` for rows that see no key)."""
    extra = (head_max(row_max[0]),) if spec.max_logits else ()
    if spec.residual:
        extra += (jnp.where(lse_BTH > 0.5 * NEG, lse_BTH, -jnp.inf),)
    return (o, *extra) if extra else o


def output_cotangent(spec: Spec, ct, o):
    """``(do, delta)`` from the cotangent of ``outputs``: ``delta = sum(do * o, -1) - d lse``, since
    ``d lse / d s = p`` adds ``p * d lse`` to every score's gradient (the statistic has none)."""
    do, dlse = (ct[0], ct[-1] if spec.residual else None) if spec.max_logits or spec.residual else (ct, None)
    acc = acc_dtype(o.dtype)
    delta = jnp.einsum("...d,...d->...", do.astype(acc), o.astype(acc))
    if dlse is not None:
        delta = delta - jnp.where(jnp.isfinite(dlse), dlse, 0.0).astype(acc)
    return do, delta


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, block_q: int | None = None, block_kv: int | None = None,
    logits_soft_cap: float | None = None, sinks=None, return_max_logits: bool = False, return_residual: bool = False,
    fused: tuple | None = None, q_span_ids=None, kv_span_ids=None,
):
    """Masked attention with memory linear in ``S``; same contract as ``dense_attention``.

    Block sizes are clamped to the sequence; lengths they do not divide are padded with masked
    tokens. Fully masked blocks are skipped (causal costs about half); rows that see no key return
    zeros with zero gradients. The soft cap and the sinks get their exact gradients.

    Args:
        q_BTHd, k_BSKd, v_BSKd: the local queries, keys and values.
        q_positions, kv_positions, q_segment_ids, kv_segment_ids: positions and document ids
            (segment ids on both sides or neither).
        is_causal, local_window_size, scale: the mask (the window's bounds inclusive, as jax.nn's) and
            the logit scale (a traced one is multiplied into the queries: ``scaled_query``).
        block_q, block_kv: tile sizes; default ``auto_blocks`` (batch, heads, platform).
        logits_soft_cap: ``c`` caps the scaled logits to ``c * tanh(logits / c)`` before the mask (Gemma 2).
        sinks: ``[H]``, a learned logit per query head in every row's softmax denominator, no value (GPT-OSS).
        return_max_logits: also return ``max_logits [H]``: per query head, the largest logit
            that entered the softmax (scaled, soft-capped if set; visible pairs only; ``-inf``
            if none), no gradient.
        return_residual: append the log-sum-exp of each row's logits (``[B, T, H]`` float32,
            float64 for float64 inputs: ``acc_dtype``; sinks included; ``-inf`` for rows that
            see no key), differentiable.
        fused: ``(forward, backward)`` runs the same algorithm as fused code of another
            kernel's (the Pallas GPU kernel's).
        q_span_ids, kv_span_ids: bidirectional span ids (both sides or neither; not with ``fused``).

    Returns:
        ``o``, or ``(o, max_logits)`` and/or the residual appended.

    Raises:
        ValueError: one side only has segment or span ids, or an argument is invalid.
    """
    q_BTHd, scale = scaled_query(q_BTHd, scale)
    spec = make_spec(q_BTHd.shape[-1], is_causal=is_causal, local_window_size=local_window_size,
                     scale=scale, block_q=block_q, block_kv=block_kv, logits_soft_cap=logits_soft_cap,
                     return_max_logits=return_max_logits, return_residual=return_residual, fused=fused)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must both be given or both be None.")
    i32 = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
    if (q_span_ids is None) != (kv_span_ids is None):
        raise ValueError("q_span_ids and kv_span_ids must both be given or both be None.")
    qm = Meta(i32(q_positions), i32(q_segment_ids), span=i32(q_span_ids))
    km = Meta(i32(kv_positions), i32(kv_segment_ids), span=i32(kv_span_ids))
    sinks = varying_sinks(sinks, q_BTHd, k_BSKd, v_BSKd, qm, km)
    return _attention(q_BTHd, k_BSKd, v_BSKd, qm, km, sinks, spec)


