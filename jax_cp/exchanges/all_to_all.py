"""``AllToAll``: K/V reach every token in one all-to-all over both CP axes (``spread_kv``).

What the Ulysses all-to-all followed by the colossal all-gather deliver (every
token, this device's ``cp_ulysses`` head group), in one collective, asynchronous
on every TPU generation. Its own all-to-all carries K and V, so Q cannot share
it (no fused Q/K/V exchange).
Letters: B batch, T local tokens, S sequence, P the stacked K and V, H kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._mesh import COLOSSAL, ULYSSES
from jax_cp.exchanges._base import KVExchange, Meta, attend_gathered, pair_kv, register

__all__ = ["AllToAll", "spread_kv"]


def _spread_axes(colossal: str, ulysses: str | None):
    axes = (colossal,) if ulysses is None else (colossal, ulysses)
    return axes, lax.axis_size(colossal), 1 if ulysses is None else lax.axis_size(ulysses)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def spread_kv(x_BTPHd, colossal: str, ulysses: str | None = None):
    """``[B, S/(c*u), P, H, d] -> [B, S, P, H/u, d]`` in one all-to-all over both CP axes.

    Each device sends its tokens' head group ``j`` to every device whose
    ``cp_ulysses`` rank is ``j``: the bytes of the two steps it replaces.
    ``ulysses=None``: heads already split, the gather over ``colossal`` alone
    as an all-to-all of ``c`` copies (asynchronous on TPU, unlike all-gather off v5e).
    Backward: the cotangent goes back by the inverse all-to-all in its own dtype
    (exact: the sum happens after it) and the ``c`` copies of each block are
    summed in float32.
    """
    axes, c, u = _spread_axes(colossal, ulysses)
    if c * u == 1:
        return x_BTPHd
    B, T, Pp, H, d = x_BTPHd.shape
    y = x_BTPHd.reshape(B, T, Pp, u, H // u, d).transpose(0, 1, 3, 2, 4, 5)  # [B, T, u, P, H/u, d]
    y = jnp.broadcast_to(y[:, :, None], (B, T, c, u, Pp, H // u, d)).reshape(B, T, c * u, Pp, H // u, d)
    y = lax.all_to_all(y, axes, 2, 1, tiled=True)  # [B, S, 1, P, H/u, d]: sources in mesh order
    return y.reshape(B, c * u * T, Pp, H // u, d)


def _spread_fwd(x, colossal, ulysses):
    return spread_kv(x, colossal, ulysses), jnp.zeros((0,), x.dtype)


def _spread_bwd(colossal, ulysses, dtype_carrier, g_BSPhd):
    axes, c, u = _spread_axes(colossal, ulysses)
    if c * u == 1:
        return (g_BSPhd,)
    B, S, Pp, h, d = g_BSPhd.shape
    acc = jnp.promote_types(g_BSPhd.dtype, jnp.float32)
    g = lax.all_to_all(g_BSPhd.reshape(B, S, 1, Pp, h, d), axes, 1, 2, tiled=True)  # [B, T, c*u, P, h, d]
    g = g.reshape(B, S // (c * u), c, u, Pp, h, d).astype(acc).sum(2)  # the c copies of each head group
    g = g.transpose(0, 1, 3, 2, 4, 5).reshape(B, S // (c * u), Pp, u * h, d)
    return (g.astype(dtype_carrier.dtype),)


spread_kv.defvjp(_spread_fwd, _spread_bwd)


@register
class AllToAll(KVExchange):
    """The all-gather's result by all-to-all: async on every TPU; with ``cp_ulysses``, one collective for both axes."""

    name = "all_to_all"
    fuses_qkv = False
    no_fuse_reason = "K and V then take their own all-to-all over both CP axes"

    def attend(self, q_BTHd, k_BTKd, v_BTKd, meta: Meta, spec, sinks=None):
        kv = spread_kv(pair_kv(k_BTKd, v_BTKd), COLOSSAL)
        return attend_gathered(q_BTHd, kv, meta, spec, sinks)

    def attend_local(self, q_BTHd, k_BtKd, v_BtKd, meta: Meta, spec, sinks=None):
        if lax.axis_size(COLOSSAL) == 1:  # pure Ulysses: the Ulysses all-to-all is the whole exchange
            return super().attend_local(q_BTHd, k_BtKd, v_BtKd, meta, spec, sinks)
        kv = spread_kv(pair_kv(k_BtKd, v_BtKd), COLOSSAL, ULYSSES)
        return attend_gathered(q_BTHd, kv, meta, spec, sinks)
