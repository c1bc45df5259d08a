"""Byte-level text data, packed into fixed windows, loaded per process.

Documents (files) become bytes followed by an end-of-document token ``EOD``,
concatenated into one token stream (or, with a ``tokenizers.Tokenizer``, its token ids
followed by the checkpoint's end-of-sequence id: ``load_corpus(..., tokenizer=, eod=)``). A window of ``S`` tokens carries, besides
the tokens and next-token labels, the ``segment_ids`` of its documents, each
token's ``positions`` within its document piece (restarting at the window start
and at each document), and ``weights`` (0 where the label starts another
document). The window of sample ``g = step * batch + row`` comes from a
permutation of all windows seeded by ``(seed, epoch)``: the data order depends
only on the seed and step, never on how many processes read it, so ``--resume``
continues it exactly.

Each process builds only its rows and sequence columns of a global batch
(:func:`process_rows`, :func:`place`), in the natural order, the dual-chunk order
or each row's own order from a dispatch plan of its rows (:func:`plan_rows`).
Letters: B batch, S sequence, R rows of this process.
"""
from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import jax
import numpy as np

import jax_cp
from jax_cp import load_balance

__all__ = ["EOD", "Corpus", "Windows", "default_corpus_files", "load_corpus", "make_global_batch", "pack", "place",
           "plan_rows", "process_rows"]

EOD = 256  # end of document; bytes are 0..255
FIELDS = ("tokens", "labels", "positions", "segment_ids", "weights")
FIELD_DTYPES = {"tokens": np.int32, "labels": np.int32, "positions": np.int32, "segment_ids": np.int32,
                "weights": np.float32}  # what pack gives


def default_corpus_files() -> list[Path]:
    """The running interpreter's standard-library ``.py`` files (no download needed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _files(path: str | os.PathLike | None) -> list[Path]:
    if path is None:
        return default_corpus_files()
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.parts))
        if files:
            return files
        raise ValueError(f"--data {path}: the folder holds no files.")
    raise ValueError(f"--data {path}: no such file or folder.")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams (uint16; uint32 for a tokenizer's ids) of the training and held-out documents, and the
    end-of-document token ending each document."""

    train: np.ndarray
    eval: np.ndarray
    num_docs: int
    eod: int = EOD


def _stream(docs: list[bytes], tokenizer=None, eod: int = EOD) -> np.ndarray:
    dtype = np.uint16 if tokenizer is None else np.uint32
    parts = []
    for doc in docs:
        ids = (np.frombuffer(doc, np.uint8) if tokenizer is None
               else tokenizer.encode(doc.decode("utf-8", errors="replace")).ids)
        parts.append(np.asarray(ids).astype(dtype))
        parts.append(np.array([eod], dtype))
    return np.concatenate(parts) if parts else np.zeros((0,), dtype)


def load_corpus(path: str | os.PathLike | None, *, eval_every: int = 20, tokenizer=None, eod: int = EOD) -> Corpus:
    """Reads every file under ``path`` (or the stdlib); every ``eval_every``-th document is held out.

    With a single document, its last tenth is held out instead. ``tokenizer`` (a ``tokenizers.Tokenizer``)
    turns each document's text into token ids, and ``eod`` ends every document (the checkpoint's
    end-of-sequence id); without one, tokens are bytes and ``EOD``.
    """
    docs = [f.read_bytes() for f in _files(path)]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"--data {path}: no text found (all files are empty).")
    if len(docs) == 1:
        stream = _stream(docs, tokenizer, eod)
        cut = int(len(stream) * 0.9)
        return Corpus(stream[:cut], stream[cut:], 1, eod)
    if len(docs) < eval_every:
        kept, held = docs[:-1], docs[-1:]
    else:
        kept = [d for i, d in enumerate(docs) if i % eval_every != eval_every - 1]
        held = [d for i, d in enumerate(docs) if i % eval_every == eval_every - 1]
    return Corpus(_stream(kept, tokenizer, eod), _stream(held, tokenizer, eod), len(docs), eod)


