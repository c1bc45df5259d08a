"""Blockwise online-softmax attention in plain JAX: memory linear in the sequence.

Forward: for each query block, loop over the key blocks its mask can reach
(decided from per-block position and segment ranges, so hidden blocks cost
nothing), merging them with an online softmax in float32. Backward
(flash-attention-2 style): keep only the log-sum-exp, recompute scores block by
block. ``forward``/``backward`` expose the (output, lse) halves for the ring.
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

from jax_cp._masks import Window, normalize_window, visible

__all__ = ["blockwise_attention", "Spec", "Meta", "make_spec", "forward", "backward", "varying", "vma", "NEG"]

NEG = -1e30  # finite minus-infinity: masked scores, and the lse of rows that see no key
_IMAX, _IMIN = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min


class Meta(NamedTuple):
    """Per-token mask metadata of one side: positions, segment ids (or None), validity."""

    pos: jax.Array  # [B, L] int32
    seg: jax.Array | None  # [B, L] int32
    valid: jax.Array | None = None  # [B, L] bool; None means all valid


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static choices of one call: mask kind, softmax scale, block sizes."""

    is_causal: bool
    window: Window
    scale: float
    block_q: int
    block_kv: int


def _check_block(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (e.g. 512).")
    return value


def make_spec(head_dim: int, *, is_causal=False, local_window_size=None, scale=None,
              block_q: int = 512, block_kv: int = 512) -> Spec:
    return Spec(bool(is_causal), normalize_window(local_window_size),
                float(head_dim**-0.5 if scale is None else scale),
                _check_block("block_q", block_q), _check_block("block_kv", block_kv))


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
    return Meta(_pad(m.pos, length), _pad(m.seg, length), _pad(valid, length, False))


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
    if spec.is_causal:
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


def _block_mask(qpos, qseg, qval, kpos, kseg, kval, spec: Spec):
    """``[B, 1, 1, Q, C]`` visibility of one block pair, padding included."""
    m = visible(qpos, kpos, qseg, kseg, is_causal=spec.is_causal, window=spec.window)
    return (m & qval[:, :, None] & kval[:, None, :])[:, None, None]


def _split(x, block: int):
    """``[B, L, ...] -> [L/block, B, block, ...]``."""
    B, L = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, L // block, block, *x.shape[2:]), 1, 0)


def _merge(x, batch_axis: int = 1):
    """Inverse of ``_split``: ``[N, B, Q, ...] -> [B, N*Q, ...]``."""
    x = jnp.moveaxis(x, 0, batch_axis)
    return x.reshape(*x.shape[:batch_axis], -1, *x.shape[batch_axis + 2:])


def vma(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older releases call it ``vma``
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying(refs, *xs):
    """Marks fresh loop carries as varying over the manual mesh axes the inputs vary over.

    Inside ``jax.shard_map`` loop carries must keep one type; zeros start out
    invariant while the updates vary with the data.
    """
    axes = frozenset().union(*(vma(r) for r in jax.tree.leaves(refs)))
    if not axes:
        return xs
    return tuple(lax.pcast(x, tuple(sorted(axes)), to="varying") for x in xs)


def _meta_blocks(m: Meta, block: int):
    seg = m.pos if m.seg is None else m.seg  # placeholder when absent (ignored by the mask)
    return _split(m.pos, block), _split(seg, block), _split(m.valid, block)


def _fwd_padded(q_BTHd, k_BSKd, v_BSKd, qm: Meta, km: Meta, spec: Spec, bq: int, bk: int, state=None):
    B, T, H, d = q_BTHd.shape
    K = k_BSKd.shape[2]
    G = H // K
    has_seg = qm.seg is not None
    order_NM, count_N = _schedule(block_visible(qm, km, spec, bq, bk))
    q_NBQKGd = _split(q_BTHd.reshape(B, T, K, G, d), bq)
    k_MBCKd, v_MBCKd = _split(k_BSKd, bk), _split(v_BSKd, bk)
    kpos, kseg, kval = _meta_blocks(km, bk)

    def q_block(xs):
        q, qpos, qseg, qval, order, count, o0, lse0 = xs

        def body(n, carry):
            m, l, acc = carry
            j = order[n]
            k, v = k_MBCKd[j], v_MBCKd[j]
            s = jnp.einsum("bqkgd,bckd->bkgqc", q, k, preferred_element_type=jnp.float32) * spec.scale
            mask = _block_mask(qpos, qseg if has_seg else None, qval, kpos[j],
                               kseg[j] if has_seg else None, kval[j], spec)
            s = jnp.where(mask, s, NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqc,bckd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        if o0 is None:
            init = varying((q_BTHd, k_BSKd, v_BSKd, qm, km), jnp.full((B, K, G, bq), NEG, jnp.float32),
                            jnp.zeros((B, K, G, bq), jnp.float32), jnp.zeros((B, K, G, bq, d), jnp.float32))
        else:  # continue from a normalised (o, lse): the softmax state (m=lse, l=1, acc=o)
            init = (jnp.moveaxis(lse0, 1, 3), *varying(refs, jnp.ones((B, K, G, bq), jnp.float32)),
                    jnp.moveaxis(o0, 1, 3))
        m, l, acc = lax.fori_loop(0, count, body, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG)
        return jnp.moveaxis(o, 3, 1), jnp.moveaxis(lse, 3, 1)  # [B, Q, K, G, d], [B, Q, K, G]

    qpos, qseg, qval = _meta_blocks(qm, bq)
    refs = (q_BTHd, k_BSKd, v_BSKd, qm, km, state)
    o0, lse0 = (None, None) if state is None else (_split(state[0].reshape(B, T, K, G, d), bq),
                                                 _split(state[1].reshape(B, T, K, G), bq))
    o, lse = lax.map(q_block, (q_NBQKGd, qpos, qseg, qval, order_NM, count_N, o0, lse0))
    return _merge(o).reshape(B, T, H, d), _merge(lse).reshape(B, T, H)


def _bwd_padded(q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm, km, spec: Spec, bq: int, bk: int,
                dq_BTHd=None):
    B, T, H, d = q_BTHd.shape
    S, K = k_BSKd.shape[1:3]
    G = H // K
    has_seg = qm.seg is not None
    refs = (q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm, km)
    order_MN, count_M = _schedule(block_visible(qm, km, spec, bq, bk).T)
    q_N, do_N = (_split(a.reshape(B, T, K, G, d), bq) for a in (q_BTHd, do_BTHd))
    lse_N, delta_N = (jnp.moveaxis(_split(a.reshape(B, T, K, G), bq), 2, 4) for a in (lse_BTH, delta_BTH))
    qpos, qseg, qval = _meta_blocks(qm, bq)

    def kv_block(dq_N, xs):
        k, v, kpos, kseg, kval, order, count = xs

        def body(n, carry):
            dq_N, dk, dv = carry
            i = order[n]
            q, do = q_N[i], do_N[i]
            s = jnp.einsum("bqkgd,bckd->bkgqc", q, k, preferred_element_type=jnp.float32) * spec.scale
            mask = _block_mask(qpos[i], qseg[i] if has_seg else None, qval[i], kpos,
                               kseg if has_seg else None, kval, spec)
            p = jnp.where(mask, jnp.exp(s - lse_N[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqc,bqkgd->bckd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bckd->bkgqc", do, v, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_N[i][..., None]) * spec.scale).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqc,bqkgd->bckd", ds, q, preferred_element_type=jnp.float32)
            dq = jnp.einsum("bkgqc,bckd->bqkgd", ds, k, preferred_element_type=jnp.float32)
            return dq_N.at[i].add(dq), dk, dv

        zeros = jnp.zeros((B, bk, K, d), jnp.float32)
        dq_N, dk, dv = lax.fori_loop(0, count, body, (dq_N, *varying(refs, zeros, zeros)))
        return dq_N, (dk, dv)

    xs = (_split(k_BSKd, bk), _split(v_BSKd, bk), *_meta_blocks(km, bk), order_MN, count_M)
    if dq_BTHd is None:
        dq0, = varying(refs, jnp.zeros((T // bq, B, bq, K, G, d), jnp.float32))
    else:
        dq0 = _split(dq_BTHd.reshape(B, T, K, G, d), bq)
    dq_N, (dk, dv) = lax.scan(kv_block, dq0, xs)
    return _merge(dq_N).reshape(B, T, H, d), _merge(dk), _merge(dv)


def forward(q_BTHd, k_BSKd, v_BSKd, qm: Meta, km: Meta, spec: Spec, state=None):
    """``(o_BTHd float32, lse_BTH float32)``; rows that see no key: ``o = 0``, ``lse = NEG``.

    ``state=(o, lse)`` of earlier keys continues that softmax (the ring's merge,
    without a second output buffer).
    """
    T, S = q_BTHd.shape[1], k_BSKd.shape[1]
    bq, Tp = _blocks(T, spec.block_q)
    bk, Sp = _blocks(S, spec.block_kv)
    if state is not None:
        state = (_pad(state[0], Tp), _pad(state[1], Tp, NEG))
    o, lse = _fwd_padded(_pad(q_BTHd, Tp), _pad(k_BSKd, Sp), _pad(v_BSKd, Sp),
                         _pad_meta(qm, Tp), _pad_meta(km, Sp), spec, bq, bk, state)
    return o[:, :T], lse[:, :T]


def backward(q_BTHd, k_BSKd, v_BSKd, do_BTHd, lse_BTH, delta_BTH, qm: Meta, km: Meta, spec: Spec, dq=None):
    """``(dq, dk, dv)`` in float32 given the final ``lse`` and ``delta = sum(do * o, -1)``.

    Linear in the keys: calling it per key chunk with the global ``lse`` and
    ``delta`` and summing gives the full gradient (what the ring does; ``dq``
    is added to, in place).
    """
    T, S = q_BTHd.shape[1], k_BSKd.shape[1]
    bq, Tp = _blocks(T, spec.block_q)
    bk, Sp = _blocks(S, spec.block_kv)
    dq, dk, dv = _bwd_padded(_pad(q_BTHd, Tp), _pad(k_BSKd, Sp), _pad(v_BSKd, Sp), _pad(do_BTHd, Tp),
                             _pad(lse_BTH, Tp), _pad(delta_BTH, Tp), _pad_meta(qm, Tp), _pad_meta(km, Sp),
                             spec, bq, bk, None if dq is None else _pad(dq, Tp))
    return dq[:, :T], dk[:, :S], dv[:, :S]


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, qm, km, spec):
    return forward(q, k, v, qm, km, spec)[0].astype(q.dtype)


def _attention_fwd(q, k, v, qm, km, spec):
    o, lse = forward(q, k, v, qm, km, spec)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse, qm, km)


def _attention_bwd(spec, res, do):
    q, k, v, o, lse, qm, km = res
    delta = jnp.einsum("bthd,bthd->bth", do.astype(jnp.float32), o.astype(jnp.float32))
    dq, dk, dv = backward(q, k, v, do, lse, delta, qm, km, spec)
    zero_meta = lambda m: jax.tree.map(lambda _: None, m)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_meta(qm), zero_meta(km)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, block_q: int = 512, block_kv: int = 512,
):
    """Masked attention with memory linear in ``S``; same contract as ``dense_attention``.

    Block sizes are clamped to the sequence; lengths they do not divide are
    padded with masked tokens. Fully masked blocks are skipped (causal costs
    about half); rows that see no key return zeros with zero gradients.
    """
    spec = make_spec(q_BTHd.shape[-1], is_causal=is_causal, local_window_size=local_window_size,
                     scale=scale, block_q=block_q, block_kv=block_kv)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must both be given or both be None.")
    i32 = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
    qm = Meta(i32(q_positions), i32(q_segment_ids))
    km = Meta(i32(kv_positions), i32(kv_segment_ids))
    return _attention(q_BTHd, k_BSKd, v_BSKd, qm, km, spec)
