"""TPU splash attention (Pallas) driven by explicit positions and segment ids.

Splash masks are static index patterns; ours come from data. We sort the keys
by ``(padding, segment, position)``, so that for each query the keys it may see
(same segment, position ``<=`` its own when causal, within its window) form a
run ``lo_t <= s < hi_t`` in the sorted order. The kernel's in-kernel mask
function compares key indices with a per-query value passed as its (normally
static) ``q_sequence``: ``hi_t`` alone, or, with a window, both bounds packed in
16 bits each (so windows need at most ``MAX_WINDOW_KEYS`` keys per kernel call);
segments use the kernel's own ``SegmentIds``, and block sparsity is built from
the data, so blocks no query sees cost nothing.

The surface used (pinned by ``tests/test_kernels.py`` on jax 0.10.2 and 0.12.0):
the public ``splash_attention`` module (``make_splash_mha``/``make_splash_mqa`` for
the kernel's settings, ``SplashAttentionKernel`` and ``MaskInfo`` to run it on our
mask data, its forward with ``save_residuals``) and
one private piece that nothing public replaces:
``splash_attention_kernel._splash_attention_bwd``, the backward kernels from given
residuals: the ring's steps need them from the merged output and log-sum-exp of
all steps, which the public ``custom_vjp`` cannot take (it keeps its own forward's),
and one path serves both uses (under ``shard_map`` the public ``custom_vjp``'s
cotangent types would not match its unchecked forward's). Splash declares its outputs
without manual-axis types; we run it in a nested ``shard_map(check_vma=False)`` over no
further axes (``_blockwise.unchecked``) and retype its results. Where a JAX release lacks the
private piece, ``unavailable_reason`` says so and ``kernel="auto"`` runs the blockwise kernel.
Letters: B batch, T queries, S keys, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cp._masks import normalize_window
from jax_cp._remat import name_attention_residuals
from jax_cp._softmax import check_soft_cap, fold_sinks, merge_softmax, sinks_grad
from jax_cp._vma import unchecked as _unchecked, vary_as as _vary_as

# Imported with jax_cp, not when a kernel is first chosen: these modules register JAX config states
# that enter the tracing context (jax 0.12: pallas_fuser_disable_nested_fuse). Imported during a
# jitted step's first trace, they would change that step's cache key and compile it twice.
try:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo
    _IMPORT_ERROR = None
except ImportError as e:  # a JAX without the splash module: unavailable_reason says so, auto runs blockwise
    sa = ska = MaskInfo = None
    _IMPORT_ERROR = e

__all__ = ["splash_attention", "splash_unsupported_reason", "unavailable_reason", "LANES", "MAX_WINDOW_KEYS",
           "chunked_attention", "RingStep", "ring_prepare", "ring_forward_step", "ring_backward_step"]

LANES = 128  # splash block sizes are multiples of this
_BITS = 16  # a window's two bounds share one int32 of q_sequence
MAX_WINDOW_KEYS = ((1 << _BITS) - 1) // LANES * LANES  # keys of one windowed kernel call (padded to lanes)
_IMAX = jnp.iinfo(jnp.int32).max
_IMIN = jnp.iinfo(jnp.int32).min
_NEG = -1e30  # the log-sum-exp of rows that see no key (as the blockwise kernel's)


def _padded(n: int) -> int:
    return -(-n // LANES) * LANES


@functools.cache
def unavailable_reason() -> str | None:
    """Why this JAX release cannot run splash for us, or None.

    The private piece we rely on is checked by name and signature, not by version, so a
    release that keeps it works and one that drops it falls back to blockwise, saying why."""
    if _IMPORT_ERROR is not None:
        return f"this JAX ({jax.__version__}) cannot import its splash attention module ({_IMPORT_ERROR})"
    bwd = getattr(ska, "_splash_attention_bwd", None)
    params = set(inspect.signature(bwd).parameters) if bwd is not None else set()
    if not {"res", "do", "save_residuals", "mask_function", "block_sizes", "is_mqa"} <= params:
        return (f"this JAX's ({jax.__version__}) splash module has no _splash_attention_bwd(res, do, ...), the "
                "backward from given residuals that the ring's merged steps need (tested: jax 0.10.2, 0.12.0)")
    return None


def splash_unsupported_reason(*, window, kv_len: int | None = None, max_logits: bool = False,
                              residual: bool = False, spans: bool = False, is_causal: bool = True) -> str | None:
    """Why splash cannot serve this call (``None`` when it can). ``kv_len``: the keys one kernel
    call sees (``None``: not known yet, windows and spans are assumed to fit); ``spans``: span ids
    are given (they change a causal mask only)."""
    if window is not None and kv_len is not None and _padded(kv_len) > MAX_WINDOW_KEYS:
        return (f"local_window_size={window} over {kv_len} keys in one kernel call: splash gets a window's "
                f"two bounds per query in {_BITS} bits each, so at most {MAX_WINDOW_KEYS} keys")
    if spans and is_causal and kv_len is not None and _padded(kv_len) > MAX_WINDOW_KEYS:
        return (f"span ids over {kv_len} keys in one kernel call: splash gets the keys of a query's span after it "
                f"as two bounds per query in {_BITS} bits each, so at most {MAX_WINDOW_KEYS} keys")
    if max_logits:
        return "the max-logit statistic (record_max_logits) is not among the splash kernel's outputs"
    if residual:
        return "return_residual's log-sum-exp gradient is not an input of splash's backward kernels"
    return unavailable_reason()


# Splash prefetches a call's block-grid masks (an int32 and an int8 per pair of blocks) into SMEM, 1 MiB on
# v5p: 448 x 448 blocks of 512 fit (14M tokens on 64 chips), 512 x 512 did not (16M, 1.25 MiB).
MAX_BLOCKS = 384


def _block(length: int) -> int:
    """The block size along a (padded) length: 512 (else 256 or 128, the largest dividing it), or 1024 or
    2048 where 512 would cut it into more than ``MAX_BLOCKS`` blocks."""
    within = [b for b in (512, 1024, 2048) if length % b == 0 and length // b <= MAX_BLOCKS]
    return within[0] if within else next(b for b in (2048, 1024, 512, 256, 128) if length % b == 0)


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


def _row_info(kv_keys, q_hi, q_lo, *, T, window: bool = False):
    """The kernel's mask for one row: ``(fwd, dq, dkv)`` MaskInfos whose ``q_sequence`` is each
    query's bound in the sorted keys (with ``window``: both bounds, packed), and ``has_key_T``.
    ``kv_keys`` (sorted or not: only counts are taken) are the keys' sort tuples; query ``t`` sees
    sorted keys ``lo_t <= s < hi_t`` where ``hi_t`` counts the keys ``<= q_hi[t]`` and ``lo_t`` those
    ``<= q_lo[t]`` (none if ``q_lo`` is None)."""
    Sp = kv_keys[0].shape[0]
    hi = _counts_le(kv_keys, q_hi)
    lo = None if q_lo is None else _counts_le(kv_keys, q_lo)
    return _info_from_bounds(hi, lo, Sp=Sp, T=T, window=window)


def _info_from_bounds(hi, lo, *, Sp: int, T: int, window: bool = False, xp=jnp):
    """``_row_info`` from each query's bounds in the (sorted) keys: it sees ``lo_t <= s < hi_t``
    (``lo`` None: from 0). ``xp``: ``numpy`` for masks known when traced (no JAX op runs, so
    nothing depends on the mesh context of the trace: a ``shard_map`` body under an Explicit mesh
    refuses eager ops)."""
    Tp = hi.shape[0]
    bound, has_key = _query_bounds(hi, lo, T=T, window=window, xp=xp)
    lo = xp.zeros(Tp, xp.int32) if lo is None else lo
    qvalid = xp.arange(Tp) < T
    hi = xp.where(qvalid, hi, 0)

    bq, bk = _block(Tp), _block(Sp)
    N, M = Tp // bq, Sp // bk
    hi_max = xp.where(qvalid, hi, 0).reshape(N, bq).max(1)[:, None]
    lo_min = xp.where(qvalid, lo, _IMAX).reshape(N, bq).min(1)[:, None]
    starts = (xp.arange(M, dtype=xp.int32) * bk)[None]
    live = (lo_min < starts + bk) & (hi_max > starts)
    first = live[:, 0] | ~live.any(1)  # every query block runs at least once (no 0/0)
    live = xp.concatenate([first[:, None], live[:, 1:]], axis=1)
    block_mask = live.astype(xp.int8)
    j_next = xp.where(live, starts // bk, 0).astype(xp.int32)
    i_next = xp.where(live, xp.arange(N, dtype=xp.int32)[:, None], 0).astype(xp.int32)
    fwd, dq, dkv = _mask_info(block_mask, j_next), _mask_info(block_mask, j_next), _mask_info(block_mask, i_next)
    return tuple(m._replace(q_sequence=bound) for m in (fwd, dq, dkv)), has_key


def _query_bounds(hi, lo, *, T: int, window: bool, xp):
    """Each query's ``q_sequence`` entry (``hi``; with ``window`` both bounds packed) and whether it
    sees any key, from its bounds in the sorted keys (``lo`` None: from 0). Queries past ``T``
    (padding) see nothing."""
    Tp = hi.shape[0]
    lo = xp.zeros(Tp, xp.int32) if lo is None else lo
    hi = xp.where(xp.arange(Tp) < T, hi, 0)
    return (xp.left_shift(hi, _BITS) | xp.minimum(lo, hi) if window else hi), hi > lo


@functools.cache
def _natural_info(Tp: int, Sp: int, T: int, S: int, is_causal: bool, window, keys: str = "same"):
    """``_row_info`` computed when traced (NumPy constants) for keys in position order with no
    segments: queries at positions ``0..T-1`` and keys at ``0..S-1`` (``keys="same"``), or every
    key before every query (``"earlier"``: all visible, causal or not) or after it (``"later"``:
    none visible when causal). Padding (queries past ``T``, keys past ``S``) sees and is seen by
    nothing, as in the sorted path."""
    t = np.arange(Tp, dtype=np.int64)
    if keys == "same":
        hi, lo = _bounds(t, is_causal=is_causal, window=window, xp=np)
    else:
        visible = keys == "earlier" or not is_causal
        hi, lo = np.full(Tp, S - 1 if visible else -1, np.int64), None
    count = lambda b: np.clip(b.astype(np.int64) + 1, 0, S).astype(np.int32)  # keys at positions <= b
    return _info_from_bounds(count(hi), None if lo is None else count(lo), Sp=Sp, T=T, window=window is not None,
                             xp=np)


def _natural_masks(Tp: int, Sp: int, T: int, S: int, is_causal: bool, window, keys: str = "same"):
    """``_natural_info`` with its per-query arrays (``q_sequence``, ``has_key``) computed in the
    program from an iota rather than held as NumPy constants: from JAX 0.12.1 on, constants over
    1 KiB become extra arguments of the compiled program (``jax_embedded_constants_max_bytes``),
    values the compiler knows nothing about. The block-level arrays (a few bytes per block) stay
    NumPy constants."""
    infos, _ = _natural_info(Tp, Sp, T, S, is_causal, window, keys)
    t = lax.iota(jnp.int32, Tp)
    if keys == "same":
        hi, lo = _bounds(t, is_causal=is_causal, window=window)
    else:
        visible = keys == "earlier" or not is_causal
        hi, lo = jnp.full(Tp, S - 1 if visible else -1, jnp.int32), None
    count = lambda b: jnp.clip(b, -1, S - 1) + 1  # keys at positions <= b (no int32 overflow at the bounds)
    bound, has_key = _query_bounds(count(hi), None if lo is None else count(lo), T=T, window=window is not None,
                                   xp=jnp)
    return tuple(m._replace(q_sequence=bound) for m in infos), has_key


def _per_row(masks, B: int, *like):
    """Mask arrays (``_natural_masks``'s, or picked from them) broadcast to ``B`` batch rows and typed
    to vary as the data ``like`` does, so that they are vmapped with it."""
    return jax.tree.map(lambda a: _vary_as(jnp.broadcast_to(a, (B, *jnp.shape(a))), *like), masks)


def _below_bound(q_ids, kv_ids):
    """In-kernel mask: the sorted key index is below the query's bound (``q_sequence = hi``)."""
    return kv_ids < q_ids


def _within_bounds(q_ids, kv_ids):
    """In-kernel mask with a window: ``lo <= key index < hi``, ``q_sequence = hi << 16 | lo``."""
    hi = lax.shift_right_logical(q_ids, jnp.int32(_BITS))
    lo = q_ids & jnp.int32((1 << _BITS) - 1)
    return (kv_ids >= lo) & (kv_ids < hi)


def _static(Tp: int, Sp: int, interpret: bool, soft_cap: float | None = None, *, window: bool = False,
            mqa: bool = False) -> tuple:
    """The kernel's settings for padded lengths ``Tp`` x ``Sp`` (hashable): those the public
    ``make_splash_mha`` / ``make_splash_mqa`` (``mqa``: one kv head, splash's MQA form) give a
    one-block computable mask, with our mask function (``window``: two bounds per query)."""
    if window and Sp > MAX_WINDOW_KEYS:  # the kernel choice checks this first; a guard against silent wrapping
        raise ValueError(f"a windowed splash call over {Sp} keys: at most {MAX_WINDOW_KEYS}; use kernel='blockwise'.")
    return _template_kwargs(_block(Tp), _block(Sp), bool(interpret), soft_cap, bool(mqa)) + (
        ("mask_function", _within_bounds if window else _below_bound),)


@functools.cache
def _template_kwargs(bq: int, bk: int, interpret: bool, soft_cap: float | None, mqa: bool) -> tuple:
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    make = sa.make_splash_mqa if mqa else sa.make_splash_mha
    template = make(sa.MultiHeadMask([sa.CausalMask((bq, bk))]), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                    interpret=interpret, attn_logits_soft_cap=soft_cap)
    kwargs = {k: v for k, v in template.kwargs.items() if k not in ("mask_function", "save_residuals")}
    return tuple(sorted(kwargs.items()))


def _kernel(static: tuple, infos, *, save_residuals: bool = False):
    """splash's public kernel object, running on our mask data (``infos``)."""
    return ska.SplashAttentionKernel(*infos, **dict(static), save_residuals=save_residuals)


def _is_mqa(static: tuple) -> bool:
    return dict(static)["is_mqa"]


def _segment_ids(qseg, qseg0, kseg_s):
    return None if qseg is None else sa.SegmentIds(q=qseg0, kv=kseg_s)


def _bounds(qpos, *, is_causal: bool, window, xp=jnp):
    """Per-query position bounds ``(hi, lo)``: keys at positions ``<= hi`` and ``> lo`` (``lo`` None:
    no lower bound), saturating at the int32 range (``xp``: ``numpy`` for bounds known when traced)."""
    if window is None:
        return (qpos if is_causal else xp.full(qpos.shape, _IMAX, xp.int32)), None
    left, right = (min(w, 2**31 - 1) for w in window)
    hi = qpos if is_causal else xp.where(qpos > _IMAX - right, _IMAX, qpos + right)
    return hi, xp.where(qpos < _IMIN + left + 1, _IMIN, qpos - left - 1)


def _one_row(q_HTd, k_KSd, v_KSd, qpos, kpos, qseg, kseg, sinks_H, *, T, S, is_causal, window, interpret,
             soft_cap=None, known=None):
    """One batch row, already padded to block multiples; returns ``o_HTd`` and ``has_key_T``.
    ``known``: ``(infos, has_key)`` when the mask is known when traced (``_natural_masks``), so no key
    is sorted and ``qpos``/``kpos`` are not read."""
    Tp, Sp = q_HTd.shape[1], k_KSd.shape[1]
    static = _static(Tp, Sp, interpret, soft_cap, window=window is not None, mqa=k_KSd.shape[0] == 1)
    if known is not None:
        infos, has_key = known
        return _unchecked_call(static, infos, q_HTd, k_KSd, v_KSd, None, sinks_H), has_key
    perm, kv_keys = _sort_keys(kpos, kseg, S)
    k_KSd, v_KSd, kseg_s = k_KSd[:, perm], v_KSd[:, perm], kv_keys[1][perm]
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    zeros = jnp.zeros(Tp, jnp.int32)
    hi, lo = _bounds(qpos, is_causal=is_causal, window=window)
    if lo is not None:  # the window's lower bound, within the query's segment
        q_lo = (zeros, qseg0, lo)
    else:  # keys of earlier segments; none without segment ids (padding keys sort last): nothing to count
        q_lo = None if qseg is None else (zeros, qseg0 - 1, jnp.full(Tp, _IMAX, jnp.int32))
    infos, has_key = _row_info(kv_keys, (zeros, qseg0, hi), q_lo, T=T, window=window is not None)
    return _unchecked_call(static, infos, q_HTd, k_KSd, v_KSd, _segment_ids(qseg, qseg0, kseg_s), sinks_H), has_key


def _kv_in(k, static):
    """The kernel's key/value operand: ``[K, S, d]``, or ``[S, d]`` in the MQA form."""
    return k[0] if _is_mqa(static) else k


def _kv_out(dk, static):
    return dk[None] if _is_mqa(static) else dk


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unchecked_call(static, infos, q, k, v, segment_ids, sinks=None):
    return _unchecked_fwd(static, infos, q, k, v, segment_ids, sinks)[0]


def _unchecked_fwd(static, infos, q, k, v, segment_ids, sinks=None):
    """The public kernel's forward with its log-sum-exp; ``sinks [H]`` are the kernel's own (its
    softmax state starts at them)."""
    kq, kv_ = _kv_in(k, static), _kv_in(v, static)
    o, (lse,) = _unchecked(lambda infos, *a: _kernel(static, infos, save_residuals=True)(*a),
                           infos, q, kq, kv_, segment_ids, sinks)
    o, lse = name_attention_residuals(o, lse)
    return _vary_as(o, q, k, v), ((q, kq, kv_, segment_ids, sinks, o, lse, infos[1], infos[2]), infos)


def _backward(static, res, do):
    """``(dq, dk, dv, dsinks)`` from splash's backward kernels, given the residuals
    ``(q, k, v, segment_ids, sinks, o, lse, dq_info, dkv_info)``: the one private entry point
    (the public ``custom_vjp`` keeps its own forward's residuals; the ring needs the merged ones)."""
    grads = _unchecked(lambda res, do: ska._splash_attention_bwd(**dict(static), save_residuals=False, res=res, do=do),
                       res, do)
    dq, dk, dv = grads[3:6]
    return dq, _kv_out(dk, static), _kv_out(dv, static), grads[7]


def _unchecked_bwd(static, res, do):
    res, infos = res
    q, k, v, segment_ids, sinks = res[:5]
    dq, dk, dv, dsinks = _backward(static, res, do)
    dsinks = None if sinks is None else _vary_as(dsinks.astype(sinks.dtype), sinks)
    none = lambda t: jax.tree.map(lambda _: None, t)
    return (none(infos), _vary_as(dq, q), _vary_as(dk, k), _vary_as(dv, v), none(segment_ids), dsinks)


_unchecked_call.defvjp(_unchecked_fwd, _unchecked_bwd)


def splash_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, logits_soft_cap=None, sinks=None, interpret: bool = False,
    natural_positions: bool = False, q_span_ids=None, kv_span_ids=None,
):
    """Splash attention with our data-defined masks (causal/full, segments, windows up to ``MAX_WINDOW_KEYS``
    keys, bidirectional spans over at most as many keys).

    Rows that see no key return zeros.

    Args:
        q_BTHd, k_BSKd, v_BSKd: the local queries, keys and values.
        q_positions, kv_positions, q_segment_ids, kv_segment_ids: positions and document ids.
        is_causal, local_window_size, scale, logits_soft_cap: the mask, scale and soft cap.
        sinks: ``[H]`` sink logits, given to the kernel's own sink support (or None).
        interpret: run the Pallas kernel in interpret mode (any backend, slow: for tests).
        natural_positions: the caller states that the positions are ``arange`` on both sides
            (queries and keys the same tokens, no segment ids); the mask is then built when
            traced, as it is for a mask that ignores positions (not causal, no window, no
            segment ids): no sort of keys at run time.
        q_span_ids, kv_span_ids: bidirectional span ids of the queries and keys (0: none; the keys':
            the queries' unless given), or None. With a causal mask each row runs two calls, merged
            by log-sum-exp: the keys at or before each query, and those after it in its span.

    Returns:
        ``o`` ``[B, T, H, dv]``.

    Raises:
        ValueError: splash cannot serve the call (e.g. a window over too many keys).
    """
    window = normalize_window(local_window_size)
    spans = bool(is_causal) and q_span_ids is not None  # not causal: spans change nothing
    reason = splash_unsupported_reason(window=window, kv_len=k_BSKd.shape[1], spans=spans)
    if reason:
        raise ValueError(f"kernel='splash': {reason}; use kernel='blockwise' (or 'auto').")
    segments = q_segment_ids is not None or kv_segment_ids is not None
    given = "segment ids are given" if segments else "span ids are given" if spans else (
        f"{q_BTHd.shape[1]} queries meet {k_BSKd.shape[1]} keys" if q_BTHd.shape[1] != k_BSKd.shape[1] else "")
    if natural_positions and given:
        raise ValueError(f"natural_positions=True states positions arange(S) on both sides of self-attention, but "
                         f"{given}; pass natural_positions=False (the mask is then built from the positions).")
    if spans:
        return _splash_spans(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                             q_span_ids, kv_span_ids, sinks, window=window, scale=scale, interpret=bool(interpret),
                             soft_cap=check_soft_cap(logits_soft_cap))
    static_mask = natural_positions or not (is_causal or window is not None or segments)
    return _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sinks,
                       is_causal=bool(is_causal), window=window, scale=scale, interpret=bool(interpret),
                       soft_cap=check_soft_cap(logits_soft_cap), static_mask=bool(static_mask))