def pack(stream: np.ndarray, starts: np.ndarray, seq_len: int, eod: int = EOD) -> dict[str, np.ndarray]:
    """Windows ``stream[start : start + S + 1]`` -> ``[len(starts), S]`` arrays of :data:`FIELDS` (``eod``
    ends a document)."""
    idx_BS = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = stream[idx_BS].astype(np.int32)
    tokens, labels = chunk[:, :-1], chunk[:, 1:]
    is_eod = tokens == eod
    # A token starts a new document when the previous token ended one.
    new_doc = np.concatenate([np.ones_like(is_eod[:, :1]), is_eod[:, :-1]], axis=1)
    segment_ids = np.cumsum(new_doc, axis=1).astype(np.int32)
    idx = np.broadcast_to(np.arange(seq_len), tokens.shape)
    doc_start = np.maximum.accumulate(np.where(new_doc, idx, 0), axis=1)
    positions = (idx - doc_start).astype(np.int32)
    weights = (~is_eod).astype(np.float32)  # the label after EOD is the start of another document
    return dict(tokens=tokens, labels=labels, positions=positions, segment_ids=segment_ids, weights=weights)


def prefix_lm(fields: dict[str, np.ndarray], fraction: float) -> dict[str, np.ndarray]:
    """``fields`` (:func:`pack`'s) for a prefix-LM objective: the first ``fraction`` of each document in a
    row (at least one token) becomes a bidirectional prompt prefix, one span id per document
    (``span_ids``: segment id + 1 there, 0 elsewhere, ``jax_cp``'s ``span_ids=``), and the loss skips
    the labels inside it (``weights`` 0 where the next token is still in the prefix)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1): the share of each document that is prompt.")
    seg, pos = fields["segment_ids"], fields["positions"]
    span = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        _, inverse, sizes = np.unique(seg[b], return_inverse=True, return_counts=True)
        prefix = np.maximum(1, (fraction * sizes[inverse]).astype(np.int64))  # each token's document's prefix
        span[b] = np.where(pos[b] < prefix, seg[b] + 1, 0)
    in_prefix_next = np.concatenate([span[:, 1:] != 0, np.zeros_like(span[:, :1], bool)], axis=1)
    same_doc_next = np.concatenate([seg[:, 1:] == seg[:, :-1], np.zeros_like(seg[:, :1], bool)], axis=1)
    weights = np.where(in_prefix_next & same_doc_next, 0.0, fields["weights"]).astype(np.float32)
    return {**fields, "span_ids": span.astype(np.int32), "weights": weights}


class Windows:
    """Deterministic windows of a stream: sample ``g`` -> a start offset.

    Non-overlapping windows in a fresh permutation per epoch, seeded by ``(seed, epoch)``; ``eod`` ends
    a document (``Corpus.eod``).
    """

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int, eod: int = EOD):
        self.stream, self.seq_len, self.seed, self.eod = stream, seq_len, seed, eod
        self.num_windows = (len(stream) - 1) // seq_len
        self._perms: dict[int, np.ndarray] = {}
        if self.num_windows < 1:
            raise ValueError(f"the text has {len(stream)} tokens, fewer than seq_len+1={seq_len + 1}; "
                             "use a shorter --seq-len or more --data.")

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:  # keep the last two epochs: a batch may straddle them
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def starts(self, samples: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(samples, self.num_windows)
        return np.array([self._perm(int(e))[w] for e, w in zip(epochs, within)], np.int64) * self.seq_len

    def rows(self, step: int, batch: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``rows`` of the global batch of ``step``."""
        return pack(self.stream, self.starts(step * batch + np.asarray(rows)), self.seq_len, self.eod)


def _process_indices(sharding, global_shape) -> tuple[np.ndarray, ...]:
    """Per dimension, the sorted global indices this process's devices hold."""
    per_dim = [set() for _ in global_shape]
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        for d, (sl, n) in enumerate(zip(index, global_shape)):
            per_dim[d].update(range(*sl.indices(n)))
    return tuple(np.array(sorted(s), np.int64) for s in per_dim)


