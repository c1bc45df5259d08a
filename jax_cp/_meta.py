"""The per-token mask metadata every floor needs, as one pytree.

``Meta`` holds the full-sequence ``[B, S]`` positions and segment ids every device keeps (and, where
they differ from the queries', the keys'), with ``natural`` a static field: the positions are the
default ``arange(S)`` of every row and nothing else is given, so a kernel may build its mask when
traced. A registered dataclass, so it crosses ``jax.shard_map`` (and ``jit``) as one argument whose
in_specs are a ``Meta`` of ``PartitionSpec``s (``specs``), and ``natural`` stays a Python bool.
Letters: B batch, S sequence.
"""
from __future__ import annotations

import dataclasses

import jax

__all__ = ["Meta"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Meta:
    """Full-sequence mask metadata every device holds: ``[B, S]`` positions and segment ids (or None).

    Attributes:
      pos: the queries' positions ``[B, S]``.
      seg: the queries' segment ids ``[B, S]`` (negative: padding), or None.
      kv_seg: the keys' segment ids, when they differ from ``seg``: padding stated separately for
        queries and keys (``query_seq_lengths``/``key_value_seq_lengths``), or cross attention.
      kv_pos: the keys' positions ``[B, S_kv]`` (cross attention: keys are other tokens than the
        queries, of their own length); ``None``: the queries' own.
      span: the queries' bidirectional span ids ``[B, S]`` (0: none; a causal mask lets a token see
        the later tokens of its own span), or None.
      kv_span: the keys' span ids (cross attention); ``None``: the queries' own.
      natural: (static) ``pos`` is the default ``arange(S)`` of every row and nothing else is given.
    """

    pos: jax.Array
    seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    kv_pos: jax.Array | None = None
    span: jax.Array | None = None
    kv_span: jax.Array | None = None
    natural: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def keys_seg(self):
        return self.seg if self.kv_seg is None else self.kv_seg

    @property
    def keys_span(self):
        return self.span if self.kv_span is None else self.kv_span

    @property
    def keys_pos(self):
        return self.pos if self.kv_pos is None else self.kv_pos

    def specs(self, spec) -> "Meta":
        """The same structure with ``spec`` (a ``PartitionSpec``) for every array: its shard_map in_specs."""
        return jax.tree.map(lambda _: spec, self)
