"""The gated delta rule (Gated DeltaNet, Kimi's KDA) on the context-parallel mesh: the public entry.
Letters: B batch, S sequence, L tokens per colossal rank, H heads, k key dim, v value dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_cp.linear._args import check_gdn, check_state, refuse_spans
from jax_cp.linear._chunk import gdn_intra
from jax_cp.linear._cp import HEADS, META, STATE, chunked, layout, placed_meta, run, shard_state, to_heads, \
    to_seq, unchunked
from jax_cp.linear._recurrent import default_scale, gated_delta_step

__all__ = ["gated_delta_rule", "gated_delta_step"]


def gated_delta_rule(q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH, *, mesh=None, positions=None, segment_ids=None,
                     initial_state=None, chunk_size=64, return_state=False, scale=None, span_ids=None,
                     max_pieces=None):
    """The gated delta rule over a sequence, chunked, on one device or a context-parallel mesh.

    Per head, token by token: ``S_t = S_{t-1} diag(exp(g_t)) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``
    and ``o_t = S_t q_t * scale`` (``S`` is ``[dv, dk]``, float32). Computed chunk by chunk
    (flash-linear-attention's WY/UT form); with a mesh, each device folds its tokens into state maps,
    one all-gather over ``cp_colossal`` hands every run of tokens the state of its predecessors in
    document order, and ``cp_ulysses`` turns the sequence into heads.

    Args:
        q_BSHk, k_BSHk: ``[B, S, H, dk]`` queries and keys (Qwen3-Next L2-normalises both first).
        v_BSHv: ``[B, S, H, dv]`` values.
        g_BSH: ``[B, S, H]`` log decays ``g <= 0`` (``exp(g)`` the forget gate), or ``[B, S, H, dk]``
            one per key channel (KDA; the chunk then holds ``C*C*dk`` decays: prefer ``chunk_size=16``).
        beta_BSH: ``[B, S, H]`` write strengths (``sigmoid`` of a projection).
        mesh: ``None`` (one device) or a :func:`jax_cp.make_mesh` mesh: global arrays whose sequence is
            sharded ``P("dp", ("cp_colossal", "cp_ulysses"), "tp", None)``, as ``dot_product_attention``'s.
        positions, segment_ids: ``[B, S]`` (or ``[S]``) ints, each token's position in its document and
            the document's id, in any order (natural, dual-chunk, a dispatch plan's); default
            ``arange(S)`` and one document. A token continues the token of its document at position - 1
            wherever that sits; anything else starts a document.
        initial_state: ``[B, H, dv, dk]`` the state each document starts from (default zero).
        chunk_size: tokens per chunk of the chunked form (at most ``S/cp_colossal`` are used).
        return_state: also return each row's last document's final state (the greatest segment id
            >= 0, after its greatest position; zero if none): what a decode continues from.
        scale: the query scale (default ``dk ** -0.5``, as flash-linear-attention and Qwen3-Next).
        span_ids: refused (a recurrence cannot see a span's later tokens).
        max_pieces: slots per ``cp_colossal`` rank: the most runs on one rank that continue a document
            from elsewhere, or that a run elsewhere continues, plus the row's final token. The natural
            and dual-chunk orders need at most 3; a dispatch plan at most twice its chunks per rank. Each slot moves ``(dk + dv) * dk`` floats per head; rows that need more
            slots come out NaN. Default: counted on the host when ``positions`` and ``segment_ids`` are
            concrete (not traced; the defaults are), rounded up to a power of two; traced,
            ``min(S/c, 16)``.

    Returns:
        ``o [B, S, H, dv]`` in ``v``'s dtype (sharded as the inputs), and with ``return_state`` the
        state ``[B, H, dv, dk]`` float32.

    Raises:
        ValueError: shapes, dtypes, a mesh the batch, heads or sequence do not divide, ``span_ids``.
    """
    refuse_spans(span_ids)
    B, S, H, dk, dv = check_gdn(q_BSHk, k_BSHk, v_BSHv, g_BSH, beta_BSH, chunk_size)
    lay = layout(mesh, B, S, H, chunk_size, max_pieces)
    x0 = check_state("initial_state", initial_state, (B, H, dv, dk), "[B, H, dv, dk]")
    initial, x0 = x0 is not None, jnp.zeros((B, H, dv, dk), jnp.float32) if x0 is None else x0
    pos, seg, lay = placed_meta(positions, segment_ids, B, S, mesh, lay, sized=max_pieces is None)
    g = g_BSH if g_BSH.ndim == 4 else g_BSH[..., None]
    o, final = _gdn(q_BSHk, k_BSHk, v_BSHv, g, beta_BSH[..., None], pos, seg, x0, lay=lay,
                    scale=default_scale(scale, dk), initial=initial)
    return (o, final) if return_state else o


@partial(jax.jit, static_argnames=("lay", "scale", "initial"))
def _gdn(q, k, v, g, beta, pos, seg, x0, *, lay, scale, initial):
    body = partial(_gdn_shard, lay=lay, scale=scale, initial=initial)
    return run(body, lay, (q, k, v, g, beta, pos, seg, x0), (HEADS,) * 5 + (META, META, STATE), (HEADS, STATE))


def _gdn_shard(q, k, v, g, beta, pos, seg, x0, *, lay, scale, initial):
    """One device: heads in, the chunk parts, the state passing, the sequence back."""
    dtype, ref = v.dtype, q
    q, k, v, g, beta = to_heads(lay, (q, k, v, g, beta))
    L = q.shape[1]
    cq, ck, cv, cg, cb = (chunked(a, lay.chunk) for a in (q, k, v, g, beta))
    intra = lambda r: gdn_intra(cq * scale, ck, cv, cg, cb[..., 0], r)  # noqa: E731
    o, final = shard_state(lay, intra, pos, seg, x0, ref, initial=initial)
    return to_seq(lay, unchunked(o, L).astype(dtype)), final
