"""Mamba-2's SSD on the context-parallel mesh: the public entry.
Letters: B batch, S sequence, H heads, G groups, p head dim, n state dim.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jax_cp.linear._args import check_ssd, check_state, refuse_spans
from jax_cp.linear._chunk import ssd_intra
from jax_cp.linear._cp import HEADS, META, STATE, chunked, layout, placed_meta, run, shard_state, to_heads, \
    to_seq, unchunked
from jax_cp.linear._products import scaled
from jax_cp.linear._recurrent import mamba2_step

__all__ = ["mamba2_ssd", "mamba2_step"]


def mamba2_ssd(x_BSHp, dt_BSH, A_H, B_BSGn, C_BSGn, *, D_H=None, mesh=None, positions=None, segment_ids=None,
               initial_state=None, chunk_size=64, return_state=False, span_ids=None, max_pieces=None):
    """Mamba-2's selective state space model (SSD) over a sequence, chunked, on one device or a mesh.

    Per head, token by token: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``
    (``h`` is ``[p, n]``, float32). The state passing is the gated delta rule's with a scalar map, so a
    slot moves ``p * n + 1`` floats per head.

    Args:
        x_BSHp: ``[B, S, H, p]`` inputs.
        dt_BSH: ``[B, S, H]`` steps (positive: ``softplus(dt + dt_bias)`` already applied).
        A_H: ``[H]`` decay rates (negative, ``-exp(A_log)``).
        B_BSGn, C_BSGn: ``[B, S, G, n]`` input and output projections; ``G`` divides ``H`` (head ``h``
            reads group ``h // (H/G)``). On a mesh whose ``tp*cp_ulysses`` does not divide ``G``, groups
            are repeated to ``lcm(G, tp*cp_ulysses)`` first.
        D_H: ``[H]`` skip weights (optional).
        mesh, positions, segment_ids, chunk_size, span_ids, max_pieces: as
            :func:`jax_cp.linear.gated_delta_rule`.
        initial_state: ``[B, H, p, n]`` the state each document starts from (default zero).
        return_state: also return the last document's final state ``[B, H, p, n]``.

    Returns:
        ``y [B, S, H, p]`` in ``x``'s dtype, and with ``return_state`` the state.

    Raises:
        ValueError: shapes, dtypes, a mesh the batch, heads or sequence do not divide, ``span_ids``.
    """
    refuse_spans(span_ids)
    Bz, S, H, p, n = check_ssd(x_BSHp, dt_BSH, A_H, B_BSGn, C_BSGn, D_H, chunk_size)
    lay = layout(mesh, Bz, S, H, chunk_size, max_pieces)
    x0 = check_state("initial_state", initial_state, (Bz, H, p, n), "[B, H, p, n]")
    initial, x0 = x0 is not None, jnp.zeros((Bz, H, p, n), jnp.float32) if x0 is None else x0
    pos, seg, lay = placed_meta(positions, segment_ids, Bz, S, mesh, lay, sized=max_pieces is None)
    G = B_BSGn.shape[2]
    rep = math.lcm(G, lay.t * lay.u) // G  # whole groups on every device that holds their heads
    b, c = (jnp.repeat(a, rep, axis=2) if rep > 1 else a for a in (B_BSGn, C_BSGn))
    dt = dt_BSH.astype(jnp.float32)
    xdt, g = scaled(x_BSHp.astype(jnp.float32), dt), (dt * A_H.astype(jnp.float32)[None, None])[..., None]
    y, final = _ssd(xdt, g, b, c, pos, seg, x0, lay=lay, dtype=jnp.dtype(x_BSHp.dtype), initial=initial)
    if D_H is not None:
        skip = x_BSHp.astype(jnp.float32) * D_H.astype(jnp.float32)[None, None, :, None]
        y = (y.astype(jnp.float32) + skip).astype(y.dtype)
    return (y, final) if return_state else y


@partial(jax.jit, static_argnames=("lay", "dtype", "initial"))
def _ssd(xdt, g, b, c, pos, seg, x0, *, lay, dtype, initial):
    body = partial(_ssd_shard, lay=lay, dtype=dtype, initial=initial)
    return run(body, lay, (xdt, g, b, c, pos, seg, x0), (HEADS,) * 4 + (META, META, STATE), (HEADS, STATE))


def _ssd_shard(xdt, g, b, c, pos, seg, x0, *, lay, dtype, initial):
    """One device: heads in (groups repeated to the local heads), chunk parts, state passing, sequence back."""
    ref = xdt
    xdt, g, b, c = to_heads(lay, (xdt, g, b, c))
    L, H = xdt.shape[1:3]
    b, c = (jnp.repeat(a, H // a.shape[2], axis=2) for a in (b, c))
    cx, cg, cb, cc = (chunked(a, lay.chunk) for a in (xdt, g, b, c))
    o, final = shard_state(lay, lambda r: ssd_intra(cc, cb, cx, cg, r), pos, seg, x0, ref, initial=initial)
    return to_seq(lay, unchunked(o, L).astype(dtype)), final
