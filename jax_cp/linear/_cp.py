"""The mesh plumbing the linear layers share: checks, placement, the Ulysses exchange, chunking and
the state passing of one rank, and the single place that enters ``jax.shard_map``.

Per device: inputs ``[B, S/(c*u), H/t, *]`` cross ``cp_ulysses`` to ``[B, S/c, H/(t*u), *]`` (one
all-to-all), are cut into chunks, run through the chunk kernel and the state passing over
``cp_colossal`` (:func:`jax_cp.linear._chains.pass_states`), and go back. Positions and segment ids
are replicated ``[B, S]`` ints (as attention's metadata) so every rank knows the row's document order.
Letters: B batch, S sequence, L tokens per colossal rank, H heads, N chunks, C chunk length, P slots.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cp._mesh import COLOSSAL, CP, DP, METADATA, TP, ULYSSES, mesh_dims, place
from jax_cp._ulysses import heads_to_seq, seq_to_heads
from jax_cp._vma import vary_as
from jax_cp.linear._args import check_metadata
from jax_cp.linear._chains import pass_states
from jax_cp.linear._chunk import runs
from jax_cp.linear._topology import CONT, topology

__all__ = ["DEFAULT_PIECES", "HEADS", "META", "STATE", "Layout", "layout", "needed_pieces", "pieces_for", "placed_meta",
           "sized_pieces", "run",
           "shard_state"]

DEFAULT_PIECES = 16
META = METADATA  # [B, S] positions / segment ids, whole rows on every device
HEADS = P(DP, CP, TP, None)  # [B, S, H, d]
STATE = P(DP, (TP, ULYSSES), None, None)  # [B, H, v, k] after the Ulysses exchange


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static sizes of one call: the mesh (or ``None``), ``c``, ``u``, ``t``, tokens per colossal rank
    ``L``, the chunk length and the slots per rank."""

    mesh: object
    c: int
    u: int
    t: int
    L: int
    chunk: int
    pieces: int
    cuts: bool = True  # some token's predecessor is not the token before it on its rank (False: known on the host)

    @property
    def axis(self):
        return COLOSSAL if self.mesh is not None and self.c > 1 else None


def layout(mesh, batch: int, seq_len: int, heads: int, chunk_size: int, max_pieces, head_what="heads",
           heads_over_ulysses: bool = True) -> Layout:
    """The call's :class:`Layout`, checking that the mesh divides batch, sequence and heads (or channels:
    ``head_what``, split over ``tp`` and, with ``heads_over_ulysses``, ``cp_ulysses``)."""
    c = u = t = dp = 1
    if mesh is not None:
        dims = mesh_dims(mesh)
        c, u, t, dp = dims.c, dims.u, dims.t, dims.dp
    if batch % dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dp}; use a batch that is a multiple of dp.")
    if seq_len % (c * u):
        raise ValueError(f"seq_len={seq_len} is not divisible by cp_colossal*cp_ulysses={c * u}; pad the sequence.")
    split, name = (t * u, f"tp*cp_ulysses={t}*{u}") if heads_over_ulysses else (t, "tp")
    if heads % split:
        raise ValueError(f"{head_what}={heads} is not divisible by {name}={split}: each device holds whole "
                         f"{head_what}; choose a mesh whose {name.split('=')[0]} divides {heads}.")
    L = seq_len // c
    if max_pieces is not None and (not isinstance(max_pieces, int) or isinstance(max_pieces, bool) or max_pieces < 1):
        raise ValueError(f"max_pieces={max_pieces!r} must be a positive integer (or None: min(S/c, "
                         f"{DEFAULT_PIECES})).")
    pieces = pieces_for(max_pieces, L)
    return Layout(mesh, c, u, t, L, min(chunk_size, L), pieces)


def pieces_for(max_pieces, tokens_per_rank: int) -> int:
    """The slots a layer holds per rank where its metadata are traced: ``max_pieces``, or
    ``min(tokens per rank, DEFAULT_PIECES)`` for ``None``."""
    return min(tokens_per_rank, DEFAULT_PIECES) if max_pieces is None else max_pieces


