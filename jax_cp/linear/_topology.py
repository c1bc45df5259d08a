"""Which token continues which: the document order of a row in any layout, found from positions and
segment ids (never from array indices), and the slots of the state exchange.

A token continues the token of its document (segment id) at its position - 1, wherever that token
sits. Over a row split into ``c`` equal parts of ``L`` tokens (one per ``cp_colossal`` rank), each
token is a continuation (``CONT``: its predecessor is the token just before it on the same rank), a
document start (``START``: no predecessor anywhere) or a cut (``CUT``: its predecessor lives
elsewhere). A run is a token that is not ``CONT`` and the ``CONT`` tokens after it. A run ending at an
*exported tail* (a token whose successor lives elsewhere, or the row's final token) hands its state
on through one of ``P`` slots per rank; each ``CUT`` run receives the state of its predecessor's slot.
Every rank computes this for the whole row (integers, ``O(S log S)``), so the slots' order and links
are known everywhere and only the states travel.
Letters: B batch, S sequence, L tokens per rank, c ranks, P slots per rank.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["CONT", "CUT", "START", "Topology", "running", "topology"]

CONT, START, CUT = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Topology:
    """One rank's view of the row's document order (all int32/bool arrays, ``B`` rows).

    Attributes:
        kind: ``[B, L]`` each local token's ``CONT``/``START``/``CUT``.
        cut_slot: ``[B, L]`` a ``CUT`` token's local slot (``P`` for other tokens).
        cut_tok: ``[B, P]`` the local token of each ``CUT`` slot (0 where unused).
        gov: ``[B, L]`` the local slot of the ``CUT`` that began the token's run, ``P`` if a ``START`` did.
        tail_tok: ``[B, P]`` the local token of each exported slot (0 where unused).
        tail_ok: ``[B, P]`` the slot is used.
        cut_feed: ``[B, P]`` the global slot (rank * P + slot) whose state each local ``CUT`` slot
            receives, ``-1`` where unused.
        order: ``[B, c*P]`` the global slots in document order (unused last).
        linked: ``[B, c*P]`` the slot at ``order[m]`` continues the one at ``order[m - 1]``.
        final: ``[B]`` the global slot of the row's final token (its last document's greatest
            position), ``-1`` if the row has no document (segment ids all negative).
        ok: ``[B]`` no rank needs more than ``P`` slots (else the row's results are NaN).
    """

    kind: jax.Array
    cut_slot: jax.Array
    cut_tok: jax.Array
    gov: jax.Array
    tail_tok: jax.Array
    tail_ok: jax.Array
    cut_feed: jax.Array
    order: jax.Array
    linked: jax.Array
    final: jax.Array
    ok: jax.Array


def running(op, x, axis: int = -1):
    """The ``op``-prefix along ``axis`` (``jnp.add``: cumsum, ``jnp.maximum``: cummax), by
    ``lax.associative_scan``: log-depth adds of slices, the same on every backend."""
    return lax.associative_scan(op, x, axis=axis)


def _links(pos_S, seg_S):
    """``(pred, succ)`` ``[S]``: the array index of each token's predecessor / successor, or -1."""
    S = pos_S.shape[0]
    s_seg, s_pos, s_idx = lax.sort((seg_S, pos_S, jnp.arange(S, dtype=jnp.int32)), num_keys=2)
    linked = (s_seg[1:] == s_seg[:-1]) & (s_pos[1:] == s_pos[:-1] + 1)
    none = jnp.full((S,), -1, jnp.int32)
    pred = none.at[s_idx[1:]].set(jnp.where(linked, s_idx[:-1], -1))
    succ = none.at[s_idx[:-1]].set(jnp.where(linked, s_idx[1:], -1))
    return pred, succ


def _rank_in_block(flag_S, c: int):
    """Each flagged token's rank among the flagged tokens of its block (``c`` equal blocks)."""
    f = flag_S.reshape(c, -1).astype(jnp.int32)
    return (running(jnp.add, f, axis=1) - 1).reshape(-1)


def _final_token(pos_S, seg_S):
    """The last document's (greatest segment id >= 0) token of greatest position, -1 if none."""
    last = jnp.max(jnp.where(seg_S >= 0, seg_S, -1))
    score = jnp.where((seg_S == last) & (last >= 0), pos_S.astype(jnp.float32), -jnp.inf)
    return jnp.where(last >= 0, jnp.argmax(score), -1).astype(jnp.int32)


def _row(pos_S, seg_S, rank, c: int, P: int):
    """One row's ``Topology`` fields (without the batch axis) for colossal rank ``rank``."""
    S = pos_S.shape[0]
    L = S // c
    g = jnp.arange(S, dtype=jnp.int32)
    loc = g % L
    pred, succ = _links(pos_S, seg_S)
    cont = (pred == g - 1) & (loc != 0)
    kind = jnp.where(cont, CONT, jnp.where(pred >= 0, CUT, START))
    final = _final_token(pos_S, seg_S)
    exported = ((succ >= 0) & ~((succ == g + 1) & (loc != L - 1))) | (g == final)
    t_rank, c_rank = _rank_in_block(exported, c), _rank_in_block(kind == CUT, c)
    ok = (jnp.max(jnp.where(exported, t_rank, -1)) < P) & (jnp.max(jnp.where(kind == CUT, c_rank, -1)) < P)
    gslot = jnp.where(exported & (t_rank < P), (g // L) * P + t_rank, -1)
    cut_slot = jnp.where((kind == CUT) & (c_rank < P), c_rank, P)
    head = running(jnp.maximum, jnp.where(cont, -1, g))  # the global index of each token's run head
    gov = cut_slot[head]
    feed_tok = jnp.where(kind[head] == CUT, gslot[jnp.maximum(pred[head], 0)], -1)  # what a run receives
    slot_tok = jnp.full((c * P,), -1, jnp.int32).at[jnp.where(gslot >= 0, gslot, c * P)].set(g, mode="drop")
    used = slot_tok >= 0
    key_tok = jnp.maximum(slot_tok, 0)
    _, _, _, order = lax.sort((~used, seg_S[key_tok], pos_S[key_tok], jnp.arange(c * P, dtype=jnp.int32)),
                              num_keys=3)
    feed_of = jnp.where(used, feed_tok[key_tok], -1)[order]
    linked = jnp.concatenate([jnp.zeros((1,), bool), (feed_of[1:] == order[:-1]) & (feed_of[1:] >= 0)])
    mine = lax.dynamic_slice_in_dim(slot_tok, rank * P, P)
    local = lambda a: lax.dynamic_slice_in_dim(a, rank * L, L)  # noqa: E731
    cut_feed = jnp.full((P + 1,), -1, jnp.int32).at[local(cut_slot)].set(local(feed_tok))[:P]  # CUT slot -> feed
    cut_tok = jnp.zeros((P + 1,), jnp.int32).at[local(cut_slot)].set(jnp.arange(L, dtype=jnp.int32))[:P]
    return Topology(kind=local(kind), cut_slot=local(cut_slot), cut_tok=cut_tok, gov=local(gov),
                    tail_tok=jnp.maximum(mine - rank * L, 0), tail_ok=mine >= 0, cut_feed=cut_feed, order=order,
                    linked=linked, final=jnp.where(final >= 0, gslot[jnp.maximum(final, 0)], -1), ok=ok)


def topology(pos_BS, seg_BS, rank, c: int, P: int) -> Topology:
    """The :class:`Topology` of colossal rank ``rank`` (of ``c``) with ``P`` slots per rank.

    Args:
        pos_BS, seg_BS: ``[B, S]`` int32 positions and segment ids of whole rows, in array order.
        rank: this rank's index along ``cp_colossal`` (a traced int inside ``shard_map``).
        c: the number of ranks; ``S`` splits into ``c`` parts of ``L = S/c`` tokens.
        P: slots per rank.

    Returns:
        The rank's ``Topology``.
    """
    return jax.vmap(lambda p, s: _row(p, s, rank, c, P))(pos_BS, seg_BS)
