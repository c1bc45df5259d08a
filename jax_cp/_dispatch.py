"""Dispatch plans for packed rows: which sequence chunks each colossal rank holds.

The dual-chunk order balances one causal document; a packed row (many documents,
segment ids, per-document positions) it leaves up to 2-3x unbalanced. :func:`plan`
(NumPy, on the host, per batch in the data pipeline) cuts each row into ``N = c*k``
chunks of ``S/N`` tokens and gives every colossal rank ``k`` chunks of every row,
chosen so each rank's *visible-pair area* (the (query, key) pairs its queries see:
what the kernels compute once fully masked blocks are skipped), summed over the
rows of its ``dp`` shard, is as equal as it can make it, keeping each document's
chunks on few ranks. Masks are data (positions, segment ids), so any order is
correct; the plan only chooses a fast one. The :class:`Dispatch` it returns puts
arrays into that order and back, on the host or inside ``jit``.

Letters: B batch, S sequence, N chunks per row, C colossal ranks (``c``), R rows of
one dp shard, L chunk length.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp._masks import Window, normalize_window
from jax_cp._mesh import MeshDims, is_explicit, mesh_dims
from jax_cp.exchanges import attended as _attended

__all__ = ["Dispatch", "fixed", "plan"]

CHUNKS_PER_RANK = 8  # chunks of S/(8c) tokens: fine enough to balance, coarse enough to plan in milliseconds
_SWAPS_PER_RANK = 8  # improving swaps tried per colossal rank after the greedy pass
_NEAR_BEST = 0.5  # a swap dropping the heaviest load by half the best swap's drop may win on locality
_GOOD_ENOUGH = 1.02  # slowest/mean at which finer chunks are not tried
_REFINEMENTS = 2  # at most twice: chunks halved, up to 4 * chunks_per_rank per rank


@dataclasses.dataclass(frozen=True, eq=False)
class Dispatch:
    """A per-row order of the sequence and what it costs each CP device.

    A pytree (the arrays are leaves, the mesh sizes static): pass it to a jitted
    step as an argument, and a new plan per batch does not recompile.

    Attributes:
      perm: ``[B, S]`` int32, the natural index of the token at each dispatched slot.
      inverse: ``[B, S]`` int32, the dispatched slot of each natural token.
      positions: ``[B, S]`` int32, the positions of the dispatched tokens (``perm`` when
        :func:`plan` was given no ``positions``): what ``positions=`` of attention must be.
      chunks: ``[B, N]`` int32, the natural chunk (tokens ``[n*S/N, (n+1)*S/N)``) at each chunk
        slot; colossal rank ``i`` holds slots ``[i*N/c, (i+1)*N/c)``, in ascending natural order.
      pairs: ``[B, c]`` float64, visible (query, key) pairs of each colossal rank's queries, per row.
      blocks: ``[B, S/U, 7, 3]`` int32, per key block of ``U`` dispatched tokens (at most
        ``exchanges.attended.KEY_BLOCK``) and each of its three parts
        (``exchanges.attended.block_summary``): any valid token, and the valid tokens' least and
        greatest segment id, position and span id other than 0 (what :attr:`kv_exchange` counts).
      query_blocks: ``[B, S/Uq, 7, 3]`` int32, the same per query block of ``Uq`` tokens (at most
        ``exchanges.attended.BLOCK``).
      dims: the mesh sizes the plan is for.
      is_causal, window: the mask the plan balanced (and :attr:`kv_exchange` serves).
    """

    perm: np.ndarray
    inverse: np.ndarray
    positions: np.ndarray
    chunks: np.ndarray
    pairs: np.ndarray
    blocks: np.ndarray
    query_blocks: np.ndarray
    dims: MeshDims
    is_causal: bool = True
    window: Window = None

    def reorder(self, tree, axis: int = 1):
        """Every array of ``tree`` (batch on axis 0, sequence on ``axis``) in the dispatched order.

        Returns ``(reordered_tree, positions)``, ``positions`` as :attr:`positions` (NumPy when
        every leaf and the plan are NumPy, else a jax Array). A tree that carries its own
        per-document positions gets them reordered with it: pass those to attention (they
        equal ``positions`` when they are what :func:`plan` was given). NumPy leaves are
        gathered on the host (before a batch is placed); jax Arrays, inside ``jit`` too, by
        ``jnp.take_along_axis``, keeping their sharding where one is set.
        """
        positions = self.positions
        if not _all_numpy(tree, self.perm):
            positions = jnp.asarray(positions)
        return _gather_tree(tree, self.perm, axis, "reorder"), positions

    def restore(self, tree, axis: int = 1):
        """Inverse of :meth:`reorder`: every array of ``tree`` back in natural order."""
        return _gather_tree(tree, self.inverse, axis, "restore")

    def work(self) -> np.ndarray:
        """Visible pairs per CP device, ``[dp, cp_colossal * cp_ulysses]`` float64 (host only).

        Row ``s`` sums the rows of dp shard ``s`` (rows ``b`` with ``b // (B/dp) == s``);
        device ``(i, j)`` attends colossal chunk ``i`` for ``1/u`` of the heads and is charged
        ``pairs(chunk i) / u``, as ``load_balance.work`` counts.
        """
        d = self.dims
        per_shard = np.asarray(self.pairs, np.float64).reshape(d.dp, -1, d.c).sum(axis=1)
        return np.repeat(per_shard / d.u, d.u, axis=1)

    def imbalance(self) -> float:
        """Slowest CP device over the mean of its dp shard, the worst shard (1.0 is perfect)."""
        w = self.work()
        mean = w.mean(axis=1)
        ratio = np.where(mean > 0, w.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)
        return float(ratio.max())

    @property
    def kv_exchange(self) -> _attended.Attended:
        """The K/V exchange for this batch (``kv_exchange=`` of attention on the dispatched order, with the
        mask the plan was given): each rank receives only the key blocks its queries may see
        (``jax_cp.exchanges.Attended``, one ragged all-to-all), its buffers bucketed so a run compiles
        a handful of values."""
        return self.kv_exchange_for(is_causal=self.is_causal, local_window_size=self.window)

    def kv_exchange_for(self, *, is_causal: bool = True, local_window_size=None,
                        transport: str = "ragged") -> _attended.Attended:
        """As :attr:`kv_exchange`, for a layer with another mask on the same batch (e.g. a model mixing
        sliding-window and global layers: a window's layers move about a window of keys).

        Args:
            is_causal, local_window_size: the layer's mask.
            transport: ``"ragged"`` (one ragged all-to-all; only the needed blocks travel) or
                ``"ppermute"`` (a buffer per ring distance, each the size of the largest need at any
                distance).

        Returns:
            The :class:`~jax_cp.exchanges.Attended` value.

        Raises:
            ValueError: read inside ``jit``, or a bad argument.
        """
        if isinstance(self.blocks, jax.core.Tracer):
            raise ValueError("Dispatch.kv_exchange is read on the host (its sizes set the compiled program): take "
                             "it before jit and pass it as a static argument, or close over it.")
        if not isinstance(is_causal, bool):
            raise ValueError(f"is_causal={is_causal!r} must be True or False.")
        if transport not in ("ragged", "ppermute"):
            raise ValueError(f"transport={transport!r} must be 'ragged' or 'ppermute'.")
        blocks, query_blocks = np.asarray(self.blocks), np.asarray(self.query_blocks)
        counts = _attended.needed_from_summary(_attended.block_summary_of(blocks), self.dims.c, is_causal=is_causal,
                                               local_window_size=local_window_size,
                                               query_summary=_attended.block_summary_of(query_blocks))
        S = self.perm.shape[1]
        block, per_rank, query_block = S // blocks.shape[1], blocks.shape[1] // self.dims.c, S // query_blocks.shape[1]
        if transport == "ragged":
            return _attended.ragged_exchange_for(counts, block, per_rank, self.dims.dp, query_block)
        return _attended.exchange_for(counts, block, per_rank, query_block)


jax.tree_util.register_dataclass(Dispatch, data_fields=["perm", "inverse", "positions", "chunks", "pairs", "blocks",
                                                      "query_blocks"],
                                 meta_fields=["dims", "is_causal", "window"])


def plan(segment_ids, mesh, *, positions=None, is_causal: bool = True, local_window_size=None,
         chunks_per_rank: int = CHUNKS_PER_RANK, span_ids=None) -> Dispatch:
    """Plans the order of a batch so each CP device sees the same visible-pair area.

    Each row is cut into ``N = c*k`` chunks of ``S/N`` tokens (``c = |cp_colossal|``; ``k`` the
    largest even number <= ``chunks_per_rank`` dividing ``S/c``, so any ``S`` divisible by ``2c``
    and ``c*u`` works), and colossal rank ``i`` holds ``k`` of them per row: equal tokens per rank,
    each row in its own order. Chunks go to ranks by area, largest first, each to a rank already
    holding its document while that stays within the shard's mean, else to the least-loaded rank
    with room; then swaps between the heaviest rank and another lower the maximum while one can
    (of the good swaps, the one keeping most documents together). Where the slowest rank stays
    over 1.02x the mean, chunks are halved and the row planned again (at most twice: down to
    ``S/(4c*k)`` tokens), keeping the better plan. Rows of one causal document at consecutive
    positions keep the dual-chunk order (exact without a window), as does a whole dp shard where
    it would be better. Deterministic: stable sorts, no randomness. About 5-10 ms for a 128K-token
    row on one core (``benchmarks/packed_balance.py``).

    Args:
      segment_ids: ``[B, S]`` ints in natural order; a negative id pads a token (it sees nothing
        and nothing sees it). ``None``: one document per row (then ``positions`` gives the shape).
      mesh: a jax_cp mesh (``Mesh`` or ``AbstractMesh`` with the four axes) or a ``MeshDims``.
      positions: ``[B, S]`` ints, each token's position (per-document positions of packed rows);
        ``None``: ``arange(S)`` in every row.
      is_causal, local_window_size: the mask, as attention takes it: query ``q`` sees key ``k`` iff
        they share a segment id ``>= 0``, ``pos_k <= pos_q`` when causal, and
        ``pos_q - left <= pos_k <= pos_q + right`` for a window ``(left, right)`` (``w``: ``(w, w)``).
      chunks_per_rank: chunks per colossal rank and row (an even number; default 8).
      span_ids: ``[B, S]`` bidirectional span ids (0: none), as attention takes them: a causal
        query also sees the later keys of its own span, and the plan balances those pairs too.

    Returns:
      The :class:`Dispatch`.

    Raises:
      ValueError: a shape, dtype or size the mesh cannot take, naming it and the fix.
    """
    dims = mesh if isinstance(mesh, MeshDims) else mesh_dims(mesh)
    seg_BS, pos_BS = _check_inputs(segment_ids, positions, dims)
    window = normalize_window(local_window_size)
    S = seg_BS.shape[1]
    k = _chunks_per_rank(S, dims.c, chunks_per_rank)
    counts_BS, doc_BS, dual_B = _rows(seg_BS, pos_BS, is_causal, window)
    if span_ids is not None and is_causal:
        counts_BS, dual_B = counts_BS + _span_counts(span_ids, doc_BS, pos_BS, window), np.zeros_like(dual_B)
    elif span_ids is not None:
        _check_spans(span_ids, seg_BS.shape)
    best = None
    for _ in range(_REFINEMENTS + 1):  # finer chunks only where the coarse ones leave a rank > 2% over the mean
        d = _dispatch(_chunk_order(counts_BS, doc_BS, dual_B, dims, k), counts_BS, pos_BS, dims, seg_BS,
                      is_causal, window, summaries=False)
        best = d if best is None or d.imbalance() < best.imbalance() else best
        k *= 2
        if best.imbalance() <= _GOOD_ENOUGH or (S // dims.c) % k:
            break
    return _dispatch(np.asarray(best.chunks), counts_BS, pos_BS, dims, seg_BS, is_causal, window, span_BS=span_ids)


def fixed(segment_ids, mesh, *, balanced: bool = True, positions=None, is_causal: bool = True,
          local_window_size=None, span_ids=None) -> Dispatch:
    """A fixed order as a :class:`Dispatch`, its work counted as :func:`plan` counts it: the dual-chunk
    order of ``load_balance.reorder`` (``balanced=True``; rank ``i`` holds chunks ``i`` and ``2c-1-i``
    of every row) or the natural order (``balanced=False``). What a plan is measured against.

    Args:
      segment_ids, mesh, positions, is_causal, local_window_size, span_ids: as :func:`plan`.
      balanced: the dual-chunk order, or the natural one.

    Returns:
      The :class:`Dispatch` (every row in the same order).

    Raises:
      ValueError: as :func:`plan`.
    """
    dims = mesh if isinstance(mesh, MeshDims) else mesh_dims(mesh)
    seg_BS, pos_BS = _check_inputs(segment_ids, positions, dims)
    window = normalize_window(local_window_size)
    counts_BS, doc_BS, _ = _rows(seg_BS, pos_BS, is_causal, window)
    if span_ids is not None and is_causal:
        counts_BS = counts_BS + _span_counts(span_ids, doc_BS, pos_BS, window)
    elif span_ids is not None:
        _check_spans(span_ids, seg_BS.shape)
    N = 2 * dims.c
    owner = _dual_owner(N, dims.c) if balanced else np.arange(N) // 2
    chunks_BN = np.broadcast_to(np.argsort(owner, kind="stable"), (seg_BS.shape[0], N))
    return _dispatch(chunks_BN, counts_BS, pos_BS, dims, seg_BS, is_causal, window, span_BS=span_ids)


# ---- inputs ---------------------------------------------------------------------------------------


def _int_matrix(name: str, x) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"{name} is a traced value: plan runs on the host, per batch, before the step; call it "
                         "outside jit with the batch's NumPy arrays.")
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{name}.shape={a.shape} must be [batch, seq_len]; for one row pass {name}[None].")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}.dtype={a.dtype} must be an integer dtype; cast it, e.g. {name}.astype(np.int32).")
    return a.astype(np.int64)


def _check_inputs(segment_ids, positions, dims: MeshDims):
    """``(segment_ids, positions or None)`` as int64 ``[B, S]``, checked against the mesh."""
    if segment_ids is None and positions is None:
        raise ValueError("segment_ids=None and positions=None give no shape: pass segment_ids [batch, seq_len] "
                         "(np.zeros((B, S), np.int32) for one document per row).")
    pos_BS = None if positions is None else _int_matrix("positions", positions)
    seg_BS = np.zeros(pos_BS.shape, np.int64) if segment_ids is None else _int_matrix("segment_ids", segment_ids)
    if pos_BS is not None and pos_BS.shape != seg_BS.shape:
        raise ValueError(f"positions.shape={pos_BS.shape} differs from segment_ids.shape={seg_BS.shape}; "
                         "give one position per token.")
    B, S = seg_BS.shape
    if B == 0 or S == 0:
        raise ValueError(f"segment_ids.shape={seg_BS.shape} is empty; plan a batch of at least one token per row.")
    if B % dims.dp:
        raise ValueError(f"batch={B} is not divisible by dp={dims.dp}; each dp shard needs the same number of rows.")
    if dims.c > 1 and S % (2 * dims.c):
        raise ValueError(f"seq_len={S} is not divisible by 2*cp_colossal={2 * dims.c}, as load balancing needs; "
                         f"pad the sequence to a multiple of {2 * dims.c * dims.u}.")
    if S % dims.cp:
        raise ValueError(f"seq_len={S} is not divisible by cp_colossal*cp_ulysses={dims.cp}; pad the sequence.")
    if pos_BS is not None and (pos_BS.min() < np.iinfo(np.int32).min or pos_BS.max() > np.iinfo(np.int32).max):
        raise ValueError(f"positions range over [{pos_BS.min()}, {pos_BS.max()}], beyond int32, as attention takes "
                         "them; give per-document or row positions.")
    return seg_BS, pos_BS


def _chunks_per_rank(S: int, c: int, wanted) -> int:
    """The largest ``k <= wanted`` dividing ``S/c``, even where ``c > 1`` (so the dual-chunk order fits)."""
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 2 or wanted % 2:
        raise ValueError(f"chunks_per_rank={wanted!r} must be an even integer >= 2 (a rank's chunks include the "
                         "two halves of the dual-chunk order).")
    return next(k for k in range(wanted, 0, -1) if (S // c) % k == 0 and (k % 2 == 0 or c == 1))


# ---- the area of each chunk -----------------------------------------------------------------------


def _rows(seg_BS, pos_BS, is_causal: bool, window: Window):
    """``(visible keys per token [B, S], document per token [B, S], dual [B])``; ``dual``: the row is one
    causal document at consecutive positions, which the dual-chunk order balances."""
    B = seg_BS.shape[0]
    rows = [_visible_counts(seg_BS[b], None if pos_BS is None else pos_BS[b], is_causal, window) for b in range(B)]
    counts_BS, doc_BS = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    consecutive_B = np.ones(B, bool) if pos_BS is None else np.all(np.diff(pos_BS, axis=1) == 1, axis=1)
    return counts_BS, doc_BS, is_causal & np.all(doc_BS == 0, axis=1) & consecutive_B


def _check_spans(span_ids, shape) -> np.ndarray:
    """``span_ids`` as an integer array of ``shape``, else a ValueError (checked for every mask: a
    non-causal one only has no pairs to add)."""
    span = np.asarray(span_ids)
    if span.shape != shape or not np.issubdtype(span.dtype, np.integer):
        raise ValueError(f"span_ids (shape={span.shape}, dtype={span.dtype}) must be integers of shape "
                         f"(batch, seq_len)={shape}, like segment_ids.")
    return span


def _span_counts(span_ids, doc_BS, pos_BS, window: Window) -> np.ndarray:
    """``[B, S]``: the keys each causal query sees beyond the causal ones: those of its document and
    span (id != 0) at later positions (within the window's right side)."""
    span = _check_spans(span_ids, doc_BS.shape)
    pos = np.broadcast_to(np.arange(doc_BS.shape[1]), doc_BS.shape) if pos_BS is None else pos_BS
    extra = np.zeros(doc_BS.shape, np.int64)
    right = None if window is None else window[1]
    for b in range(doc_BS.shape[0]):
        idx = np.flatnonzero((span[b] != 0) & (doc_BS[b] >= 0))
        if not idx.size:
            continue
        order = np.lexsort((pos[b, idx], span[b, idx], doc_BS[b, idx]))  # by document, span, position
        group = np.stack([doc_BS[b, idx], span[b, idx]], axis=1)[order]
        p = pos[b, idx][order].astype(np.int64)
        new = np.concatenate([[True], np.any(group[1:] != group[:-1], axis=1)])
        gid = np.cumsum(new) - 1
        span_len = int(p.max() - p.min()) + 2 + (right or 0)  # groups' keys never overlap, window included
        key = gid * span_len + (p - p.min())  # ascending: one run per (document, span)
        after = np.searchsorted(key, key, "right")  # the first key past the query's own position
        end = np.searchsorted(gid, gid, "right") if right is None else np.searchsorted(key, key + right, "right")
        extra[b, idx[order]] = end - after
    return extra


def _documents(seg_S: np.ndarray) -> np.ndarray:
    """Each token's document index (its segment id's rank among the row's ids), -1 for padding."""
    S = seg_S.shape[0]
    starts = np.concatenate([[0], np.flatnonzero(seg_S[1:] != seg_S[:-1]) + 1])
    _, run_doc = np.unique(seg_S[starts], return_inverse=True)
    doc_S = np.repeat(run_doc.reshape(-1), np.diff(np.append(starts, S)))
    return np.where(seg_S >= 0, doc_S, -1)


def _visible_counts(seg_S, pos_S, is_causal: bool, window: Window):
    """``(keys each token sees as a query, document of each token)``, in O(S log S).

    With the keys sorted by (document, position), a query's visible keys are one run: from
    its document's first key, or the first at ``pos - left``, to its own key (causal), the
    last at ``pos + right`` or its document's last; binary searches find the ends, and rows
    packed in order (documents by id, positions rising) need neither a sort nor, causal
    without a window, any search per token.
    """
    doc_S = _documents(seg_S)
    valid = doc_S >= 0
    counts = np.zeros(seg_S.shape, np.int64)
    if not valid.any():
        return counts, doc_S
    pos = np.arange(seg_S.shape[0], dtype=np.int64) if pos_S is None else pos_S
    pmin = pos[valid].min()
    span = pos[valid].max() - pmin + 1
    key = doc_S * span + (pos - pmin)
    keys = key[valid]
    step = keys[1:] - keys[:-1]
    if np.any(step < 0):
        keys = np.sort(keys)
    starts = np.searchsorted(keys, np.arange(doc_S.max() + 2) * span)  # each document's first key
    if window is None:
        first = starts[doc_S]
    else:
        first = np.searchsorted(keys, key - np.minimum(window[0], pos - pmin), "left")
    if is_causal and np.all(step > 0):  # sorted, distinct: a query's own key is its rank
        last = np.cumsum(valid)
    elif is_causal:
        last = np.searchsorted(keys, key, "right")
    elif window is None:
        last = starts[doc_S + 1]
    else:
        last = np.searchsorted(keys, key + np.minimum(window[1], span - 1 - (pos - pmin)), "right")
    counts[valid] = (last - first)[valid]
    return counts, doc_S


# ---- assigning chunks to ranks ----------------------------------------------------------------------


def _dual_owner(N: int, c: int) -> np.ndarray:
    """Rank of each of ``N`` chunks in the dual-chunk order: rank ``i`` holds halves ``i`` and ``2c-1-i``."""
    half = np.arange(N) // (N // (2 * c))
    return np.where(half < c, half, 2 * c - 1 - half)


def _loads(owner_RN: np.ndarray, areas_RN: np.ndarray, c: int) -> np.ndarray:
    return np.bincount(owner_RN.reshape(-1), weights=areas_RN.reshape(-1).astype(np.float64), minlength=c)


def _chunk_order(counts_BS, doc_BS, dual_B, dims: MeshDims, k: int) -> np.ndarray:
    """``chunks [B, N]``: the natural chunk at each chunk slot, ``k`` slots per rank, shard by shard."""
    B, S = counts_BS.shape
    N = dims.c * k
    L = S // N
    areas, first, last = counts_BS.reshape(B, N, L).sum(axis=2), doc_BS[:, ::L], doc_BS[:, L - 1 :: L]
    shards = [slice(s * (B // dims.dp), (s + 1) * (B // dims.dp)) for s in range(dims.dp)]
    return np.concatenate([_plan_shard(areas[s], first[s], last[s], dual_B[s], dims.c, k) for s in shards])


def _plan_shard(areas_RN, first_RN, last_RN, dual_R, c: int, k: int) -> np.ndarray:
    """``chunks [R, N]`` of one dp shard's rows: rank 0's chunks in natural order, then rank 1's, ..."""
    R, N = areas_RN.shape
    dual = np.broadcast_to(_dual_owner(N, c), (R, N))
    owner = dual.copy()
    if c > 1 and not dual_R.all():
        free = np.flatnonzero(~dual_R)
        areas, first, last = areas_RN[free], first_RN[free], last_RN[free]
        load = _loads(dual[dual_R], areas_RN[dual_R], c)
        greedy = _greedy(areas, first, last, load, c, k)
        owner[free] = _improve(greedy, areas, load + _loads(greedy, areas, c), first, last, c, k)
        if _loads(dual, areas_RN, c).max() < _loads(owner, areas_RN, c).max():
            owner = dual
    return np.argsort(owner, axis=1, kind="stable")


def _greedy(areas_RN, first_RN, last_RN, load_C, c: int, k: int) -> np.ndarray:
    """Largest chunk first; to a rank holding its document while that stays within the mean, else
    to the least-loaded rank with room (longest-processing-time with ``k`` chunks per rank and row)."""
    R, N = areas_RN.shape
    load = [float(x) for x in load_C]
    target = (sum(load) + float(areas_RN.sum())) / c
    room = [[k] * c for _ in range(R)]
    holds = [{} for _ in range(R)]  # per row: document -> ranks holding one of its chunks
    owner = np.empty((R, N), np.int64)
    areas, first, last = areas_RN.tolist(), first_RN.tolist(), last_RN.tolist()
    for flat in np.argsort(-areas_RN.reshape(-1), kind="stable").tolist():
        b, x = divmod(flat, N)
        a, docs = areas[b][x], {first[b][x], last[b][x]} - {-1}
        near = [r for d in sorted(docs) for r in holds[b].get(d, ()) if room[b][r] and load[r] + a <= target]
        if near:
            r = min(near, key=lambda r: (-near.count(r), load[r], r))
        else:
            r = min((r for r in range(c) if room[b][r]), key=lambda r: (load[r], r))
        owner[b, x], load[r] = r, load[r] + a
        room[b][r] -= 1
        for d in docs:
            ranks = holds[b].setdefault(d, [])
            if r not in ranks:
                ranks.append(r)
    return owner


class _Neighbours:
    """How many chunks of each chunk's documents each rank holds (a chunk counts for its first and
    its last document): what a swap gains or loses in locality, kept up to date in O(1) per move."""

    def __init__(self, first_RN, last_RN, owner_RN, c: int):
        R = owner_RN.shape[0]
        self.rows = np.arange(R)[:, None]
        self.f, self.l = np.maximum(first_RN, 0), np.maximum(last_RN, 0)
        self.wf = (first_RN >= 0).astype(np.float64)
        self.wl = ((last_RN >= 0) & (last_RN != first_RN)).astype(np.float64)
        self.held = np.zeros((R, int(max(self.f.max(), self.l.max())) + 1, c))
        for b in range(R):
            np.add.at(self.held[b], (self.f[b], owner_RN[b]), self.wf[b])
            np.add.at(self.held[b], (self.l[b], owner_RN[b]), self.wl[b])
        self.eye = np.eye(c)

    def near(self, owner_RN) -> np.ndarray:
        """``[R, N, c]``: chunks sharing a document with chunk ``x`` on each rank, ``x`` itself left out."""
        rows, wf, wl = self.rows, self.wf[..., None], self.wl[..., None]
        return wf * self.held[rows, self.f] + wl * self.held[rows, self.l] - (wf + wl) * self.eye[owner_RN]

    def move(self, b: int, x: int, src: int, dst: int) -> None:
        for doc, w in ((self.f[b, x], self.wf[b, x]), (self.l[b, x], self.wl[b, x])):
            self.held[b, doc, src] -= w
            self.held[b, doc, dst] += w


def _improve(owner_RN, areas_RN, load_C, first_RN, last_RN, c: int, k: int) -> np.ndarray:
    """Swaps of two chunks of one row between the heaviest rank and another, each lowering the
    pair's larger load below the heaviest's, until none does (or ``_SWAPS_PER_RANK * c`` swaps).
    Of the swaps that gain at least half the best one's drop, the one keeping most document
    neighbours together."""
    owner, load = owner_RN.copy(), load_C.astype(np.float64).copy()
    areas, rows = areas_RN.astype(np.float64), np.arange(owner.shape[0])[:, None]
    neighbours = _Neighbours(first_RN, last_RN, owner, c)
    for _ in range(_SWAPS_PER_RANK * c):
        h = int(np.argmax(load))
        order = np.argsort(owner != h, axis=1, kind="stable")  # per row: h's k chunks, then the others
        mine, other = order[:, :k], order[:, k:]
        peer = owner[rows, other]  # [R, N-k]
        delta = areas[rows, mine][:, :, None] - areas[rows, other][:, None, :]  # [R, k, N-k]
        worse = np.where(delta > 0, np.maximum(load[h] - delta, load[peer][:, None, :] + delta), np.inf)
        best = worse.min()
        if not best < load[h]:
            break
        b, i, j = np.nonzero(worse <= best + _NEAR_BEST * (load[h] - best))  # good enough to weigh locality
        x, y = mine[b, i], other[b, j]
        r = owner[b, y]
        near = neighbours.near(owner)
        gain = near[b, x, r] - near[b, x, h] + near[b, y, h] - near[b, y, r]
        pick = np.lexsort((worse[b, i, j], -gain))[0]  # most neighbours kept, then the lowest maximum
        b, i, j = b[pick], i[pick], j[pick]
        x, y = mine[b, i], other[b, j]
        r = owner[b, y]
        load[h], load[r] = load[h] - delta[b, i, j], load[r] + delta[b, i, j]
        owner[b, x], owner[b, y] = r, h
        neighbours.move(b, x, h, r)
        neighbours.move(b, y, r, h)
    return owner


# ---- applying the order -----------------------------------------------------------------------------


def _dispatch(chunks_BN: np.ndarray, counts_BS: np.ndarray, pos_BS, dims: MeshDims, seg_BS, is_causal: bool,
              window: Window, summaries: bool = True, span_BS=None) -> Dispatch:
    """The Dispatch of a chunk order: token permutation, its inverse, positions, pairs per rank and the
    dispatched blocks' summaries (``summaries=False``: an empty placeholder, for a candidate order
    that is only compared)."""
    (B, N), S = chunks_BN.shape, counts_BS.shape[1]
    L = S // N
    perm = (chunks_BN[:, :, None] * L + np.arange(L)).reshape(B, S).astype(np.int32)
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)), axis=1)
    positions = perm if pos_BS is None else np.take_along_axis(pos_BS, perm, axis=1).astype(np.int32)
    pairs = np.take_along_axis(counts_BS, perm, axis=1).reshape(B, dims.c, -1).sum(axis=2)
    # One block length per batch shape (the finest chunks a plan may cut), so it never splits the
    # exchange values of one run: a block never straddles two chunks of any plan of this shape.
    T, chunk = S // dims.c, S // (dims.c * CHUNKS_PER_RANK * 2 ** _REFINEMENTS)
    sizes = (_attended.block_length(T, chunk, _attended.KEY_BLOCK), _attended.block_length(T, chunk))
    blocks = [np.zeros((B, 0, 7, 3), np.int32)] * 2
    if summaries:
        span = None if span_BS is None else np.take_along_axis(np.asarray(span_BS), perm, axis=1)
        seg = np.take_along_axis(seg_BS, perm, axis=1)
        blocks = [np.stack([np.asarray(a, np.int32) for a in _attended.block_summary(np, positions, seg, U, span)],
                           axis=-2) for U in sizes]
    arrays = [perm, inverse, positions, chunks_BN.astype(np.int32), pairs.astype(np.float64), *blocks]
    for a in arrays:
        a.setflags(write=False)
    return Dispatch(*arrays, dims=dims, is_causal=is_causal, window=window)


def _all_numpy(tree, perm) -> bool:
    return isinstance(perm, np.ndarray) and all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree))


def _gather_tree(tree, idx_BS, axis: int, what: str):
    """Every leaf gathered along ``axis`` by the per-row index ``idx_BS``."""
    B, S = idx_BS.shape

    def take(x):
        shape = np.shape(x)
        if not -len(shape) <= axis < len(shape) or axis % len(shape) == 0:
            raise ValueError(f"{what}: an array of shape {shape} has no sequence axis={axis} besides its batch axis "
                             "0; give arrays [batch, ..., seq_len, ...] (1-D arrays have no row to follow).")
        ax = axis % len(shape)
        if (shape[0], shape[ax]) != (B, S):
            raise ValueError(f"{what}: an array of shape {shape} has (batch, seq_len)=({shape[0]}, {shape[ax]}) on "
                             f"axes (0, {axis}), the plan ({B}, {S}); plan the batch these arrays belong to.")
        index = [1] * len(shape)
        index[0], index[ax] = B, S
        if isinstance(x, np.ndarray) and isinstance(idx_BS, np.ndarray):
            return np.take_along_axis(x, idx_BS.reshape(index), axis=ax)
        return _take(x, jnp.asarray(idx_BS).reshape(index), ax)

    return jax.tree.map(take, tree)


def _take(x, index, ax: int):
    """``jnp.take_along_axis``, keeping an explicitly sharded (or eager, placed) array's sharding."""
    f = lambda a, i: jnp.take_along_axis(a, i, axis=ax)
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and is_explicit(mesh) and any(p is not None for p in sharding.spec):
        return jax.sharding.auto_axes(f, out_sharding=sharding)(x, index)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_replicated:
        return jax.device_put(f(x, index), x.sharding)  # Auto mesh, eager: keep it too
    return f(x, index)
