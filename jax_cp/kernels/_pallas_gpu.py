"""A fused flash-attention kernel for GPUs in Pallas (Triton lowering) that takes the mask as data.

The same contract as the blockwise kernel's ``forward``/``backward`` (``_blockwise``): explicit
positions and segment ids per token, causal, windows ``(left, right)``, soft-capping, the
log-sum-exp (so the ring merges its steps), the max-logit statistic; sinks are folded outside.
Each program owns one query block (forward, dQ) or one key block (dK/dV) of one head and loops over
the other side's blocks; a block pair its mask hides entirely is skipped (``lax.cond`` on the
block's mask), so causal, load-balanced, packed and windowed calls cost what they show. GQA reads a
kv head once per group (the dK/dV program loops over the group's query heads).

Why this and not cuDNN masks: cuDNN's masks are index patterns (causal, windows, lengths), which
cannot follow the positions a load-balanced chunk or a ring step holds, nor packed documents; one
kernel that takes positions serves every mask jax_cp has, every exchange (the ring's steps need
its log-sum-exp) and both JAX lines (tokamax's GPU kernels need Python >= 3.12 and jax >= 0.11).
Off GPU it runs in Pallas interpret mode (slow; the tests check it there).
Letters: B batch, T queries, S keys, H query heads, K kv heads, G = H/K, d head dim, dv value head dim.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_cp.kernels import _blockwise as bw
from jax_cp._platform import target_platform
from jax_cp._softmax import NEG, merge_softmax
from jax_cp._vma import unchecked, vary_as, vma

__all__ = ["BLOCKS", "MAX_HEAD_DIM", "backward", "forward", "unsupported_reason"]

BLOCKS = (64, 64)  # (block_q, block_kv) when the spec leaves them None
MAX_HEAD_DIM = 256


def unsupported_reason(*, head_dim: int, v_head_dim: int | None = None) -> str | None:
    """Why this kernel cannot serve a call (``None`` when it can)."""
    for name, d in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if d is not None and d > MAX_HEAD_DIM:
            return f"{name}={d} is above the Pallas GPU kernel's {MAX_HEAD_DIM}"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    """A call's static settings (hashable): the mask kind and the padded block layout."""

    spec: bw.Spec
    bq: int
    bk: int
    G: int
    interpret: bool
    spans: bool = False  # span ids given: two more metadata inputs (queries', keys')

    def params(self):
        return None if self.interpret else plgpu.CompilerParams(num_warps=4, num_stages=2)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _mask(qpos, qseg, kpos, kseg, spec: bw.Spec, qspan=None, kspan=None):
    """``[Q, C]`` visibility inside a program (segments always given: padding is ``-1``; span ids,
    when given, let a causal query see the later keys of its own span)."""
    mask = (qseg[:, None] == kseg[None, :]) & (kseg[None, :] >= 0)
    if spec.is_causal and qspan is not None:
        mask &= (kpos[None, :] <= qpos[:, None]) | ((qspan[:, None] == kspan[None, :]) & (qspan[:, None] != 0))
    elif spec.is_causal:
        mask &= kpos[None, :] <= qpos[:, None]
    if spec.window is not None:
        left, right = spec.window
        mask &= (kpos[None, :] >= qpos[:, None] - left) & (kpos[None, :] <= qpos[:, None] + right)
    return mask


def _any(mask):
    return jnp.max(jnp.max(mask.astype(jnp.int32), axis=1), axis=0) > 0


def _dot(a, b, trans_b=False):
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=a.dtype != jnp.float32)


def _spans(st: _Static, refs: tuple) -> tuple[tuple, tuple]:
    """``(span refs, the other refs)`` of a kernel's trailing arguments: ``(qspan, kspan)`` first
    when the call has span ids, else none."""
    return (refs[:2], refs[2:]) if st.spans else ((), refs)


