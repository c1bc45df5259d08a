"""``AllGather``: K and V (one stacked tensor) all-gathered along the sequence over ``cp_colossal``.

Backward of the gather: the cotangent cut into ``c`` sequence blocks and sent
block ``i`` to device ``i`` by one all-to-all in its own dtype (a bf16 cotangent's
values are exact in bf16: float32 on the wire would double the bytes and add
nothing), and the ``c`` blocks summed in float32 on arrival — the bytes of a
reduce-scatter, but asynchronous on TPU, where reduce-scatter is not.
Letters: B batch, T local tokens (S/c), S sequence.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._mesh import COLOSSAL
from jax_cp.exchanges._base import KVExchange, Meta, attend_gathered, pair_kv, register

__all__ = ["AllGather", "gather_seq"]


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_seq(x_BT, axis_name: str):
    """``[B, S/c, ...] -> [B, S, ...]``: all-gather along the sequence (axis 1)."""
    if lax.axis_size(axis_name) == 1:
        return x_BT
    return lax.all_gather(x_BT, axis_name, axis=1, tiled=True)


def _gather_fwd(x, axis_name):
    return gather_seq(x, axis_name), jnp.zeros((0,), x.dtype)


def _gather_bwd(axis_name, dtype_carrier, g):
    c = lax.axis_size(axis_name)
    if c == 1:
        return (g,)
    B, S = g.shape[:2]
    acc = jnp.promote_types(g.dtype, jnp.float32)
    blocks = lax.all_to_all(g.reshape(B, c, S // c, *g.shape[2:]), axis_name, 1, 1, tiled=True)  # block i -> device i
    return (blocks.astype(acc).sum(1).astype(dtype_carrier.dtype),)


gather_seq.defvjp(_gather_fwd, _gather_bwd)


@register
class AllGather(KVExchange):
    """Every device gathers all K/V: O(S) K/V memory per device, one collective per layer chunk."""

    name = "all_gather"

    def attend(self, q_BTHd, k_BTKd, v_BTKd, meta: Meta, spec, sinks=None):
        # K and V travel in one collective: fewer, larger exchanges leave more compute to hide
        # each under (TPU runs one all-to-all at a time).
        kv = gather_seq(pair_kv(k_BTKd, v_BTKd), COLOSSAL)
        return attend_gathered(q_BTHd, kv, meta, spec, sinks)