def process_rows(sharding, batch: int, seq_len: int) -> np.ndarray:
    """The global rows of a ``[batch, seq_len]`` batch that this process's devices hold (sorted)."""
    return _process_indices(sharding, (batch, seq_len))[0]


def place(local: dict[str, np.ndarray], sharding, batch: int, *, order: np.ndarray | None = None) -> dict:
    """Global ``[batch, S]`` arrays from this process's rows (:func:`process_rows`, every column, natural order).

    ``order`` (the natural index of the token at each slot) puts the columns in another order before
    sharding: ``[S]`` every row alike (the dual-chunk order), ``[R, S]`` each local row its own (a
    dispatch plan's ``perm`` of these rows); ``None`` keeps the natural order. Each process keeps
    only the columns its devices hold.
    """
    R, S = local["tokens"].shape
    _, cols = _process_indices(sharding, (batch, S))
    if order is None:
        idx = (slice(None), cols)
    elif np.ndim(order) == 1:
        idx = (slice(None), np.asarray(order)[cols])  # reordered column j holds natural column order[j]
    else:
        if np.shape(order) != (R, S):
            raise ValueError(f"order.shape={np.shape(order)} must be [S]={S} or [rows, S]=({R}, {S}), the rows "
                             "this process holds; plan these rows (or slice a global order by process_rows).")
        idx = (np.arange(R)[:, None], np.asarray(order)[:, cols])  # row r's column j: natural order[r, j]
    return {k: jax.make_array_from_process_local_data(sharding, v[idx], (batch, S)) for k, v in local.items()}


def make_global_batch(windows: Windows, step: int, batch: int, sharding, *, order: np.ndarray | None = None):
    """The global ``[B, S]`` arrays of ``step``, each process building only its own rows and columns.

    ``order`` is the load-balance order (natural index of the token at each slot) applied to every
    field before sharding: ``[S]`` for every row, ``[B, S]`` per row (global rows: a process reads its
    own); ``None`` keeps the natural order.
    """
    rows = process_rows(sharding, batch, windows.seq_len)
    if order is not None and np.ndim(order) == 2:
        if np.shape(order) != (batch, windows.seq_len):
            raise ValueError(f"order.shape={np.shape(order)} must be [batch, seq_len]=({batch}, {windows.seq_len}) "
                             f"or [seq_len]=({windows.seq_len},).")
        order = np.asarray(order)[rows]
    return place(windows.rows(step, batch, rows), sharding, batch, order=order)


def plan_rows(local: dict[str, np.ndarray], mesh, rows: np.ndarray, batch: int, *,
              chunks_per_rank: int | None = None) -> list[load_balance.Dispatch]:
    """Dispatch plans of this process's rows ``rows`` of a global batch, one per dp shard, in row order
    (``chunks_per_rank``: ``load_balance.plan``'s, ``None`` for its default).

    ``local`` holds the rows' natural ``segment_ids`` and ``positions`` (every column). A process
    holds whole dp shards, and each shard is planned on its own: its order depends on its rows only,
    so every process holding (columns of) a shard plans it alike, without exchanging anything.
    """
    dims = jax_cp.mesh_dims(mesh)
    per_shard = batch // dims.dp
    rows, starts = np.asarray(rows), np.asarray(rows)[::per_shard]
    whole = (len(rows) % per_shard == 0 and not np.any(starts % per_shard)
             and np.array_equal(rows, (starts[:, None] + np.arange(per_shard)).reshape(-1)))
    if not whole:
        raise ValueError(f"rows={rows.tolist()} are not whole dp shards of {per_shard} rows (batch={batch}, "
                         f"dp={dims.dp}); shard the batch axis over dp.")
    one_shard = dataclasses.replace(dims, dp=1)
    span = local.get("span_ids")  # a prefix-LM batch: the plan balances the pairs its spans add
    chunks = {} if chunks_per_rank is None else {"chunks_per_rank": chunks_per_rank}
    return [load_balance.plan(local["segment_ids"][r : r + per_shard], one_shard,
                              positions=local["positions"][r : r + per_shard],
                              span_ids=None if span is None else span[r : r + per_shard], **chunks)
            for r in range(0, len(rows), per_shard)]
