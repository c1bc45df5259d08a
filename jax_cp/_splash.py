"""TPU splash attention (Pallas) driven by explicit positions and segment ids.

Splash masks are static index patterns; ours come from data. We sort the keys
by ``(padding, segment, position)``, so that for each query the keys it may see
(same segment, position ``<=`` its own when causal) form a run ending at
``hi_t`` in the sorted order. The kernel's in-kernel mask is then ``k < hi_t``
with ``hi`` passed as its (normally static) ``q_sequence``, segments use the
kernel's own ``SegmentIds``, and block sparsity is built from the data. Windows
need a second bound per row and are not expressible (use blockwise).
Letters: B batch, T queries, S keys, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._blockwise import check_soft_cap, merge_softmax, vary_as as _vary_as, vma as _vma

__all__ = ["splash_attention", "splash_unsupported_reason", "LANES", "RingStep", "ring_prepare", "ring_forward_step",
           "ring_backward_step"]

LANES = 128  # splash block sizes are multiples of this
_IMAX = jnp.iinfo(jnp.int32).max
_NEG = -1e30  # the log-sum-exp of rows that see no key (as the blockwise kernel's)


def splash_unsupported_reason(*, window, max_logits: bool = False, residual: bool = False) -> str | None:
    """Why splash cannot serve this call (``None`` when it can)."""
    if window is not None:
        return (f"local_window_size={window} needs two bounds per query over explicit positions, "
                "which the splash mask cannot express")
    if max_logits:
        return "the max-logit statistic (record_max_logits) is not among the splash kernel's outputs"
    if residual:
        return "return_residual's log-sum-exp gradient is not an input of splash's backward kernels"
    return None


def _block(length: int) -> int:
    """Largest of 512/256/128 dividing the (padded) length."""
    return next(b for b in (512, 256, 128) if length % b == 0)


def _pad_len(x, length, value):
    return jnp.pad(x, [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _pad_seq(x, length, value=0):
    """``x`` padded with ``value`` to ``length`` along axis 1 (the sequence; ``None`` passes)."""
    return None if x is None else jnp.moveaxis(_pad_len(jnp.moveaxis(x, 1, 0), length, value), 0, 1)


def _counts_le(kv_keys, q_keys):
    """For each query key tuple, how many kv key tuples are ``<=`` it (lexicographic)."""
    S, T = kv_keys[0].shape[0], q_keys[0].shape[0]
    keys = [jnp.concatenate([a, b]) for a, b in zip(kv_keys, q_keys)]
    is_q = jnp.concatenate([jnp.zeros(S, jnp.int32), jnp.ones(T, jnp.int32)])  # ties: kv first
    idx = jnp.arange(S + T, dtype=jnp.int32)
    *_, is_q_s, idx_s = lax.sort((*keys, is_q, idx), num_keys=len(keys) + 1)
    n_kv = jnp.cumsum(1 - is_q_s)
    return jnp.zeros(S + T, jnp.int32).at[idx_s].set(n_kv)[S:]


def _mask_info(block_mask_NM, data_next_NM):
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

    return MaskInfo(data_next=data_next_NM[None], mask_next=None, block_mask=block_mask_NM[None],
                    partial_mask_blocks=None, q_sequence=None)


def _sort_keys(kpos, kseg, S):
    """One row's keys, padded to ``Sp``: the permutation that sorts them by
    ``(padding, segment, position)``, and those ``(padding, segment, position)`` keys."""
    Sp = kpos.shape[0]
    kseg0 = jnp.zeros(Sp, jnp.int32) if kseg is None else kseg
    kinv = ((jnp.arange(Sp) >= S) | (kseg0 < 0)).astype(jnp.int32)  # padding (negative segment) sorts last
    perm = lax.sort((kinv, kseg0, kpos, jnp.arange(Sp, dtype=jnp.int32)), num_keys=3)[3]
    return perm, (kinv, kseg0, kpos)


def _row_info(kv_keys, q_hi, q_lo, *, T):
    """The kernel's mask for one row: ``(fwd, dq, dkv)`` MaskInfos whose ``q_sequence`` is each
    query's bound in the sorted keys, and ``has_key_T``. ``kv_keys`` (sorted or not: only counts
    are taken) are the keys' sort tuples; query ``t`` sees sorted keys ``lo_t <= s < hi_t`` where
    ``hi_t`` counts the keys ``<= q_hi[t]`` and ``lo_t`` those ``<= q_lo[t]`` (none if ``q_lo`` is None)."""
    Tp, Sp = q_hi[0].shape[0], kv_keys[0].shape[0]
    hi = _counts_le(kv_keys, q_hi)
    lo = jnp.zeros(Tp, jnp.int32) if q_lo is None else _counts_le(kv_keys, q_lo)
    qvalid = jnp.arange(Tp) < T
    hi = jnp.where(qvalid, hi, 0)
    has_key = hi > lo

    bq, bk = _block(Tp), _block(Sp)
    N, M = Tp // bq, Sp // bk
    hi_max = jnp.where(qvalid, hi, 0).reshape(N, bq).max(1)[:, None]
    lo_min = jnp.where(qvalid, lo, _IMAX).reshape(N, bq).min(1)[:, None]
    starts = (jnp.arange(M, dtype=jnp.int32) * bk)[None]
    live = (lo_min < starts + bk) & (hi_max > starts)
    live = live.at[:, 0].set(live[:, 0] | ~live.any(1))  # every query block runs at least once (no 0/0)
    block_mask = live.astype(jnp.int8)
    j_next = jnp.where(live, starts // bk, 0).astype(jnp.int32)
    i_next = jnp.where(live, jnp.arange(N, dtype=jnp.int32)[:, None], 0)
    fwd, dq, dkv = _mask_info(block_mask, j_next), _mask_info(block_mask, j_next), _mask_info(block_mask, i_next)
    return tuple(m._replace(q_sequence=hi) for m in (fwd, dq, dkv)), has_key


def _static(Tp: int, Sp: int, interpret: bool, soft_cap: float | None = None) -> tuple:
    """The kernel's static settings for padded lengths ``Tp`` x ``Sp`` (hashable)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bk = _block(Tp), _block(Sp)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    return tuple(sorted({**_kernel_kwargs(sizes, interpret, soft_cap), "save_residuals": False}.items()))