def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, *refs, st: _Static):
    spec, bk = st.spec, st.bk
    span_refs, (o_ref, lse_ref, max_ref) = _spans(st, refs)
    q, qpos, qseg = q_ref[...], qpos_ref[...], qseg_ref[...]
    bq, dv = q.shape[0], o_ref.shape[-1]

    def body(j, carry):
        sl = pl.ds(j * bk, bk)
        spans = (span_refs[0][...], span_refs[1][sl]) if span_refs else ()
        mask = _mask(qpos, qseg, kpos_ref[sl], kseg_ref[sl], spec, *spans)

        def attend(carry):
            m, l, acc, mx = carry
            logits = jnp.where(mask, spec.logits_and_slope(_dot(q, k_ref[sl, :], trans_b=True))[0], NEG)
            row = jnp.max(logits, axis=1)
            m_new = jnp.maximum(m, row)
            shift = jnp.where(m_new > 0.5 * NEG, m_new, 0.0)
            p = jnp.exp(logits - shift[:, None])
            alpha = jnp.exp(m - shift)
            v = v_ref[sl, :]
            return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + _dot(p.astype(v.dtype), v), \
                jnp.maximum(mx, row)

        return lax.cond(_any(mask), attend, lambda c: c, carry)

    init = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, dv), jnp.float32),
            jnp.full((bq,), NEG, jnp.float32))
    m, l, acc, mx = lax.fori_loop(0, k_ref.shape[0] // bk, body, init)
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)
    max_ref[...] = mx


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, *refs,
               st: _Static):
    spec, bk = st.spec, st.bk
    span_refs, (dq_ref,) = _spans(st, refs)
    q, do, qpos, qseg = q_ref[...], do_ref[...], qpos_ref[...], qseg_ref[...]
    lse, delta = _safe_lse(lse_ref[...]), delta_ref[...]

    def body(j, dq):
        sl = pl.ds(j * bk, bk)
        spans = (span_refs[0][...], span_refs[1][sl]) if span_refs else ()
        mask = _mask(qpos, qseg, kpos_ref[sl], kseg_ref[sl], spec, *spans)

        def attend(dq):
            k = k_ref[sl, :]
            ds = _ds(q, k, v_ref[sl, :], do, lse, delta, mask, spec)
            return dq + _dot(ds.astype(k.dtype), k)

        return lax.cond(_any(mask), attend, lambda d: d, dq)

    dq_ref[...] = lax.fori_loop(0, k_ref.shape[0] // bk, body, jnp.zeros(dq_ref.shape, jnp.float32))


def _safe_lse(lse):
    """Rows that saw no key (``NEG``) get ``+inf``: their probabilities are exactly 0 in the backward."""
    return jnp.where(lse > 0.5 * NEG, lse, jnp.inf)


def _probs(q, k, lse, mask, spec):
    logits, slope = spec.logits_and_slope(_dot(q, k, trans_b=True))
    return jnp.exp(jnp.where(mask, logits, NEG) - lse[:, None]), slope


def _ds(q, k, v, do, lse, delta, mask, spec):
    """``dS = P * (dP - delta) * slope`` of one block pair (float32)."""
    p, slope = _probs(q, k, lse, mask, spec)
    return p * (_dot(do, v, trans_b=True) - delta[:, None]) * slope


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, *refs,
                st: _Static):
    spec, bq = st.spec, st.bq
    span_refs, (dk_ref, dv_ref) = _spans(st, refs)
    k, v, kpos, kseg = k_ref[...], v_ref[...], kpos_ref[...], kseg_ref[...]

    def body(i, carry, g):
        sl = pl.ds(i * bq, bq)
        spans = (span_refs[0][sl], span_refs[1][...]) if span_refs else ()
        mask = _mask(qpos_ref[sl], qseg_ref[sl], kpos, kseg, spec, *spans)

        def attend(carry):
            dk, dv = carry
            q, do = q_ref[sl, g, :], do_ref[sl, g, :]
            p, slope = _probs(q, k, _safe_lse(lse_ref[g, sl]), mask, spec)
            ds = p * (_dot(do, v, trans_b=True) - delta_ref[g, sl][:, None]) * slope
            return dk + _dot(ds.astype(q.dtype).T, q), dv + _dot(p.astype(do.dtype).T, do)

        return lax.cond(_any(mask), attend, lambda c: c, carry)

    carry = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    for g in range(st.G):  # the group's query heads read this kv head
        carry = lax.fori_loop(0, q_ref.shape[0] // bq, partial(body, g=g), carry)
    dk_ref[...], dv_ref[...] = carry


def _query_block_specs(G: int, bq: int, Sp: int):
    """BlockSpecs of a program that owns one query block of one head (grid ``(B, H, T/bq)``): its
    ``[B, T, H, dim]`` rows, the whole ``[B, S, K, dim]`` keys of its kv head, its ``[B, T]`` metadata
    rows, all ``[B, S]`` key metadata, its ``[B, H, T]`` statistics."""
    rows = lambda dim: pl.BlockSpec((None, bq, None, dim), lambda b, h, i: (b, i, h, 0))
    kv = lambda dim: pl.BlockSpec((None, Sp, None, dim), lambda b, h, i: (b, 0, h // G, 0))
    meta_rows, meta_keys = pl.BlockSpec((None, bq), lambda b, h, i: (b, i)), pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0))
    stat = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    return rows, kv, meta_rows, meta_keys, stat


def _f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _call(kernel, st, grid, in_specs, out_specs, out_shape, name, *args):
    call = pl.pallas_call(partial(kernel, st=st), grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=st.interpret, compiler_params=st.params(), name=name)
    run = jax.jit(call)
    if st.interpret and any(vma(a) for a in args):
        # Interpret mode evaluates the kernel's pre-traced loops, which cannot take inputs typed
        # as varying over manual mesh axes (inside shard_map): an identity host callback hands them
        # over untyped, and the interpreted kernel stays part of the program. (Running the kernel
        # inside the callback instead starts an XLA execution from a device's callback while the
        # other devices' programs wait in theirs: on XLA:CPU that can deadlock.)
        plain = lambda *a: jax.pure_callback(lambda *h: h, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in a), *a)
        out = unchecked(lambda *a: run(*plain(*a)), *args)
    else:
        out = unchecked(run, *args)  # traced unchecked (part of the program), then retyped
    return tuple(vary_as(o, *args) for o in out)


