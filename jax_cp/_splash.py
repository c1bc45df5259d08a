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
import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._blockwise import vma as _vma

__all__ = ["splash_attention", "splash_unsupported_reason", "LANES"]

LANES = 128  # splash block sizes are multiples of this
_IMAX = jnp.iinfo(jnp.int32).max


def splash_unsupported_reason(*, window) -> str | None:
    """Why splash cannot serve this mask (``None`` when it can)."""
    if window is not None:
        return (f"local_window_size={window} needs two bounds per query over explicit positions, "
                "which the splash mask cannot express")
    return None


def _block(length: int) -> int:
    """Largest of 512/256/128 dividing the (padded) length."""
    return next(b for b in (512, 256, 128) if length % b == 0)


def _pad_len(x, length, value):
    return jnp.pad(x, [(0, length - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


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


def _one_row(q_HTd, k_KSd, v_KSd, qpos, kpos, qseg, kseg, *, T, S, is_causal, interpret):
    """One batch row, already padded to block multiples; returns ``o_HTd`` and ``has_key_T``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    Tp, Sp = q_HTd.shape[1], k_KSd.shape[1]
    kseg0 = jnp.zeros(Sp, jnp.int32) if kseg is None else kseg
    kinv = ((jnp.arange(Sp) >= S) | (kseg0 < 0)).astype(jnp.int32)  # padding (negative segment) sorts last
    qseg0 = jnp.zeros(Tp, jnp.int32) if qseg is None else qseg
    perm = lax.sort((kinv, kseg0, kpos, jnp.arange(Sp, dtype=jnp.int32)), num_keys=3)[3]
    k_KSd, v_KSd, kseg_s = k_KSd[:, perm], v_KSd[:, perm], kseg0[perm]
    kv_keys = (kinv, kseg0, kpos)
    zeros = jnp.zeros(Tp, jnp.int32)
    hi = _counts_le(kv_keys, (zeros, qseg0, qpos if is_causal else jnp.full(Tp, _IMAX, jnp.int32)))
    lo = _counts_le(kv_keys, (zeros, qseg0 - 1, jnp.full(Tp, _IMAX, jnp.int32)))  # keys of earlier segments
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
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    fwd, dq, dkv = _mask_info(block_mask, j_next), _mask_info(block_mask, j_next), _mask_info(block_mask, i_next)
    fwd, dq, dkv = (m._replace(q_sequence=hi) for m in (fwd, dq, dkv))
    static = tuple(sorted({**_kernel_kwargs(sizes, interpret), "save_residuals": False}.items()))
    segment_ids = None if qseg is None else sa.SegmentIds(q=qseg0, kv=kseg_s)
    return _unchecked_call(static, (fwd, dq, dkv), q_HTd, k_KSd, v_KSd, segment_ids), has_key


def _no_vma_check():
    """Splash's ``pallas_call`` declares outputs without manual-axis types, which
    ``shard_map(check_vma=True)`` rejects; trace the kernel itself unchecked.

    We call splash's own forward/backward halves (private, pinned to the
    installed jax) in our ``custom_vjp`` and retype the results as varying
    over the inputs' axes, so outside the kernel the checks stay on."""
    from jax._src import config

    state = getattr(config, "_check_vma", None)
    return state(False) if state is not None else contextlib.nullcontext()


def _vary_as(x, *refs):
    """``x`` retyped to vary over the manual axes the ``refs`` vary over (no data movement)."""
    want, have = frozenset().union(*map(_vma, refs)), _vma(x)
    return lax.pcast(x, tuple(sorted(want - have)), to="varying") if want - have else x


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unchecked_call(static, infos, q, k, v, segment_ids):
    return _unchecked_fwd(static, infos, q, k, v, segment_ids)[0]


def _unchecked_fwd(static, infos, q, k, v, segment_ids):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    with _no_vma_check():
        o, res = ska._splash_attention_fwd(*infos, q, k, v, segment_ids, None, **dict(static))
    return _vary_as(o, q, k, v), (res, q, k, v, infos, segment_ids)


def _unchecked_bwd(static, res, do):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    res, q, k, v, infos, segment_ids = res
    with _no_vma_check():
        grads = ska._splash_attention_bwd(**dict(static), res=res, do=do)
    dq, dk, dv = grads[3:6]
    none = lambda t: jax.tree.map(lambda _: None, t)
    return none(infos), _vary_as(dq, q), _vary_as(dk, k), _vary_as(dv, v), none(segment_ids)


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


def _kernel_kwargs(sizes, interpret: bool) -> dict:
    """The kernel's static settings, taken from a one-block template (no mask processing at scale)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([_below_bound_class()((sizes.block_q, sizes.block_kv))])
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret).kwargs


def splash_attention(
    q_BTHd, k_BSKd, v_BSKd, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    is_causal=False, local_window_size=None, scale=None, interpret: bool = False,
):
    """Splash attention with our data-defined masks (causal/full, segments; no window).

    ``interpret=True`` runs the Pallas kernel in interpret mode (any backend,
    slow: for tests). Rows that see no key return zeros.
    """
    reason = splash_unsupported_reason(window=local_window_size)
    if reason:
        raise ValueError(f"kernel='splash': {reason}; use kernel='blockwise' (or 'auto').")
    return _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                       is_causal=bool(is_causal), scale=scale, interpret=bool(interpret))


@partial(jax.jit, static_argnames=("is_causal", "scale", "interpret"))
def _splash_jit(q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
                is_causal, scale, interpret):
    """Jitted so that eager ``shard_map`` sees one primitive (the kernel is traced unchecked inside)."""
    B, T, H, d = q_BTHd.shape
    S = k_BSKd.shape[1]
    scale = d**-0.5 if scale is None else scale
    Tp, Sp = -(-T // LANES) * LANES, -(-S // LANES) * LANES
    pad = lambda x, n, val=0: None if x is None else jnp.moveaxis(_pad_len(jnp.moveaxis(x, 1, 0), n, val), 0, 1)
    q = jnp.swapaxes(pad(q_BTHd * jnp.asarray(scale, q_BTHd.dtype), Tp), 1, 2)  # [B, H, T, d]
    k, v = (jnp.swapaxes(pad(a, Sp), 1, 2) for a in (k_BSKd, v_BSKd))
    i32 = lambda a: None if a is None else jnp.asarray(a, jnp.int32)
    qpos, kpos = pad(i32(q_positions), Tp), pad(i32(kv_positions), Sp)
    qseg, kseg = pad(i32(q_segment_ids), Tp), pad(i32(kv_segment_ids), Sp)

    def row(q, k, v, qpos, kpos, qseg, kseg):
        return _one_row(q, k, v, qpos, kpos, qseg, kseg, T=T, S=S, is_causal=is_causal, interpret=interpret)

    o_BHTd, has_key_BT = jax.vmap(row)(q, k, v, qpos, kpos, qseg, kseg)
    o = jnp.swapaxes(o_BHTd, 1, 2)[:, :T]
    return jnp.where(has_key_BT[:, :T, None, None], o, 0).astype(q_BTHd.dtype)
