"""Ring exchange over ``cp_colossal``: K/V rotate, queries stay, memory O(S/c) per device.

Each of the ``c`` steps attends the local queries to the K/V chunk in hand
(blockwise kernel, fully masked steps cost no block work) and merges it by
log-sum-exp, while ``lax.ppermute`` already moves the next chunk (issued before
the step's compute so the scheduler can overlap them). The ``custom_vjp``
backward rotates K/V again, with their float32 dK/dV accumulators travelling
alongside and arriving home after the last step.
Letters: B batch, T local sequence (S/c), H local query heads, K local kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp import _blockwise as bw

__all__ = ["ring_attention", "merge"]


def _shift(tree, axis_name: str, c: int):
    """Every device passes ``tree`` to the next rank on the ring."""
    return lax.ppermute(tree, axis_name, [(i, (i + 1) % c) for i in range(c)])


def merge(o_BTHd, lse_BTH, o2_BTHd, lse2_BTH):
    """Combines two normalised partial attentions by their log-sum-exps (float32)."""
    lse = jnp.logaddexp(lse_BTH, lse2_BTH)
    w1, w2 = jnp.exp(lse_BTH - lse)[..., None], jnp.exp(lse2_BTH - lse)[..., None]
    return w1 * o_BTHd + w2 * o2_BTHd, lse


def _forward(q, k, v, pos, seg, axis_name, spec):
    c = lax.axis_size(axis_name)
    qm = bw.Meta(pos, seg)
    kv = (k, v, pos, seg)
    o = lse = None
    for step in range(c):
        nxt = _shift(kv, axis_name, c) if step < c - 1 else None  # in flight during this step
        o_s, lse_s = bw.forward(q, kv[0], kv[1], qm, bw.Meta(kv[2], kv[3]), spec)
        o, lse = (o_s, lse_s) if o is None else merge(o, lse, o_s, lse_s)
        kv = nxt
    return o, lse


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, pos, seg, axis_name, spec):
    return _forward(q, k, v, pos, seg, axis_name, spec)[0].astype(q.dtype)


def _ring_fwd(q, k, v, pos, seg, axis_name, spec):
    o, lse = _forward(q, k, v, pos, seg, axis_name, spec)
    o = o.astype(q.dtype)
    return o, (q, k, v, pos, seg, o, lse)


def _ring_bwd(axis_name, spec, res, do):
    q, k, v, pos, seg, o, lse = res
    c = lax.axis_size(axis_name)
    qm = bw.Meta(pos, seg)
    delta = jnp.einsum("bthd,bthd->bth", do.astype(jnp.float32), o.astype(jnp.float32))
    kv = (k, v, pos, seg)
    dq = dkv = None
    for step in range(c):
        nxt = _shift(kv, axis_name, c) if step < c - 1 else None
        dq_s, dk_s, dv_s = bw.backward(q, kv[0], kv[1], do, lse, delta, qm, bw.Meta(kv[2], kv[3]), spec)
        dq = dq_s if dq is None else dq + dq_s
        dkv = (dk_s, dv_s) if dkv is None else (dkv[0] + dk_s, dkv[1] + dv_s)
        dkv = _shift(dkv, axis_name, c)  # the accumulators follow their chunk; after step c-1 they are home
        kv = nxt
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT=None, *, axis_name: str, is_causal=False, local_window_size=None,
    scale=None, block_q: int = 512, block_kv: int = 512,
):
    """Attention of this device's chunk to every chunk on the ``axis_name`` ring (inside ``shard_map``).

    Inputs are the device's contiguous chunk (queries, keys, values, their global
    positions and segment ids); returns ``o [B, T, H, d]``. ``c = 1`` is plain
    blockwise attention.
    """
    spec = bw.make_spec(q_BTHd.shape[-1], is_causal=is_causal, local_window_size=local_window_size,
                        scale=scale, block_q=block_q, block_kv=block_kv)
    pos = jnp.asarray(pos_BT, jnp.int32)
    seg = None if seg_BT is None else jnp.asarray(seg_BT, jnp.int32)
    return _ring(q_BTHd, k_BTKd, v_BTKd, pos, seg, axis_name, spec)