def _segment_ids(qseg, qseg0, kseg_s):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return None if qseg is None else sa.SegmentIds(q=qseg0, kv=kseg_s)


def _one_row(q_HTd, k_KSd, v_KSd, qpos, kpos, qseg, kseg, sinks_H, *, T, S, is_causal, interpret, soft_cap=None):
    """One batch row, already padded to block multiples; returns ``o_HTd`` and ``has_key_T``."""
    Tp, Sp = q_HTd.shape[1], k_KSd.shape[1]
    perm, kv_keys = _sort_keys(kpos, kseg, S)
    k_KSd, v_KSd, kseg_s = k_KSd[:, perm], v_KSd[:, perm], kv_keys[1][perm]
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    zeros, imax = jnp.zeros(Tp, jnp.int32), jnp.full(Tp, _IMAX, jnp.int32)
    q_hi = (zeros, qseg0, qpos if is_causal else imax)
    infos, has_key = _row_info(kv_keys, q_hi, (zeros, qseg0 - 1, imax), T=T)  # lo: keys of earlier segments
    static = _static(Tp, Sp, interpret, soft_cap)
    return _unchecked_call(static, infos, q_HTd, k_KSd, v_KSd, _segment_ids(qseg, qseg0, kseg_s), sinks_H), has_key


def _no_vma_check():
    """Splash's ``pallas_call`` declares outputs without manual-axis types, which
    ``shard_map(check_vma=True)`` rejects; trace the kernel itself unchecked.

    We call splash's own forward/backward halves (private, pinned to the
    installed jax) in our ``custom_vjp`` and retype the results as varying
    over the inputs' axes, so outside the kernel the checks stay on."""
    from jax._src import config

    state = getattr(config, "_check_vma", None)
    return state(False) if state is not None else contextlib.nullcontext()


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unchecked_call(static, infos, q, k, v, segment_ids, sinks=None):
    return _unchecked_fwd(static, infos, q, k, v, segment_ids, sinks)[0]


def _unchecked_fwd(static, infos, q, k, v, segment_ids, sinks=None):
    """Splash's forward half; ``sinks [H]`` are the kernel's own (its softmax state starts at them)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    with _no_vma_check():
        o, res = ska._splash_attention_fwd(*infos, q, k, v, segment_ids, sinks, **dict(static))
    return _vary_as(o, q, k, v), (res, q, k, v, infos, segment_ids, sinks)


def _unchecked_bwd(static, res, do):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    res, q, k, v, infos, segment_ids, sinks = res
    with _no_vma_check():
        grads = ska._splash_attention_bwd(**dict(static), res=res, do=do)
    dq, dk, dv = grads[3:6]
    dsinks = None if sinks is None else _vary_as(grads[7].astype(sinks.dtype), sinks)
    none = lambda t: jax.tree.map(lambda _: None, t)
    return none(infos), _vary_as(dq, q), _vary_as(dk, k), _vary_as(dv, v), none(segment_ids), dsinks


_unchecked_call.defvjp(_unchecked_fwd, _unchecked_bwd)


def _below_bound(q_ids, kv_ids):
    return kv_ids < q_ids


@functools.cache
def _below_bound_class():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class BelowBound(sm._ComputableMask):  # the kernel's hook for an in-kernel mask_function
        """Key index below the per-query bound carried in ``q_sequence``."""

        def __init__(self, shape):
            super().__init__(shape=shape, mask_function=_below_bound)

        def __eq__(self, other):
            return isinstance(other, BelowBound) and self.shape == other.shape

        def __hash__(self):
            return hash((BelowBound, self.shape))

    return BelowBound


def _kernel_kwargs(sizes, interpret: bool, soft_cap: float | None = None) -> dict:
    """The kernel's static settings, taken from a one-block template (no mask processing at scale)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([_below_bound_class()((sizes.block_q, sizes.block_kv))])
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                              attn_logits_soft_cap=soft_cap).kwargs


