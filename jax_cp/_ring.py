"""Ring exchange over ``cp_colossal``: K/V rotate, queries stay, memory O(S/c) per device.

Each of the ``c`` steps (a loop, so only one remote chunk is live) attends the
local queries to the K/V chunk in hand (blockwise kernel; fully masked steps
cost no block work), continuing the running online softmax, while ``lax.ppermute``
already moves the next chunk (issued before the step's compute so the
scheduler can overlap them). The ``custom_vjp`` backward rotates K/V again,
with their float32 dK/dV accumulators travelling alongside and arriving home
after the last step.
Letters: B batch, T local sequence (S/c), H local query heads, K local kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp import _blockwise as bw

__all__ = ["ring_attention"]


def _shift(tree, axis_name: str, c: int):
    """Every device passes ``tree`` to the next rank on the ring."""
    return lax.ppermute(tree, axis_name, [(i, (i + 1) % c) for i in range(c)])


def _forward(q, k, v, pos, seg, axis_name, spec):
    c = lax.axis_size(axis_name)
    qm = bw.Meta(pos, seg)

    def attend(carry, kv):  # continues the running softmax: no second output buffer
        return bw.forward(q, kv[0], kv[1], qm, bw.Meta(kv[2], kv[3]), spec, state=carry)

    def step(_, state):
        carry, kv = state
        nxt = _shift(kv, axis_name, c)  # issued first: in flight while this chunk is attended
        return attend(carry, kv), nxt

    kv = (k, v, pos, seg)
    if c == 1:
        return attend(None, kv)
    nxt = _shift(kv, axis_name, c)
    carry = attend(None, kv)  # step 0: the chunk at home
    carry, kv = lax.fori_loop(0, c - 2, step, (carry, nxt))  # one step at a time: O(S/c) live
    return attend(carry, kv)  # the last chunk needs no onward shift


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

    def grads(kv, dq=None):  # dq accumulates in place
        return bw.backward(q, kv[0], kv[1], do, lse, delta, qm, bw.Meta(kv[2], kv[3]), spec, dq=dq)

    # Step 0: the chunk at home. Later steps first start two transfers, the next
    # K/V chunk and the float32 dK/dV accumulator of the chunk now in hand (the
    # neighbour summed it one step earlier), then compute under both.
    kv = (k, v, pos, seg)
    nxt = _shift(kv, axis_name, c) if c > 1 else None
    dq, dk, dv = grads(kv)

    def step(_, state):
        dq, acc, kv = state
        recv, nxt = _shift(acc, axis_name, c), _shift(kv, axis_name, c)
        dq, dk_s, dv_s = grads(kv, dq)
        return dq, (recv[0] + dk_s, recv[1] + dv_s), nxt

    if c > 1:
        dq, (dk, dv), kv = lax.fori_loop(0, c - 2, step, (dq, (dk, dv), nxt))
        recv = _shift((dk, dv), axis_name, c)  # last step: no K/V left to fetch
        dq, dk_s, dv_s = grads(kv, dq)
        dk, dv = recv[0] + dk_s, recv[1] + dv_s
        dk, dv = _shift((dk, dv), axis_name, c)  # complete accumulators go home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


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