def placed_meta(positions, segment_ids, batch: int, seq_len: int, mesh, lay: Layout, *, sized: bool = False):
    """``(pos, seg, lay)``: ``[B, S]`` int32 positions (``arange``) and segment ids (zeros), replicated
    along the sequence, and the layout. With concrete metadata (the defaults are), the slots a rank
    needs are counted on the host: ``sized`` (``max_pieces=None``) sets ``lay.pieces`` to the next power
    of two at or above that count (few distinct programs, no slot that never carries a state); a given
    ``max_pieces`` below it is a ValueError. Traced metadata keep ``lay.pieces`` (too few: NaN rows)."""
    pos = _on_host(positions, check_metadata("positions", positions, batch, seq_len), batch, seq_len)
    seg = _on_host(segment_ids, check_metadata("segment_ids", segment_ids, batch, seq_len), batch, seq_len)
    # the defaults as NumPy arrays: known on the host even while a caller's jit traces this
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)) if pos is None else pos
    seg = np.zeros((batch, seq_len), np.int32) if seg is None else seg
    if not any(isinstance(a, jax.core.Tracer) for a in (pos, seg)):
        need, cuts = _host_count(np.asarray(pos), np.asarray(seg), lay.c)
        lay = dataclasses.replace(lay, cuts=cuts)
        if sized:
            lay = dataclasses.replace(lay, pieces=sized_pieces(need, lay.L))
        elif need > lay.pieces:
            raise ValueError(f"max_pieces={lay.pieces} is too few for this row's order: a rank holds {need} runs "
                             f"that continue a document across ranks (each needs a state slot); pass "
                             f"max_pieces={need} or more.")
    meta = tuple(jnp.asarray(a) for a in (pos, seg))
    meta = meta if mesh is None else tuple(place(a, mesh, META) for a in meta)
    return (*meta, lay)


def _on_host(given, checked, batch: int, seq_len: int):
    """``checked`` as ``[B, S]`` int32 NumPy where the caller's value is concrete (NumPy, or a jax Array
    that is not traced): ``check_metadata``'s jnp ops would turn even a closed-over NumPy array into a
    tracer under a caller's jit, and the slots could no longer be counted on the host."""
    if given is None or isinstance(given, jax.core.Tracer) or (
            isinstance(given, jax.Array) and not given.is_fully_addressable):
        return checked
    return np.broadcast_to(np.asarray(given).astype(np.int32), (batch, seq_len))


def sized_pieces(need: int, tokens_per_rank: int | None = None) -> int:
    """The state slots a layer holds for an order needing ``need`` (:func:`needed_pieces`): the power of two
    at or above it (at least 1: few distinct programs), at most ``tokens_per_rank`` where given.

    Args:
        need: the slots the busiest rank needs.
        tokens_per_rank: ``S / cp_colossal``, the most slots a rank can use; ``None``: no bound.

    Returns:
        The slots, a positive int.
    """
    pieces = 1 << max(need - 1, 0).bit_length()
    return pieces if tokens_per_rank is None else min(pieces, tokens_per_rank)


def needed_pieces(pos_BS: np.ndarray, seg_BS: np.ndarray, c: int) -> int:
    """The state slots (``max_pieces``) the busiest of ``c`` ranks needs for rows in this order.

    Counted on the host as the layers count them: per rank, the runs it exports (their successor
    lives elsewhere, or the row's final token) and the runs it receives (their predecessor lives
    elsewhere), whichever is more. A trainer that builds its batches' order on the host can check
    them against a layer's ``max_pieces`` before a traced step would return NaN.

    Args:
        pos_BS, seg_BS: ``[B, S]`` NumPy ints, each token's position and document id, in the order the
            layer receives them (natural, dual-chunk, a dispatch plan's).
        c: the ranks the sequence is split over: ``cp_colossal`` for the state passing of
            :func:`jax_cp.linear.gated_delta_rule` and :func:`jax_cp.linear.mamba2_ssd`,
            ``cp_colossal * cp_ulysses`` for the halo of :func:`jax_cp.linear.causal_conv1d`.

    Returns:
        The largest count over the rows and ranks, an ``int``.
    """
    return _host_count(np.asarray(pos_BS), np.asarray(seg_BS), c)[0]