@partial(jax.jit, static_argnames=("is_causal", "window", "scale", "interpret", "soft_cap", "static_mask"))
def _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sinks, *,
                is_causal, window, scale, interpret, soft_cap, static_mask=False):
    """Jitted so that eager ``shard_map`` sees one primitive (the kernel is traced unchecked inside)."""
    B, T, H, d = q_BTHd.shape
    S = k_BSKd.shape[1]
    scale = d**-0.5 if scale is None else scale
    Tp, Sp = _padded(T), _padded(S)
    q = jnp.swapaxes(_pad_seq(q_BTHd * jnp.asarray(scale, q_BTHd.dtype), Tp), 1, 2)  # [B, H, T, d]
    k, v = (jnp.swapaxes(_pad_seq(a, Sp), 1, 2) for a in (k_BSKd, v_BSKd))
    i32 = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
    qpos, kpos = _pad_seq(i32(q_positions), Tp), _pad_seq(i32(kv_positions), Sp)
    qseg, kseg = _pad_seq(i32(q_segment_ids), Tp), _pad_seq(i32(kv_segment_ids), Sp)

    def row(q, k, v, qpos, kpos, qseg, kseg, known):
        return _one_row(q, k, v, qpos, kpos, qseg, kseg, sinks, T=T, S=S, is_causal=is_causal, window=window,
                        interpret=interpret, soft_cap=soft_cap, known=known)

    known = _per_row(_natural_masks(Tp, Sp, T, S, is_causal, window), B, q, k, v) if static_mask else None
    o_BHTd, has_key_BT = jax.vmap(row)(q, k, v, qpos, kpos, qseg, kseg, known)
    o = jnp.swapaxes(o_BHTd, 1, 2)[:, :T]
    # Each call's rows-with-a-key mask is tied to its own output: the masks of a layer's head
    # chunks are equal (same positions), so XLA would merge the chunks' selects into one fusion,
    # and chunk 0's output (and its all-to-all) would wait for chunk 1's kernel. Tied, chunk 0's
    # output all-to-all runs under chunk 1's kernel (benchmarks/RESULTS.md, defaults with splash).
    o, has_key_BT = lax.optimization_barrier((o, has_key_BT))
    return jnp.where(has_key_BT[:, :T, None, None], o, 0).astype(q_BTHd.dtype)