def _fwd_call(st: _Static, q, k, v, qpos, kpos, qseg, kseg, *spans):
    B, Tp, H, d = q.shape
    Sp, dv = k.shape[1], v.shape[-1]
    rows, kv, meta_rows, meta_keys, stat = _query_block_specs(st.G, st.bq, Sp)
    return _call(_fwd_kernel, st, (B, H, Tp // st.bq), [rows(d), kv(d), kv(dv), meta_rows, meta_keys, meta_rows,
                                                       meta_keys, *(meta_rows, meta_keys)[:len(spans)]],
                 [rows(dv), stat, stat], [_f32(B, Tp, H, dv), _f32(B, H, Tp), _f32(B, H, Tp)],
                 "jax_cp_flash_fwd", q, k, v, qpos, kpos, qseg, kseg, *spans)


def _bwd_call(st: _Static, q, k, v, do, lse_BHT, delta_BHT, qpos, kpos, qseg, kseg, *spans):
    B, Tp, H, d = q.shape
    Sp, K, dv = k.shape[1], k.shape[2], v.shape[-1]
    G, bq, bk = st.G, st.bq, st.bk
    args = (q, k, v, do, lse_BHT, delta_BHT, qpos, kpos, qseg, kseg, *spans)
    # dQ: one query block of one head per program, over every key block.
    rows, kv, meta_rows, meta_keys, stat = _query_block_specs(G, bq, Sp)
    dq, = _call(_dq_kernel, st, (B, H, Tp // bq), [rows(d), kv(d), kv(dv), rows(dv), stat, stat, meta_rows,
                                                   meta_keys, meta_rows, meta_keys,
                                                   *(meta_rows, meta_keys)[:len(spans)]],
                [rows(d)], [_f32(B, Tp, H, d)], "jax_cp_flash_dq", *args)
    # dK, dV: one key block of one kv head per program, over the group's heads and every query block.
    group = lambda dim: pl.BlockSpec((None, Tp, G, dim), lambda b, h, j: (b, 0, h, 0))
    block = lambda dim: pl.BlockSpec((None, bk, None, dim), lambda b, h, j: (b, j, h, 0))
    gstat = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
    qrows, kblock = pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)), pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
    dk, dvv = _call(_dkv_kernel, st, (B, K, Sp // bk), [group(d), block(d), block(dv), group(dv), gstat, gstat, qrows,
                                                        kblock, qrows, kblock, *(qrows, kblock)[:len(spans)]],
                    [block(d), block(dv)], [_f32(B, Sp, K, d), _f32(B, Sp, K, dv)], "jax_cp_flash_dkv", *args)
    return dq, dk, dvv