def _host_count(pos_BS: np.ndarray, seg_BS: np.ndarray, c: int) -> tuple[int, bool]:
    """``(needed_pieces, cuts)``: ``cuts`` whether any token is a ``CUT`` (its predecessor is not the
    token before it on its rank)."""
    B, S = pos_BS.shape
    L, g = S // c, np.arange(S)
    worst, cuts = 0, False
    for pos, seg in zip(pos_BS.astype(np.int64), seg_BS.astype(np.int64)):
        order = np.lexsort((g, pos, seg))
        link = (seg[order][1:] == seg[order][:-1]) & (pos[order][1:] == pos[order][:-1] + 1)
        pred, succ = np.full(S, -1), np.full(S, -1)
        pred[order[1:][link]], succ[order[:-1][link]] = order[:-1][link], order[1:][link]
        cont = (pred == g - 1) & (g % L != 0)
        last = seg[seg >= 0].max() if (seg >= 0).any() else -1
        final = np.argmax(np.where(seg == last, pos, np.iinfo(np.int64).min)) if last >= 0 else -1
        exported = ((succ >= 0) & ~((succ == g + 1) & (g % L != L - 1))) | (g == final)
        cut = ~cont & (pred >= 0)
        worst = max(worst, int(exported.reshape(c, L).sum(1).max()), int(cut.reshape(c, L).sum(1).max()))
        cuts = cuts or bool(cut.any())
    return worst, cuts


def run(body, lay: Layout, args: tuple, in_specs: tuple, out_specs):
    """``body(*args)`` on one device, or inside ``jax.shard_map`` over ``lay.mesh``."""
    if lay.mesh is None:
        return body(*args)
    args = tuple(a if s is None else place(a, lay.mesh, s) for a, s in zip(args, in_specs))
    return jax.shard_map(body, mesh=lay.mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def to_heads(lay: Layout, parts):
    """``[B, S/(c*u), H, *]`` parts -> ``[B, S/c, H/u, *]`` (one all-to-all over ``cp_ulysses``)."""
    return tuple(parts) if lay.mesh is None or lay.u == 1 else seq_to_heads(tuple(parts), ULYSSES)


def to_seq(lay: Layout, o):
    """The inverse: ``[B, S/c, H/u, d] -> [B, S/(c*u), H, d]``."""
    return o if lay.mesh is None or lay.u == 1 else heads_to_seq(o, ULYSSES)


def chunked(a_BLHd, C: int):
    """``[B, L, H, d]`` -> ``[B, H, N, C, d]``, zero-padded to whole chunks (zero gates and writes:
    padding leaves the state as it is)."""
    B, L, H, d = a_BLHd.shape
    N = -(-L // C)
    a = jnp.pad(a_BLHd.astype(jnp.float32), ((0, 0), (0, N * C - L), (0, 0), (0, 0)))
    return jnp.moveaxis(a.reshape(B, N, C, H, d), 3, 1)


def unchunked(o_BHNCv, L: int):
    """``[B, H, N, C, v]`` -> ``[B, L, H, v]``."""
    B, H, N, C, v = o_BHNCv.shape
    return jnp.moveaxis(o_BHNCv, 1, 3).reshape(B, N * C, H, v)[:, :L]


def _rank(lay: Layout):
    return lax.axis_index(COLOSSAL) if lay.mesh is not None else 0


def shard_state(lay: Layout, intra_fn, pos_BS, seg_BS, x0, ref, *, initial: bool = True):
    """One rank's outputs ``[B, H, N, C, v]`` and final state: the topology of the whole row, the
    chunk parts ``intra_fn(runs)`` and the state passing. ``ref``: an input whose vma the states take;
    ``initial``: whether ``x0`` may be nonzero (``False``: the caller gave no initial state)."""
    topo = topology(pos_BS, seg_BS, _rank(lay), lay.c, lay.pieces)
    C = lay.chunk
    N = -(-lay.L // C)
    kind = jnp.pad(topo.kind, ((0, 0), (0, N * C - lay.L)), constant_values=CONT)
    topo = dataclasses.replace(topo, kind=kind, gov=jnp.pad(topo.gov, ((0, 0), (0, N * C - lay.L)), mode="edge"))
    intra = intra_fn(runs(kind.reshape(kind.shape[0], N, C) != CONT))
    x0 = vary_as(x0, ref)
    o, final = pass_states(intra, topo, x0, lay.axis, cuts=lay.cuts, initial=initial)
    if lay.mesh is not None:  # every rank composed the same final state: keep rank 0's, typed as replicated
        final = lax.psum(jnp.where(_rank(lay) == 0, final, 0.0), COLOSSAL)
    return o, final
