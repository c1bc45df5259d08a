"""``Attended``: each rank receives only the K/V blocks its queries can see.

On packed rows most K/V an all-gather (or a ring) moves is never read: a query sees
the keys of its own document, and a dispatch plan (``load_balance.plan``) keeps
documents on few ranks. Here every device cuts each rank's keys into blocks of
``block`` tokens, and the queries into blocks of ``query_block``, and summarises each block
from the metadata every device already holds (``Meta``: segment range, position range, any
valid token). A small key block keeps what moves close to what is read (a needed document
tail costs at most a block of its neighbour); the query blocks only bound which keys may be
seen, so they stay a kernel tile long and the test stays cheap. For each ring
distance ``k = 1..c-1``, a device packs the blocks of its own keys that the queries
of rank ``r + k`` may see (the test is conservative: a block that might hold a
visible key goes) into a buffer of ``sizes[k-1]`` blocks, and one ``lax.ppermute``
per distance delivers it; the receiver rebuilds the same block list from the same
metadata, so no index travels. The local kernel then attends the device's queries
to its own K/V plus the received blocks, their positions and segment ids as data
(unused buffer slots get segment id ``-1``: nothing sees them).

With ``capacity`` instead of ``sizes`` (what ``Dispatch.kv_exchange`` gives), one
``lax.ragged_all_to_all`` moves every rank's needed blocks at once: each sender packs
the blocks for each receiver back to back, each receiver gets them back to back, and
only the needed blocks travel (the sizes are run-time values; ``capacity`` bounds the
buffers). Where the platform has no ragged all-to-all (XLA:CPU), the same call runs as
an all-to-all of ``capacity``-block slices with the same result (``ragged_all_to_all``).

Buffers are static (one compiled program per value). When some rank needs more
blocks than its buffers hold, every device of the step takes the all-gather instead (one ``lax.cond`` on a flag summed over ``dp`` and
``cp_colossal``): the answer is exact for any order and any batch, only slower.
Backward is autodiff: the gathers transpose to scatter-adds, each ``ppermute`` to
the reverse one (dK/dV of a received block travel back in K/V's dtype; the
all-gather path sums them in float32).

The plan gives the sizes for its batch (``Dispatch.kv_exchange``), bucketed so a
run compiles a handful of programs; :func:`needed_blocks` counts them on the host
with the same rule the devices apply.
Letters: B batch, T local queries, S sequence, N blocks, U block length, C ranks.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cp import kernels as _kernels
from jax_cp._masks import normalize_window
from jax_cp._mesh import COLOSSAL, DP, seq_chunk
from jax_cp._platform import target_platform
from jax_cp._softmax import check_soft_cap, varying_sinks
from jax_cp.kernels import _splash
from jax_cp.exchanges._base import KVExchange, Meta, _unpair_kv, pair_kv
from jax_cp.exchanges.all_gather import AllGather

__all__ = ["Attended", "BLOCK", "KEY_BLOCK", "block_length", "block_summary", "block_summary_of", "bucket",
           "exchange_for", "needed_blocks", "needed_from_summary", "query_block_length", "ragged_all_to_all",
           "ragged_exchange_for", "sees"]

BLOCK = 128  # tokens per block by default: one kernel tile (query blocks; key blocks unless said)
KEY_BLOCK = 32  # the plan's key blocks: at most this much unneeded K/V per document boundary
_BIG = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class Attended(KVExchange):
    """K/V blocks sent only to the ranks whose queries may see them (``lax.ppermute`` per distance).

    Attributes:
      block: tokens per key block (what moves); must divide each rank's keys (``S/c``).
      sizes: for ring distance ``k = 1..c-1`` (entry ``k-1``), the blocks every rank sends to
        rank ``(r + k) mod c`` (0: no transfer at that distance). ``len(sizes)`` must be
        ``cp_colossal - 1``.
      capacity: instead of ``sizes``: one ragged all-to-all, each device sending and receiving at
        most this many blocks (of any of its rows, to and from every rank together); only the
        needed blocks travel.
      query_block: tokens per query block whose keys are tested together (None: ``block``; the whole
        rank's queries when it does not divide them). Only bounds the test: smaller is tighter and
        costs more.
    """

    name: ClassVar[str] = "attended"
    supplies_segments: ClassVar[bool] = True  # unused buffer slots are masked by segment id -1
    block: int = BLOCK
    sizes: tuple[int, ...] = ()
    capacity: int | None = None
    query_block: int | None = None

    def __post_init__(self):
        if isinstance(self.block, bool) or not isinstance(self.block, (int, np.integer)) or self.block < 1:
            raise ValueError(f"Attended(block={self.block!r}) must be a positive int (tokens per exchanged block).")
        qb = self.query_block
        if qb is not None and (isinstance(qb, bool) or not isinstance(qb, (int, np.integer)) or qb < 1):
            raise ValueError(f"Attended(query_block={qb!r}) must be a positive int (tokens per query block) or None.")
        sizes = tuple(self.sizes) if isinstance(self.sizes, (tuple, list)) else None
        if sizes is None or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0 for n in sizes):
            raise ValueError(f"Attended(sizes={self.sizes!r}) must be a tuple of ints >= 0, one per ring distance "
                             "1..cp_colossal-1 (take it from load_balance.plan(...).kv_exchange).")
        cap = self.capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0 or sizes):
            raise ValueError(f"Attended(capacity={cap!r}, sizes={self.sizes!r}): capacity must be an int >= 0 and "
                             "then sizes empty (one ragged all-to-all instead of a buffer per ring distance).")
        object.__setattr__(self, "block", int(self.block))
        object.__setattr__(self, "sizes", tuple(int(n) for n in sizes))
        object.__setattr__(self, "capacity", None if cap is None else int(cap))
        # query_block == block means the default: one value, so equal exchanges compare equal.
        object.__setattr__(self, "query_block", None if qb is None or qb == self.block else int(qb))

    def __str__(self) -> str:
        qb = "" if self.query_block is None else f", query_block={self.query_block}"
        if self.capacity is not None:
            return f"{self.name}(block={self.block}{qb}, capacity={self.capacity})"
        return f"{self.name}(block={self.block}{qb}, sizes={self.sizes})"

    def received_tokens(self) -> int:
        """Key tokens every rank receives per row (all distances; with ``capacity``: at most, per
        device): what its K/V bytes scale with."""
        return self.block * (sum(self.sizes) if self.capacity is None else self.capacity)

    def buffers(self) -> tuple[int, ...]:
        """Its buffer sizes in blocks: ``(capacity,)``, or ``sizes`` (one per ring distance)."""
        return self.sizes if self.capacity is None else (self.capacity,)

    def holds(self, other: "Attended") -> bool:
        """Whether its buffers hold every block ``other``'s do (same block and transport): whatever
        batch ``other`` serves without falling back to the all-gather, this value serves too."""
        return (self.block == other.block and self.query_block == other.query_block
                and (self.capacity is None) == (other.capacity is None)
                and len(self.buffers()) == len(other.buffers())
                and all(a >= b for a, b in zip(self.buffers(), other.buffers())))

    def with_buffers(self, buffers) -> "Attended":
        """The same blocks and transport with these buffer sizes (``buffers()``'s form)."""
        buffers = tuple(int(n) for n in buffers)
        if self.capacity is not None:
            return Attended(block=self.block, capacity=buffers[0], query_block=self.query_block)
        return Attended(block=self.block, sizes=buffers, query_block=self.query_block)

    def attend(self, q_BTHd, k_BTKd, v_BTKd, meta: Meta, spec, sinks=None):
        c = lax.axis_size(COLOSSAL)
        kv = pair_kv(k_BTKd, v_BTKd)
        if c == 1:
            return _attend(q_BTHd, kv, meta, meta.keys_pos, meta.keys_seg, spec, sinks, kv_span=meta.keys_span)
        if self.capacity is None and len(self.sizes) != c - 1:
            raise ValueError(f"kv_exchange={self} has {len(self.sizes)} sizes, cp_colossal={c} needs {c - 1} (one per "
                             "ring distance); plan the batch for this mesh (load_balance.plan(...).kv_exchange).")
        U, Tk = self.block, kv.shape[1]
        if Tk % U:
            raise ValueError(f"kv_exchange={self}: block={U} does not divide the {Tk} keys per colossal rank; use a "
                             f"divisor of {Tk} (load_balance.plan(...).kv_exchange chooses one).")
        window = normalize_window(spec.local_window_size)
        plan = _Plan(meta, c, U, self.query_block or U, spec.is_causal, window)
        if self.capacity is not None:
            return _ragged_attend(q_BTHd, kv, meta, spec, sinks, plan, self.capacity)
        overflow = jnp.zeros((), jnp.int32)
        for k, n in enumerate(self.sizes, start=1):
            if n:
                overflow += jnp.sum(plan.count(k, send=True) > min(n, Tk // U)).astype(jnp.int32)
        # Every device must take the same branch (the branches hold different collectives).
        overflow = lax.psum(overflow, (DP, COLOSSAL))

        def selected(q, kv):
            parts = [(kv, plan.own_pos, plan.own_seg, plan.own_span)]
            for k, n in enumerate(self.sizes, start=1):
                n = min(n, Tk // U)
                if n:
                    parts.append(plan.exchange(kv, k, n))
            return _attend_parts(q, parts, meta, spec, sinks, plan.q_seg)

        return lax.cond(overflow > 0, lambda q, kv: _all_gathered(q, kv, meta, spec, sinks), selected, q_BTHd, kv)


def _ragged_attend(q_BTHd, kv, meta: Meta, spec, sinks, plan: "_Plan", capacity: int):
    """``Attended`` with ``capacity``: one ragged all-to-all of the needed blocks (or the all-gather
    when some device would send or receive more than ``capacity`` blocks)."""
    B, Tk = kv.shape[:2]
    c, U = plan.c, plan.U
    cap = max(1, min(capacity, B * (Tk // U) * (c - 1)))  # no more than every other rank's blocks
    sends, gets = plan.my_needs()  # [B, receiver, block] of my keys; [B, sender, block] of theirs
    overflow = (sends.sum() > cap) | (gets.sum() > cap)
    overflow = lax.psum(overflow.astype(jnp.int32), (DP, COLOSSAL))  # one branch for every device

    def selected(q, kv):
        got, pos, seg, span = _ragged_blocks(kv, sends, gets, plan, cap)
        got = jnp.broadcast_to(got[None], (pos.shape[0], *got.shape))  # every row's received blocks
        return _attend_parts(q, [(kv, plan.own_pos, plan.own_seg, plan.own_span), (got, pos, seg, span)], meta, spec,
                             sinks, plan.q_seg)

    return lax.cond(overflow > 0, lambda q, kv: _all_gathered(q, kv, meta, spec, sinks), selected, q_BTHd, kv)


def _first(flags_CN, n: int):
    """Indices of the ``True`` entries of ``flags [C, N]`` in row-major order, the first ``n`` (past the
    last: any index)."""
    idx = jnp.arange(flags_CN.size, dtype=jnp.int32)
    return jnp.argsort(jnp.where(flags_CN.reshape(-1), idx, flags_CN.size + idx))[:n]


def _ragged_blocks(kv, sends, gets, plan: "_Plan", cap: int):
    """This device's needed blocks from every rank (``[cap * U, ...]`` K/V, in sender then row then
    block order), and their positions, segment ids (``-1`` where a slot is unused or holds another
    row's block) and span ids (None without spans) for each row, ``[B, cap * U]``."""
    B, Tk = kv.shape[:2]
    c, U, nk = plan.c, plan.U, Tk // plan.U
    per_rank = lambda need: jnp.moveaxis(need, 1, 0).reshape(c, B * nk)  # [rank, row * block]
    items = _first(per_rank(sends), cap) % (B * nk)
    out = kv.reshape(B * nk, U, *kv.shape[2:])[items]  # [cap, U, ...]: for each receiver, back to back
    send, recv = per_rank(sends).sum(1, dtype=jnp.int32), per_rank(gets).sum(1, dtype=jnp.int32)
    at = lax.all_to_all(jnp.cumsum(recv) - recv, COLOSSAL, 0, 0, tiled=True)  # where mine land on each receiver
    got = ragged_all_to_all(out, jnp.zeros_like(out), jnp.cumsum(send) - send, send, at, recv, axis_name=COLOSSAL)
    slot = _first(per_rank(gets), cap)  # what each received slot holds: sender, row, block
    src, row, j = slot // (B * nk), slot % (B * nk) // nk, slot % nk
    used = jnp.arange(cap) < recv.sum()
    pos = plan.kpos.reshape(B, c, nk, U)[row, src, j]  # [cap, U]
    seg = jnp.where(used[:, None], plan.kseg.reshape(B, c, nk, U)[row, src, j], -1)
    mine = (row[None, :] == jnp.arange(B)[:, None])[..., None]  # [B, cap, 1]
    seg_B = jnp.where(mine, seg[None], -1).reshape(B, cap * U)
    rows = lambda a: jnp.broadcast_to(a.reshape(1, -1), (B, cap * U))
    span = None if plan.kspan is None else rows(plan.kspan.reshape(B, c, nk, U)[row, src, j])
    return got.reshape(cap * U, *kv.shape[2:]), rows(pos), seg_B, span


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str):
    """``lax.ragged_all_to_all`` where the platform has it; on CPU (whose XLA has none) the same result
    from an all-to-all of ``len(operand)``-row slices, one per receiver (more bytes; for tests).

    Args:
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes: as
        ``lax.ragged_all_to_all``'s (one entry per rank of ``axis_name`` in each 1-D array).
      axis_name: the mesh axis.

    Returns:
      ``output`` with the received slices written in.
    """
    if target_platform() != "cpu":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
    n = operand.shape[0]
    rows = jnp.clip(input_offsets[:, None] + jnp.arange(n)[None], 0, n - 1)  # [ranks, n]: each receiver's slice
    got = lax.all_to_all(operand[rows], axis_name, 0, 0, tiled=True)  # [ranks, n, ...]: from each sender
    at = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender's slice lands here
    i = jnp.arange(output.shape[0])
    inside = (i[None] >= at[:, None]) & (i[None] < (at + recv_sizes)[:, None])  # [ranks, M]
    src = jnp.argmax(inside, axis=0)
    val = got[src, jnp.clip(i - at[src], 0, n - 1)]
    hit = inside.any(axis=0).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(hit, val, output)


def _all_gathered(q_BTHd, kv_BT2Kd, meta: Meta, spec, sinks):
    """The overflow branch: every key, as ``AllGather``."""
    k, v = _unpair_kv(kv_BT2Kd, q_BTHd.shape[-1])
    return AllGather().attend(q_BTHd, k, v, meta, spec, sinks)


def _attend_parts(q_BTHd, parts, meta: Meta, spec, sinks, q_seg):
    """The local kernel on this rank's queries and several parts of keys ``(kv, positions, segment ids,
    span ids)`` (its own first, then what arrived), each attended on its own and merged by
    log-sum-exp where the kernel allows it (splash, blockwise, pallas_gpu, ``"xla"``; no max-logit
    statistic or residual asked): the own keys' work then needs no transfer, so the scheduler can
    run it while the others arrive. Else one call on every key."""
    kernel, plain = spec.kernel, not (spec.record_max_logits or spec.return_residual)
    if len(parts) > 1 and plain and kernel == _kernels.SPLASH:
        return _splash_parts(q_BTHd, parts, meta, spec, sinks, q_seg)
    if len(parts) > 1 and plain and sinks is None and kernel in (_kernels.BLOCKWISE, _kernels.PALLAS_GPU,
                                                                 _kernels.DENSE):
        outs = [_attend(q_BTHd, kv, meta, pos, seg, spec, None, q_seg, span, with_lse=True)
                for kv, pos, seg, span in parts]
        return _merge([o for o, _ in outs], [lse for _, lse in outs]).astype(q_BTHd.dtype)
    kv, pos, seg, span = ([p[i] for p in parts] for i in range(4))
    return _attend(q_BTHd, jnp.concatenate(kv, axis=1), meta, jnp.concatenate(pos, axis=1),
                   jnp.concatenate(seg, axis=1), spec, sinks, q_seg, None if span[0] is None else jnp.concatenate(span, axis=1))


def _merge(outs, lses):
    """Softmaxes over disjoint keys (``o [B, T, H, d]``, log-sum-exp ``[B, T, H]``) merged into one; a
    row that sees no key in any part (every log-sum-exp ``-inf``) is zero."""
    top = jnp.max(jnp.stack(lses), axis=0)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    weights = [jnp.exp(lse - top) for lse in lses]
    total = sum(weights)
    total = jnp.where(total > 0, total, 1.0)
    return sum(o.astype(jnp.float32) * (w / total)[..., None] for o, w in zip(outs, weights))


def _splash_parts(q_BTHd, parts, meta: Meta, spec, sinks, q_seg):
    """``_attend_parts`` with splash: ``_splash.chunked_attention`` over the parts."""
    chunks = [(*_unpair_kv(kv, q_BTHd.shape[-1]), pos, seg, span) for kv, pos, seg, span in parts]
    return _splash.chunked_attention(
        q_BTHd, chunks, q_positions=seq_chunk(meta.pos, (COLOSSAL,)), q_segment_ids=q_seg,
        q_span_ids=None if meta.span is None else seq_chunk(meta.span, (COLOSSAL,)), is_causal=spec.is_causal,
        window=normalize_window(spec.local_window_size), scale=spec.scale,
        soft_cap=check_soft_cap(spec.logits_soft_cap), interpret=target_platform() != "tpu",
        sinks=varying_sinks(sinks, q_BTHd, *(p[0] for p in parts)))


def _attend(q_BTHd, kv_BS2Kd, meta: Meta, kv_pos, kv_seg, spec, sinks, q_seg=None, kv_span=None,
            with_lse: bool = False):
    """The local kernel on this rank's queries and the keys in hand, their metadata as data
    (``with_lse``: ``(o, log-sum-exp)``, for a merge)."""
    pos = seq_chunk(meta.pos, (COLOSSAL,))
    q_seg = seq_chunk(meta.seg, (COLOSSAL,)) if q_seg is None else q_seg
    k, v = _unpair_kv(kv_BS2Kd, q_BTHd.shape[-1])
    spans = {} if meta.span is None else dict(q_span_ids=seq_chunk(meta.span, (COLOSSAL,)), kv_span_ids=kv_span)
    return _kernels.local_attention(
        q_BTHd, k, v, kernel=spec.kernel, q_positions=pos, kv_positions=kv_pos, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg, is_causal=spec.is_causal, local_window_size=spec.local_window_size,
        scale=spec.scale, block_q=spec.block_q, block_kv=spec.block_kv, logits_soft_cap=spec.logits_soft_cap,
        sinks=sinks, return_max_logits=spec.record_max_logits, return_residual=spec.return_residual or with_lse,
        **spans,
    )


class _Plan:
    """Per device: which of a rank's key blocks another rank's queries may see, from the full metadata."""

    def __init__(self, meta: Meta, c: int, U: int, Uq: int, is_causal: bool, window):
        self.c, self.U, self.is_causal, self.window = c, U, is_causal, window
        self.me = lax.axis_index(COLOSSAL)
        kpos, kseg = meta.keys_pos, meta.keys_seg
        B, S_kv = kpos.shape
        segmented = meta.seg is not None  # kv_seg comes only with seg (metadata_sides)
        # Unused buffer slots are masked by segment id -1, so segment ids are always given.
        self.q_seg = seq_chunk(meta.seg, (COLOSSAL,)) if meta.seg is not None else \
            jnp.zeros(seq_chunk(meta.pos, (COLOSSAL,)).shape, jnp.int32)
        kseg = kseg if segmented else jnp.zeros(kpos.shape, jnp.int32)
        self.kpos = kpos.reshape(B, c, S_kv // c)
        self.kseg = kseg.reshape(B, c, S_kv // c)
        self.own_pos, self.own_seg = seq_chunk(kpos, (COLOSSAL,)), seq_chunk(kseg, (COLOSSAL,))
        kspan = meta.keys_span
        self.kspan = None if kspan is None else kspan.reshape(B, c, S_kv // c)
        self.own_span = None if kspan is None else seq_chunk(kspan, (COLOSSAL,))
        T = meta.pos.shape[1] // c
        Uq = query_block_length(T, Uq)
        self.q = block_summary(jnp, meta.pos, meta.seg, Uq, meta.span)  # [B, c * T/Uq]
        self.k = block_summary(jnp, kpos, kseg if segmented else None, U, kspan)  # [B, c * S_kv/(c U)]
        self.nq, self.nk = T // Uq, S_kv // c // U

    def _needs(self, receiver, sender):
        """``[B, nk]``: blocks of ``sender``'s keys that ``receiver``'s queries may see."""
        q = _Summary(*(lax.dynamic_slice_in_dim(a, receiver * self.nq, self.nq, axis=1) for a in self.q))
        k = _Summary(*(lax.dynamic_slice_in_dim(a, sender * self.nk, self.nk, axis=1) for a in self.k))
        return sees(jnp, q, k, self.is_causal, self.window).any(axis=1)

    def my_needs(self):
        """``(sends [B, receiver, nk], gets [B, sender, nk])``: the blocks of this device's keys each rank's
        queries may see, and the blocks of each rank's keys this device's queries may see (none of its
        own: the local keys are attended where they are)."""
        B, c, me = self.q.valid.shape[0], self.c, self.me
        q_me = _Summary(*(lax.dynamic_slice_in_dim(a, me * self.nq, self.nq, axis=1) for a in self.q))
        k_me = _Summary(*(lax.dynamic_slice_in_dim(a, me * self.nk, self.nk, axis=1) for a in self.k))
        sends = sees(jnp, self.q, k_me, self.is_causal, self.window).reshape(B, c, self.nq, self.nk).any(axis=2)
        gets = sees(jnp, q_me, self.k, self.is_causal, self.window).any(axis=1).reshape(B, c, self.nk)
        other = (jnp.arange(c) != me)[None, :, None]
        return sends & other, gets & other

    def _pair(self, k: int, send: bool):
        """(receiver, sender) of this device's transfer at distance ``k``, sending or receiving."""
        c, me = self.c, self.me
        return ((me + k) % c, me) if send else (me, (me - k) % c)

    def count(self, k: int, send: bool):
        return self._needs(*self._pair(k, send)).sum(axis=1)

    def _chosen(self, k: int, n: int, send: bool):
        """The first ``n`` needed blocks (ascending) and which of the ``n`` slots hold one."""
        need = self._needs(*self._pair(k, send))
        idx = jnp.argsort(jnp.where(need, 0, 1), axis=1, stable=True)[:, :n]
        return idx, jnp.arange(n)[None, :] < need.sum(axis=1, keepdims=True)

    def exchange(self, kv_BT, k: int, n: int):
        """Sends this device's chosen blocks to rank ``me + k``, receives rank ``me - k``'s for it:
        ``(kv [B, n*U, ...], positions [B, n*U], segment ids [B, n*U], span ids [B, n*U] or None)``."""
        c, U = self.c, self.U
        B = kv_BT.shape[0]
        idx, _ = self._chosen(k, n, send=True)
        blocks = kv_BT.reshape(B, -1, U, *kv_BT.shape[2:])
        out = jnp.take_along_axis(blocks, idx.reshape(B, n, *(1,) * (blocks.ndim - 2)), axis=1)
        got = lax.ppermute(out, COLOSSAL, [(i, (i + k) % c) for i in range(c)])
        idx, used = self._chosen(k, n, send=False)
        src = (self.me - k) % c
        pick = lambda a: jnp.take_along_axis(lax.dynamic_index_in_dim(a, src, axis=1, keepdims=False).reshape(
            B, -1, U), idx[..., None], axis=1)
        pos, seg = pick(self.kpos), jnp.where(used[..., None], pick(self.kseg), -1)
        span = None if self.kspan is None else pick(self.kspan).reshape(B, n * U)
        return got.reshape(B, n * U, *kv_BT.shape[2:]), pos.reshape(B, n * U), seg.reshape(B, n * U), span


class _Summary(NamedTuple):
    """Per block of tokens, ``[..., 3]`` for three parts: the tokens of the first valid token's segment,
    of the last one's, and the rest; each part: any valid token, its segment id and position ranges,
    and the range of its span ids other than 0 (``(BIG, -1)``: none)."""

    valid: object
    seg_min: object
    seg_max: object
    pos_min: object
    pos_max: object
    span_min: object
    span_max: object


def block_summary(xp, pos_BS, seg_BS, block: int, span_BS=None) -> _Summary:
    """``[B, S/block, 3]`` summaries of consecutive blocks (``xp``: ``numpy`` on the host, ``jax.numpy`` on
    device). A block cut across a document boundary is summarised per side: one range of positions
    over both documents would make a window (or causal) test see nearly every block of either.
    ``span_BS``: bidirectional span ids (0: none), or None."""
    B, S = pos_BS.shape
    p = pos_BS.reshape(B, S // block, block)
    if seg_BS is None:
        s, valid = xp.zeros(p.shape, p.dtype), xp.ones(p.shape, bool)
    else:
        s = seg_BS.reshape(B, S // block, block)
        valid = s >= 0
    idx = xp.arange(block)[None, None, :]
    first_at = xp.where(valid, idx, block).min(axis=-1, keepdims=True).clip(max=block - 1)
    last_at = xp.where(valid, idx, -1).max(axis=-1, keepdims=True).clip(min=0)
    first = xp.take_along_axis(s, first_at, axis=-1)
    last = xp.take_along_axis(s, last_at, axis=-1)
    in_first = valid & (s == first)
    in_last = valid & (s == last) & ~in_first
    parts = xp.stack([in_first, in_last, valid & ~in_first & ~in_last], axis=-2)  # [B, N, 3, U]
    s, p = s[..., None, :], p[..., None, :]  # each part reduced over its block's tokens, the last axis
    if span_BS is None:
        span_min, span_max = xp.full(parts.shape[:3], _BIG, p.dtype), xp.full(parts.shape[:3], -1, p.dtype)
    else:
        sp = span_BS.reshape(B, S // block, block)[..., None, :]
        in_span = parts & (sp != 0)
        span_min, span_max = xp.where(in_span, sp, _BIG).min(axis=-1), xp.where(in_span, sp, -1).max(axis=-1)
    return _Summary(parts.any(axis=-1), xp.where(parts, s, _BIG).min(axis=-1), xp.where(parts, s, -1).max(axis=-1),
                    xp.where(parts, p, _BIG).min(axis=-1), xp.where(parts, p, -_BIG).max(axis=-1), span_min, span_max)


def block_summary_of(blocks_BN73) -> _Summary:
    """The summary ``Dispatch.blocks`` stores (its seven fields stacked on axis -2)."""
    return _Summary(blocks_BN73[..., 0, :].astype(bool), *(blocks_BN73[..., i, :] for i in range(1, 7)))


def sees(xp, q: _Summary, k: _Summary, is_causal: bool, window) -> object:
    """``[B, Nq, Nk]``: query block may see a key of key block (never False where one does): some
    part of each shares a segment id in range, in causal order (or shares a span id in range),
    within the window."""
    qx = lambda a: a[:, :, None, :, None]
    kx = lambda a: a[:, None, :, None, :]
    m = qx(q.valid) & kx(k.valid) & (qx(q.seg_min) <= kx(k.seg_max)) & (kx(k.seg_min) <= qx(q.seg_max))
    if is_causal:
        m &= (kx(k.pos_min) <= qx(q.pos_max)) | ((qx(q.span_min) <= kx(k.span_max)) & (kx(k.span_min) <= qx(q.span_max)))
    if window is not None:
        left, right = (min(w, _BIG) for w in window)
        # Invalid parts are already False.
        m &= _within(qx(q.pos_min), kx(k.pos_max), left) & _within(kx(k.pos_min), qx(q.pos_max), right)
    return m.any(axis=(-2, -1))


def _within(a, b, reach: int):
    """``a - b <= reach`` for int32-range values without overflow (``reach >= 0``): where ``a > b`` the
    difference lies in ``(0, 2**32)``, which uint32 arithmetic holds exactly."""
    return (a <= b) | ((a.astype(np.uint32) - b.astype(np.uint32)) <= reach)


def needed_blocks(positions, segment_ids, c: int, block: int, *, is_causal: bool, local_window_size=None,
                  span_ids=None, query_block: int | None = None):
    """Host side (NumPy): ``[B, c, c]`` blocks of rank ``s``'s keys that rank ``r``'s queries may
    see (entry ``[b, r, s]``; the diagonal is 0), by the rule the devices apply, for rows already in
    the order attention runs on (self-attention; ``span_ids``: bidirectional spans, or None;
    ``query_block``: ``Attended.query_block``)."""
    pos = np.asarray(positions, np.int64)
    seg = None if segment_ids is None else np.asarray(segment_ids, np.int64)
    span = None if span_ids is None else np.asarray(span_ids, np.int64)
    Uq = query_block_length(pos.shape[1] // c, query_block or block)
    return needed_from_summary(block_summary(np, pos, seg, block, span), c, is_causal=is_causal,
                               local_window_size=local_window_size,
                               query_summary=None if Uq == block else block_summary(np, pos, seg, Uq, span))


def query_block_length(queries_per_rank: int, query_block: int) -> int:
    """The query block the devices test with: ``query_block``, or every query of the rank when it does
    not divide them."""
    return query_block if queries_per_rank % query_block == 0 else queries_per_rank


def needed_from_summary(summary, c: int, *, is_causal: bool, local_window_size=None,
                        query_summary=None) -> np.ndarray:
    """:func:`needed_blocks` from the rows' key block summaries (``[B, S/U, 3]`` each, NumPy) and query
    block summaries (None: the key blocks')."""
    k = _Summary(*(np.asarray(a) for a in summary))
    q = k if query_summary is None else _Summary(*(np.asarray(a) for a in query_summary))
    window = normalize_window(local_window_size)
    # The whole blocks' ranges first: exact for a pair of blocks of one part each, and never False
    # where a part pair passes; the three-part test runs only on the pairs that pass with more parts.
    qw, kw = _whole(q), _whole(k)
    m = sees(np, qw, kw, is_causal, window)  # [B, Nq, Nk]
    several = (q.valid.sum(-1) > 1)[:, :, None] | (k.valid.sum(-1) > 1)[:, None, :]
    b, i, j = np.nonzero(m & several)
    part = lambda s, idx: _Summary(*(a[b, idx][:, None] for a in s))  # [P, 1, 3]: one block a pair
    m[b, i, j] = sees(np, part(q, i), part(k, j), is_causal, window)[:, 0, 0]
    B, Nq, Nk = m.shape
    counts = m.reshape(B, c, Nq // c, c, Nk // c).any(axis=2).sum(axis=-1)  # [B, receiver, sender]
    counts[:, np.arange(c), np.arange(c)] = 0
    return counts


def _whole(s: _Summary) -> _Summary:
    """Each block as one part (``[B, N, 1]``): the ranges over its valid parts (span ids: over its
    parts that hold one; any id but 0 is a span, negative ones too)."""
    lo = lambda a, has: np.where(has, a, _BIG).min(-1, keepdims=True)
    hi = lambda a, has, none: np.where(has, a, none).max(-1, keepdims=True)
    spans = s.span_min <= s.span_max  # (BIG, -1): no span
    span_max = hi(s.span_max.astype(np.int64), spans, np.iinfo(np.int64).min)
    return _Summary(s.valid.any(-1, keepdims=True), lo(s.seg_min, s.valid), hi(s.seg_max, s.valid, -_BIG),
                    lo(s.pos_min, s.valid), hi(s.pos_max, s.valid, -_BIG), lo(s.span_min, spans),
                    np.where(spans.any(-1, keepdims=True), span_max, -1))


def exchange_for(counts_BCC: np.ndarray, block: int, blocks_per_rank: int, query_block: int | None = None) -> Attended:
    """The exchange serving ``counts`` (``needed_blocks``'; ranks of ``blocks_per_rank`` blocks): one buffer size for every distance, the
    largest need at any distance of any row and rank, bucketed. One size, not one per distance: a
    tuple of per-distance sizes takes a new value almost every batch (a compile each), and measured
    on packed rows it moves only 1.1-1.45x less."""
    c = counts_BCC.shape[1]
    r = np.arange(c)
    need = max((int(counts_BCC[:, r, (r - k) % c].max()) for k in range(1, c)), default=0)
    n = min(bucket(need), blocks_per_rank)  # a whole rank's keys at most
    return Attended(block=block, sizes=(n,) * (c - 1), query_block=query_block)


def ragged_exchange_for(counts_BCC: np.ndarray, block: int, blocks_per_rank: int, dp: int = 1,
                        query_block: int | None = None) -> Attended:
    """The ragged exchange serving ``counts`` (``needed_blocks``'): its capacity is the most blocks any
    device sends or receives (summed over the rows of its dp shard: rows ``b`` with ``b // (B/dp)``
    equal), rounded up to a power of two, and at most every other rank's blocks of those rows. Only
    the needed blocks travel, so the capacity costs buffer memory, not bytes moved: rounded that
    coarsely, and one value for both sides (a send and a receive buffer apart would double the
    values), a run compiles a handful of values.

    Args:
      counts_BCC: ``[B, receiver, sender]`` blocks needed.
      block: tokens per block.
      blocks_per_rank: blocks of one rank's keys in one row.
      dp: the mesh's dp size (``B`` rows split into ``dp`` shards).
      query_block: ``Attended.query_block``, the one ``counts`` was counted with.

    Returns:
      ``Attended(block, capacity=...)``.
    """
    B, c = counts_BCC.shape[:2]
    per_device = np.asarray(counts_BCC).reshape(dp, B // dp, c, c).sum(axis=1)  # [dp, receiver, sender]
    need = int(max(per_device.sum(axis=2).max(), per_device.sum(axis=1).max(), 0))
    capacity = 0 if need == 0 else 1 << (need - 1).bit_length()
    return Attended(block=block, capacity=min(capacity, (B // dp) * blocks_per_rank * (c - 1)), query_block=query_block)


# The bucket grid: 1, 2, 3, 4, 6, 8, 12, 16, ... blocks (powers of two and 1.5 times them).
def bucket(n: int) -> int:
    """The smallest grid value >= ``n`` (grid: 0 and 2^i, 1.5 * 2^i): at most 1.5x the need."""
    if n <= 0:
        return 0
    p = 1 << (int(n) - 1).bit_length()  # the power of two >= n
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= n else p


def block_length(keys_per_rank: int, chunk: int | None = None, limit: int = BLOCK) -> int:
    """The block for ``keys_per_rank`` keys per rank: the largest power of two <= ``limit`` dividing
    both it and the plan's ``chunk`` length (so no block straddles two chunks)."""
    g = keys_per_rank if chunk is None else np.gcd(keys_per_rank, chunk)
    return int(max(b for b in (1 << i for i in range(limit.bit_length())) if g % b == 0 and b <= limit))