@partial(jax.jit, static_argnames=("window", "scale", "interpret", "soft_cap"))
def _splash_spans(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, q_span_ids,
                  kv_span_ids, sinks, *, window, scale, interpret, soft_cap):
    """Causal splash with span ids: the keys as one chunk of ``chunked_attention``."""
    return chunked_attention(q_BTHd, [(k_BSKd, v_BSKd, kv_positions, kv_segment_ids, kv_span_ids)],
                             q_positions=q_positions, q_segment_ids=q_segment_ids, q_span_ids=q_span_ids,
                             is_causal=True, window=window, scale=scale, soft_cap=soft_cap, interpret=interpret,
                             sinks=sinks)


def chunked_attention(q_BTHd, chunks, *, q_positions, q_segment_ids=None, q_span_ids=None, is_causal: bool,
                      window=None, scale=None, soft_cap=None, interpret: bool = False, sinks=None):
    """Splash attention of the queries to several chunks of keys, each prepared as a ring chunk
    (``ring_prepare``) and attended on its own, merged by log-sum-exp (``prepared_attention``): a
    chunk in hand is attended while another is still arriving.

    Args:
        q_BTHd: the queries.
        chunks: ``(k [B, S_i, K, d], v, positions [B, S_i], segment ids or None, span ids or None)`` each.
        q_positions, q_segment_ids, q_span_ids: the queries' metadata.
        is_causal, window, scale, soft_cap: the mask (``window``: ``(left, right)`` or None), scale, soft cap.
        interpret: Pallas interpret mode.
        sinks: ``[H]`` sink logits folded in once, or None.

    Returns:
        ``o`` ``[B, T, H, d]``.
    """
    prepared = [ring_prepare(q_BTHd, k, v, q_positions, q_segment_ids, scale=scale, is_causal=is_causal,
                             interpret=interpret, soft_cap=soft_cap, kv_seg_BT=seg, kv_pos_BT=pos, window=window,
                             span_BT=q_span_ids, kv_span_BT=span) for k, v, pos, seg, span in chunks]
    qx, qm = prepared[0][:2]  # the same for every chunk
    o = prepared_attention(qx, qm, tuple(p[2] for p in prepared), sinks, tuple(p[3] for p in prepared))
    return jnp.swapaxes(o[:, :, :q_BTHd.shape[1]], 1, 2)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def prepared_attention(qx, qm, homes: tuple, sinks, steps: tuple):
    """The queries ``qx`` (``ring_prepare``'s) attended to prepared chunks ``homes`` (one ``RingStep``
    each, ``steps``: the chunks may differ in length), merged by log-sum-exp, sinks folded in once:
    ``o [B, H, Tp, d]`` in the queries' dtype. Differentiable in ``qx``, the chunks' K/V and
    ``sinks``; the backward runs splash's backward kernels on each chunk with the merged output and
    log-sum-exp. A chunk's calls need only that chunk: one in hand is attended while another is
    still arriving."""
    return _prepared_fwd(qx, qm, homes, sinks, steps)[0]