def splash_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, logits_soft_cap=None, sinks=None, interpret: bool = False,
):
    """Splash attention with our data-defined masks (causal/full, segments; no window); ``sinks [H]``
    go to the kernel's own sink support.

    ``interpret=True`` runs the Pallas kernel in interpret mode (any backend,
    slow: for tests). Rows that see no key return zeros.
    """
    reason = splash_unsupported_reason(window=local_window_size)
    if reason:
        raise ValueError(f"kernel='splash': {reason}; use kernel='blockwise' (or 'auto').")
    return _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sinks,
                       is_causal=bool(is_causal), scale=scale, interpret=bool(interpret),
                       soft_cap=check_soft_cap(logits_soft_cap))


@partial(jax.jit, static_argnames=("is_causal", "scale", "interpret", "soft_cap"))
def _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sinks, *,
                is_causal, scale, interpret, soft_cap):
    """Jitted so that eager ``shard_map`` sees one primitive (the kernel is traced unchecked inside)."""
    B, T, H, d = q_BTHd.shape
    S = k_BSKd.shape[1]
    scale = d**-0.5 if scale is None else scale
    Tp, Sp = -(-T // LANES) * LANES, -(-S // LANES) * LANES
    q = jnp.swapaxes(_pad_seq(q_BTHd * jnp.asarray(scale, q_BTHd.dtype), Tp), 1, 2)  # [B, H, T, d]
    k, v = (jnp.swapaxes(_pad_seq(a, Sp), 1, 2) for a in (k_BSKd, v_BSKd))
    i32 = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
    qpos, kpos = _pad_seq(i32(q_positions), Tp), _pad_seq(i32(kv_positions), Sp)
    qseg, kseg = _pad_seq(i32(q_segment_ids), Tp), _pad_seq(i32(kv_segment_ids), Sp)

    def row(q, k, v, qpos, kpos, qseg, kseg):
        return _one_row(q, k, v, qpos, kpos, qseg, kseg, sinks, T=T, S=S, is_causal=is_causal,
                        interpret=interpret, soft_cap=soft_cap)

    o_BHTd, has_key_BT = jax.vmap(row)(q, k, v, qpos, kpos, qseg, kseg)
    o = jnp.swapaxes(o_BHTd, 1, 2)[:, :T]
    return jnp.where(has_key_BT[:, :T, None, None], o, 0).astype(q_BTHd.dtype)


# --- The ring's steps: one splash call per K/V chunk, merged by log-sum-exp ----------------------
# The chunk is prepared once at home (head-major, padded to lanes, keys sorted by
# (padding, segment, position)) and travels that way; each step builds the kernel's
# mask from the data in hand, so fully hidden blocks (and steps) run no block work.


@dataclasses.dataclass(frozen=True)
class RingStep:
    """Static settings of a ring's splash steps (hashable: a ``custom_vjp`` static argument)."""

    T: int  # true query chunk length (the keys' chunk: as long, or its own under cross attention)
    is_causal: bool
    has_segments: bool
    static: tuple  # the kernel's keyword arguments


def ring_prepare(q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT, *, scale, is_causal, interpret, soft_cap=None,
                 kv_seg_BT=None, kv_pos_BT=None):
    """``(q [B, H, Tp, d] scaled, q metadata, home chunk, RingStep)``. The home chunk is
    ``(k [B, K, Sp, d], v, positions, segments)`` with each row's keys sorted by (segment,
    position); padding keys (beyond the chunk, or of a negative segment) carry segment
    ``int32 max`` and sort last. ``segments`` is None when there is neither padding nor a
    segment id, so that only what the mask needs travels. ``kv_seg_BT`` / ``kv_pos_BT``: the keys'
    segment ids / positions when they differ from the queries' (key padding; cross attention,
    where K/V are a chunk of other tokens, of their own length)."""
    B, T, H, d = q_BTHd.shape
    S = k_BTKd.shape[1]
    Tp, Sp = -(-T // LANES) * LANES, -(-S // LANES) * LANES
    scale = d**-0.5 if scale is None else scale
    qx = jnp.swapaxes(_pad_seq(q_BTHd * jnp.asarray(scale, q_BTHd.dtype), Tp), 1, 2)
    i32 = lambda a, n: None if a is None else _pad_seq(jnp.asarray(a, jnp.int32), n)
    pos, seg = i32(pos_BT, Tp), i32(seg_BT, Tp)
    kpos = pos if kv_pos_BT is None else i32(kv_pos_BT, Sp)
    kseg_src = seg if kv_seg_BT is None else i32(kv_seg_BT, Sp)
    idx = jnp.broadcast_to(jnp.arange(Sp, dtype=jnp.int32), kpos.shape)
    if kseg_src is None and Sp == S:
        pos_s, perm = lax.sort((kpos, idx), num_keys=1)
        keys = (pos_s, None)
    else:
        seg0 = jnp.zeros_like(kpos) if kseg_src is None else kseg_src
        kseg = jnp.where((jnp.arange(Sp) >= S)[None] | (seg0 < 0), _IMAX, seg0)
        kseg_s, pos_s, perm = lax.sort((kseg, kpos, idx), num_keys=2)
        keys = (pos_s, kseg_s)
    kx, vx = (jnp.take_along_axis(jnp.swapaxes(_pad_seq(a, Sp), 1, 2), perm[:, None, :, None], axis=2)
              for a in (k_BTKd, v_BTKd))
    qm = (pos, seg)
    return qx, qm, (kx, vx, *keys), RingStep(T, bool(is_causal), seg is not None,
                                             _static(Tp, Sp, interpret, soft_cap))


def _row_kernel_args(step: RingStep, kv, qm):
    _, _, kpos, kseg = kv
    qpos, qseg = qm
    Tp = qpos.shape[0]
    bound = qpos if step.is_causal else jnp.full(Tp, _IMAX, jnp.int32)
    if kseg is None:  # no segments, no padding: keys sorted by position
        infos, has_key = _row_info((kpos,), (bound,), None, T=step.T)
        return infos, has_key, None
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    q_lo = None if qseg is None else (qseg0 - 1, jnp.full(Tp, _IMAX, jnp.int32))  # keys of earlier segments
    infos, has_key = _row_info((kseg, kpos), (qseg0, bound), q_lo, T=step.T)
    return infos, has_key, _segment_ids(qseg, qseg0, kseg)


def ring_forward_step(step: RingStep, qx, qm, kv, carry=None):
    """Attends the queries to the chunk ``kv`` in hand; ``carry=(o, lse)`` of earlier chunks
    (float32, ``[B, H, Tp, d]`` and ``[B, H, Tp]``) is merged by log-sum-exp."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    def row(q, kv, qm):
        infos, has_key, segment_ids = _row_kernel_args(step, kv, qm)
        with _no_vma_check():
            o, res = ska._splash_attention_fwd(*infos, q, kv[0], kv[1], segment_ids, None, **dict(step.static))
        lse = res[6]  # the residuals' log-sum-exp, [H, Tp]
        return (jnp.where(has_key[None, :, None], o.astype(jnp.float32), 0.0),
                jnp.where(has_key[None], lse.astype(jnp.float32), _NEG))

    o, lse = jax.vmap(row)(qx, kv, qm)
    o, lse = _vary_as(o, qx, kv[0]), _vary_as(lse, qx, kv[0])
    if carry is None:
        return o, lse
    return merge_softmax(carry, (o, lse))


def ring_backward_step(step: RingStep, qx, qm, kv, o, lse, do, dq=None):
    """``(dq, dk, dv)`` (float32) of the chunk ``kv`` given the final ``o`` (queries' dtype) and
    ``lse``: splash's backward kernels with the merged residuals, so summing over chunks gives
    the full gradient (``dq`` is added to)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    def row(q, kv, qm, o, lse, do):
        infos, _, segment_ids = _row_kernel_args(step, kv, qm)
        res = (q, kv[0], kv[1], segment_ids, None, o, lse, infos[1], infos[2])
        with _no_vma_check():
            grads = ska._splash_attention_bwd(**dict(step.static), res=res, do=do)
        return grads[3:6]

    dq_s, dk, dv = jax.vmap(row)(qx, kv, qm, o, lse, do)
    dq_s, dk, dv = (_vary_as(g.astype(jnp.float32), qx, kv[0]) for g in (dq_s, dk, dv))
    return dq_s if dq is None else dq + dq_s, dk, dv