def _layout(spec: bw.Spec, q, k, interpret: bool, spans: bool = False) -> _Static:
    bq, bk = (spec.block_q or BLOCKS[0]), (spec.block_kv or BLOCKS[1])
    bq, bk = min(_pow2(bq), _pow2(q.shape[1])), min(_pow2(bk), _pow2(k.shape[1]))
    return _Static(spec, max(bq, 16 if not interpret else 1), max(bk, 16 if not interpret else 1),
                   q.shape[2] // k.shape[2], interpret, spans)


def _prepare(x, length: int, width: int):
    """``[B, L, N, d]`` padded with zeros to ``length`` tokens and a ``width`` head dim."""
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, width - x.shape[-1])))


def _meta(m: bw.Meta, batch: int, length: int):
    """``[B, L]`` positions and segment ids for the kernel, padded (``_blockwise._pad_meta``); padding and
    invalid tokens get segment ``-1``."""
    full = lambda a: None if a is None else jnp.broadcast_to(a, (batch, a.shape[-1]))
    m = bw._pad_meta(bw.Meta(full(m.pos), full(m.seg), full(m.valid)), length)
    return m.pos, jnp.where(m.valid, jnp.zeros_like(m.pos) if m.seg is None else m.seg, -1)


def _padded(st: _Static, q, k, v, qm, km):
    """Padded ``q, k, v``, the queries' and keys' positions and segment ids, then (span ids given)
    the queries' and keys' span ids (``0`` in padding)."""
    T, S = q.shape[1], k.shape[1]
    Tp, Sp = -(-T // st.bq) * st.bq, -(-S // st.bk) * st.bk
    dp, dvp = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    B = q.shape[0]
    spans = ()
    if st.spans:
        full = lambda a, n: bw._pad(jnp.broadcast_to(a, (B, a.shape[-1])), n)
        spans = (full(qm.span, Tp), full(km.span, Sp))
    return (_prepare(q, Tp, dp), _prepare(k, Sp, dp), _prepare(v, Sp, dvp), *_meta(qm, B, Tp), *_meta(km, B, Sp),
            *spans)


def _interpret() -> bool:
    return target_platform() != "gpu"


def forward(q_BTHd, k_BSKd, v_BSKd, qm: bw.Meta, km: bw.Meta, spec: bw.Spec, state=None):
    """As ``_blockwise.forward``: ``(o float32, lse float32[, max])``; ``state=(o, lse)`` of earlier keys
    is merged in (by log-sum-exp, after the kernel)."""
    T, dv = q_BTHd.shape[1], v_BSKd.shape[-1]
    st = _layout(spec, q_BTHd, k_BSKd, _interpret(), qm.span is not None)
    q, k, v, qpos, qseg, kpos, kseg, *spans = _padded(st, q_BTHd, k_BSKd, v_BSKd, qm, km)
    o, lse, mx = _fwd_call(st, q, k, v, qpos, kpos, qseg, kseg, *spans)
    o, lse, mx = o[:, :T, :, :dv], jnp.swapaxes(lse, 1, 2)[:, :T], jnp.swapaxes(mx, 1, 2)[:, :T]
    if state is not None:
        o, lse = merge_softmax(state, (o, lse))
    return (o, lse, mx) if spec.max_logits else (o, lse)


def backward(q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm: bw.Meta, km: bw.Meta, spec: bw.Spec, dq=None):
    """As ``_blockwise.backward``: ``(dq, dk, dv)`` float32 given the final ``lse`` and ``delta``."""
    T, S, d, dv = q_BTHd.shape[1], k_BSKd.shape[1], q_BTHd.shape[-1], v_BSKd.shape[-1]
    st = _layout(spec, q_BTHd, k_BSKd, _interpret(), qm.span is not None)
    q, k, v, qpos, qseg, kpos, kseg, *spans = _padded(st, q_BTHd, k_BSKd, v_BSKd, qm, km)
    Tp = q.shape[1]
    do = _prepare(do_BTHd, Tp, v.shape[-1]).astype(q.dtype)
    stat = lambda a, fill: jnp.pad(jnp.swapaxes(a, 1, 2).astype(jnp.float32), ((0, 0), (0, 0), (0, Tp - T)),
                                   constant_values=fill)
    dq_, dk, dv_ = _bwd_call(st, q, k, v, do, stat(lse_BTH, NEG), stat(delta_BTH, 0.0), qpos, kpos, qseg, kseg, *spans)
    dq_ = dq_[:, :T, :, :d]
    return (dq_ if dq is None else dq + dq_), dk[:, :S, :, :d], dv_[:, :S, :, :dv]