def finish(o, lse, sinks, dtype):
    """The merged ``(o, lse)`` of every chunk with the sinks folded in once: ``(o in dtype, lse)``."""
    o, lse = fold_sinks(o, lse, sinks, head_axis=1)
    return o.astype(dtype), lse


def sinks_cotangent(sinks, lse, o, do):
    """``d loss / d sinks`` of a prepared call or ring (``None`` without sinks): padded query rows have
    ``do = 0``, so they add nothing."""
    if sinks is None:
        return None
    delta = jnp.einsum("bhtd,bhtd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    return sinks_grad(sinks, lse, delta, head_axis=1)


def _prepared_fwd(qx, qm, homes, sinks, steps):
    carry = None
    for home, step in zip(homes, steps, strict=True):
        carry = ring_forward_step(step, qx, qm, home, carry, 0)
    o, lse = finish(*carry, sinks, qx.dtype)
    return o, (qx, qm, homes, o, lse, sinks)


def _prepared_bwd(steps, res, do):
    qx, qm, homes, o, lse, sinks = res
    dq, dhomes = None, []
    for home, step in zip(homes, steps, strict=True):
        dq, dk, dv = ring_backward_step(step, qx, qm, home, o, lse, do, dq, 0)
        dhomes.append((dk.astype(home[0].dtype), dv.astype(home[1].dtype), *(None,) * (len(home) - 2)))
    return dq.astype(qx.dtype), jax.tree.map(lambda _: None, qm), tuple(dhomes), sinks_cotangent(sinks, lse, o, do)


prepared_attention.defvjp(_prepared_fwd, _prepared_bwd)


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
    window: tuple[int, int] | None = None
    natural: bool = False  # chunks of arange positions, no segments: masks known when traced (_natural_masks)
    span_static: tuple | None = None  # causal with span ids: the settings of each step's second call (_span_part)


def ring_prepare(q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT, *, scale, is_causal, interpret, soft_cap=None,
                 kv_seg_BT=None, kv_pos_BT=None, window=None, natural: bool = False, span_BT=None, kv_span_BT=None):
    """``(q [B, H, Tp, d] scaled, q metadata, home chunk, RingStep)``. The home chunk is
    ``(k [B, K, Sp, d], v, positions, segments)`` with each row's keys sorted by (segment,
    position); padding keys (beyond the chunk, or of a negative segment) carry segment
    ``int32 max`` and sort last. ``segments`` is None when there is neither padding nor a
    segment id, so that only what the mask needs travels. ``kv_seg_BT`` / ``kv_pos_BT``: the keys'
    segment ids / positions when they differ from the queries' (key padding; cross attention,
    where K/V are a chunk of other tokens, of their own length). ``window``: ``(left, right)``.
    ``natural``: every device's chunk holds the positions ``i T .. (i+1) T - 1`` (the default
    positions split over the ring), no segment ids, no window: nothing is sorted, the chunk travels
    without positions, and each step's mask is one of three known when traced (``_natural_masks``:
    the same chunk, an earlier or a later one), picked by the step's ``ahead``. ``span_BT`` /
    ``kv_span_BT``: span ids of the queries / keys (the keys': ``span_BT`` unless given); with a
    causal mask they travel with the keys (a fifth element of the chunk) and the queries' join the
    metadata, and each step adds the keys of a query's span after it (``_span_part``)."""
    B, T, H, d = q_BTHd.shape
    S, K = k_BTKd.shape[1], k_BTKd.shape[2]
    Tp, Sp = _padded(T), _padded(S)
    scale = d**-0.5 if scale is None else scale
    qx = jnp.swapaxes(_pad_seq(q_BTHd * jnp.asarray(scale, q_BTHd.dtype), Tp), 1, 2)
    i32 = lambda a, n: None if a is None else _pad_seq(jnp.asarray(a, jnp.int32), n)
    spans = bool(is_causal) and span_BT is not None  # not causal: every key is visible, spans change nothing
    if natural:
        given = [name for name, a in (("seg_BT", seg_BT), ("kv_seg_BT", kv_seg_BT), ("kv_pos_BT", kv_pos_BT),
                                      ("window", window), ("span_BT", span_BT if spans else None)) if a is not None]
        if given or S != T:
            raise ValueError(f"natural=True states arange chunks of self-attention, but {given or f'S={S} != T={T}'} "
                             "given; pass natural=False (masks are then built from the positions).")
    pos, seg = i32(pos_BT, Tp), i32(seg_BT, Tp)
    kx, vx = (jnp.swapaxes(_pad_seq(a, Sp), 1, 2) for a in (k_BTKd, v_BTKd))
    if natural:  # in order already, and no positions travel
        keys = (None, None)
    else:
        kpos = pos if kv_pos_BT is None else i32(kv_pos_BT, Sp)
        kseg_src = seg if kv_seg_BT is None else i32(kv_seg_BT, Sp)
        idx = jnp.broadcast_to(jnp.arange(Sp, dtype=jnp.int32), kpos.shape)
        if kseg_src is None and Sp == S and not spans:
            pos_s, perm = lax.sort((kpos, idx), num_keys=1)
            keys = (pos_s, None)
        else:
            seg0 = jnp.zeros_like(kpos) if kseg_src is None else kseg_src
            kseg = jnp.where((jnp.arange(Sp) >= S)[None] | (seg0 < 0), _IMAX, seg0)
            kseg_s, pos_s, perm = lax.sort((kseg, kpos, idx), num_keys=2)
            keys = (pos_s, kseg_s)
            if spans:  # the keys' span ids travel in the same order
                keys += (jnp.take_along_axis(i32(span_BT if kv_span_BT is None else kv_span_BT, Sp), perm, axis=1),)
        kx, vx = (jnp.take_along_axis(a, perm[:, None, :, None], axis=2) for a in (kx, vx))
    static = _static(Tp, Sp, interpret, soft_cap, window=window is not None, mqa=K == 1)
    span_static = _static(Tp, Sp, interpret, soft_cap, window=True, mqa=K == 1) if spans else None
    qm = (pos, seg, i32(span_BT, Tp) if spans else None)
    return qx, qm, (kx, vx, *keys), RingStep(T, bool(is_causal), seg is not None, static, window, natural, span_static)


def _ring_known(step: RingStep, qx, kv, ahead):
    """With ``step.natural``: the masks of the chunk in hand, known when traced up to which of three
    it is (this device's own, ``ahead == 0``; an earlier one; a later one), one per row and typed as
    the data (what ``_row_kernel_args`` takes as ``known``); else None."""
    if not step.natural:
        return None
    if ahead is None:
        raise ValueError("a ring step with natural positions needs ahead= (how many places before the queries' "
                         "own chunk the ring holds this one), as the ring's loops pass it.")
    Tp, Sp = qx.shape[2], kv[0].shape[2]
    masks = lambda keys: _natural_masks(Tp, Sp, step.T, step.T, step.is_causal, None, keys)
    known = masks("same")
    if step.is_causal:  # (not causal: every chunk is wholly visible, one mask)
        known = jax.tree.map(lambda a, b, c: jnp.where(ahead == 0, a, jnp.where(ahead > 0, b, c)),
                             known, masks("earlier"), masks("later"))
    # Tied to this call's queries: the masks of a layer's head chunks are equal, and one shared copy
    # lets XLA fuse the chunks' final merges into one, so chunk 0's output (and its all-to-all)
    # would wait for chunk 1's ring (as ``_splash_call`` ties its rows-with-a-key mask).
    known = lax.optimization_barrier((known, qx))[0]
    return _per_row(known, qx.shape[0], qx, kv[0])


def _row_kernel_args(step: RingStep, kv, qm, known=None):
    kpos, kseg = kv[2], kv[3]
    qpos, qseg = qm[0], qm[1]
    Tp = qpos.shape[0]
    if known is not None:
        return *known, None
    hi, lo = _bounds(qpos, is_causal=step.is_causal, window=step.window)
    packed = step.window is not None
    if kseg is None:  # no segments, no padding: keys sorted by position
        infos, has_key = _row_info((kpos,), (hi,), None if lo is None else (lo,), T=step.T, window=packed)
        return infos, has_key, None
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    if lo is not None:  # the window's lower bound, within the query's segment
        q_lo = (qseg0, lo)
    else:  # keys of earlier segments
        q_lo = None if qseg is None else (qseg0 - 1, jnp.full(Tp, _IMAX, jnp.int32))
    infos, has_key = _row_info((kseg, kpos), (qseg0, hi), q_lo, T=step.T, window=packed)
    return infos, has_key, _segment_ids(qseg, qseg0, kseg)


def _span_part(step: RingStep, kv, qm):
    """The second call of a causal step with span ids: each query's keys *after* it in its span (the
    first call has those at or before it, so the two are disjoint and merge by log-sum-exp).

    In the chunk's (segment, position) order those keys lie in the query's segment at positions
    ``pos_q < p <= e_q``, where ``e_q`` is the last key of the query's span (and segment) in the chunk
    within the window's right edge: one run ``lo_t <= s < hi_t`` (the packed two-bound mask), with
    span ids as the kernel's segment ids so that keys of other spans inside the run stay hidden.
    Exact for any spans; a span contiguous in position makes the run hold only its keys, so the
    blocks visited are the span's. Returns ``(infos, has_key, segment_ids)`` as ``_row_kernel_args``."""
    kpos, kseg, kspan = kv[2], kv[3], kv[4]
    qpos, qseg, qspan = qm
    Tp = qpos.shape[0]
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    edge = _IMAX if step.window is None else jnp.where(qpos > _IMAX - step.window[1], _IMAX, qpos + step.window[1])
    s_seg, s_span, s_pos = lax.sort((kseg, kspan, kpos), num_keys=3)  # keys grouped by (segment, span)
    last = _counts_le((kseg, kspan, kpos), (qseg0, qspan, jnp.broadcast_to(edge, (Tp,)))) - 1
    at = jnp.maximum(last, 0)
    end = s_pos[at]
    found = (last >= 0) & (s_seg[at] == qseg0) & (s_span[at] == qspan) & (qspan != 0) & (end > qpos)
    lo = _counts_le((kseg, kpos), (qseg0, qpos))
    hi = jnp.where(found, _counts_le((kseg, kpos), (qseg0, end)), lo)
    infos, has_key = _info_from_bounds(hi, lo, Sp=kpos.shape[0], T=step.T, window=True)
    return infos, has_key, sa.SegmentIds(q=qspan, kv=kspan)


def _forward_call(static, args, q, kv):
    """One splash forward on a row: ``(o, lse)`` in float32, rows that see no key zero / ``_NEG``."""
    infos, has_key, segment_ids = args
    o, (lse,) = _unchecked(  # the public kernel's forward, returning its log-sum-exp
        lambda infos, *a: _kernel(static, infos, save_residuals=True)(*a),
        infos, q, _kv_in(kv[0], static), _kv_in(kv[1], static), segment_ids)
    return (jnp.where(has_key[None, :, None], o.astype(jnp.float32), 0.0),
            jnp.where(has_key[None], lse.astype(jnp.float32), _NEG))


def ring_forward_step(step: RingStep, qx, qm, kv, carry=None, ahead=None):
    """Attends the queries to the chunk ``kv`` in hand; ``carry=(o, lse)`` of earlier chunks
    (float32, ``[B, H, Tp, d]`` and ``[B, H, Tp]``) is merged by log-sum-exp. ``ahead``: how many
    places before the queries' own chunk the ring holds ``kv``'s (what ``step.natural`` reads)."""
    def row(q, kv, qm, known):
        out = _forward_call(step.static, _row_kernel_args(step, kv, qm, known), q, kv)
        if step.span_static is None:
            return out
        return merge_softmax(out, _forward_call(step.span_static, _span_part(step, kv, qm), q, kv))

    o, lse = jax.vmap(row)(qx, kv, qm, _ring_known(step, qx, kv, ahead))
    o, lse = _vary_as(o, qx, kv[0]), _vary_as(lse, qx, kv[0])
    if carry is None:
        return o, lse
    return merge_softmax(carry, (o, lse))


def ring_backward_step(step: RingStep, qx, qm, kv, o, lse, do, dq=None, ahead=None):
    """``(dq, dk, dv)`` (float32) of the chunk ``kv`` given the final ``o`` (queries' dtype) and
    ``lse``: splash's backward kernels with the merged residuals, so summing over chunks gives
    the full gradient (``dq`` is added to). ``ahead``: as ``ring_forward_step``'s."""
    def grads(static, args, q, kv, o, lse, do):
        infos, _, segment_ids = args
        k, v = _kv_in(kv[0], static), _kv_in(kv[1], static)
        return _backward(static, (q, k, v, segment_ids, None, o, lse, infos[1], infos[2]), do)[:3]

    def row(q, kv, qm, o, lse, do, known):
        g = grads(step.static, _row_kernel_args(step, kv, qm, known), q, kv, o, lse, do)
        if step.span_static is None:
            return g
        g2 = grads(step.span_static, _span_part(step, kv, qm), q, kv, o, lse, do)
        return tuple(a.astype(jnp.float32) + b.astype(jnp.float32) for a, b in zip(g, g2))

    dq_s, dk, dv = jax.vmap(row)(qx, kv, qm, o, lse, do, _ring_known(step, qx, kv, ahead))
    dq_s, dk, dv = (_vary_as(g.astype(jnp.float32), qx, kv[0]) for g in (dq_s, dk, dv))
    return dq_s if dq is None else dq + dq_s, dk, dv
