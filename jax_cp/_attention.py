"""Context-parallel dot-product attention over the four-axis mesh.

Per device (inside one ``jax.shard_map``, the body shared with ``CPAttention``:
``_body.attention_shard``), with c=|cp_colossal|, u=|cp_ulysses|, t=|tp|:

    q, k, v [B, S/(c*u), H/t, d]  --Ulysses all-to-all over cp_ulysses-->  [B, S/c, H/(t*u), d]
    k, v  --the K/V exchange over cp_colossal (jax_cp.exchanges)-->  every key
    local kernel on global positions   -->  o [B, S/c, H/(t*u), d]
    o  --inverse all-to-all-->  [B, S/(c*u), H/t, d]

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_cp import kernels
from jax_cp._checks import check_positive_int, refuse_dense
from jax_cp._defaults import AUTO
from jax_cp._body import (GivenQKV, attention_shard, check_dtype, kernel_for_dtype, metadata_sides, placed_metadata,
                          shard_call, span_sides)
from jax_cp._masks import normalize_window, visible
from jax_cp._meta import Meta
from jax_cp._mesh import CP, DP, TP, mesh_dims, place
from jax_cp._softmax import check_sinks
from jax_cp._spec import AttentionSpec, check_seq_batch

__all__ = ["dot_product_attention", "visibility", "LAYOUTS"]

LAYOUTS = ("BSHD", "BNSD")
X_SPEC = P(DP, CP, TP, None)  # [B, S, H, d]


def _shard_fn(q, k, v, sinks, meta, *, spec):
    return attention_shard(GivenQKV(q, k, v, sinks), meta, spec=spec)


def _check_qkv(query, key, value, layout):
    """Checked ``[B, S, H, d]`` q, k, v (from ``layout``; rank-3 unbatched inputs get a batch of 1)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}.")
    ranks = {getattr(a, "ndim", None) for a in (query, key, value)}
    for name, a in (("query", query), ("key", key), ("value", value)):
        if len(ranks) > 1 or getattr(a, "ndim", None) not in (3, 4):
            raise ValueError(f"{name}.shape={getattr(a, 'shape', None)} must have rank 4 ({layout}), or rank 3 "
                             f"({layout[1:]}: one unbatched sequence) for query, key and value alike.")
    if ranks == {3}:
        query, key, value = (a[None] for a in (query, key, value))
    if layout == "BNSD":
        query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query, key, value))
    B, T, H, d = query.shape
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key.shape={key.shape} and value.shape={value.shape} must match but for the head dim "
                         "(the value's may differ: MLA).")
    if key.shape[0] != B or key.shape[3] != d:
        raise ValueError(
            f"key.shape={key.shape} does not fit query.shape={query.shape}: batch and head dim must match "
            f"(layout={layout!r}; the sequence lengths may differ: cross attention)."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} must be equal.")
    check_dtype("query", query.dtype)
    return query, key, value


def _check_jax_nn_arguments(bias, mask, implementation, kernel):
    """jax.nn's arguments: ``bias``/``mask`` refused with the data-driven alternative; ``implementation``
    mapped to ``kernel`` (one of the two)."""
    refuse_dense(bias, mask)
    return kernels.from_implementation(implementation, kernel)


def dot_product_attention(
    query, key, value, bias=None, mask=None, *, mesh, is_causal=False, scale=None, layout="BSHD",
    positions=None, segment_ids=None, local_window_size=None,
    kernel="auto", kv_exchange=AUTO, block_q=None, block_kv=None, logits_soft_cap=None, sinks=None,
    return_max_logits=False, implementation=None, return_residual=False, query_seq_lengths=None,
    key_value_seq_lengths=None, kv_positions=None, kv_segment_ids=None, span_ids=None, kv_span_ids=None,
):
    """Context-parallel counterpart of ``jax.nn.dot_product_attention``.

    Global arrays in, a global array out (batch on ``dp``, sequence on ``(cp_colossal, cp_ulysses)``,
    heads on ``tp``): Ulysses when ``cp_colossal=1``, Colossal when ``cp_ulysses=1``, else hybrid.
    Masks come from data (positions, segment ids, windows, spans), never from array indices.

    Args:
        query, key, value: ``[B, T, H, d]`` / ``[B, S, K, d]`` (``layout="BSHD"``; ``"BNSD"``
            swaps the middle axes; rank 3: one unbatched sequence, as in ``jax.nn``); equal dtypes.
            ``key``/``value`` may be other tokens of their own length ``S`` (cross attention) and
            the value head dim may differ (MLA).
        bias, mask: jax.nn's dense arguments, refused (quadratic under CP; a ``ValueError`` names
            the data-driven arguments to use).
        mesh: the ``("dp", "cp_colossal", "cp_ulysses", "tp")`` mesh (:func:`jax_cp.make_mesh`).
        is_causal: a causal mask (on the positions, not the array order).
        scale: the logits' scale (default ``d ** -0.5``); traced (under ``jit``/``grad``) it is
            multiplied into the query, so it takes a gradient (:func:`jax_cp.kernels.scaled_query`).
        layout: ``"BSHD"`` or ``"BNSD"``.
        positions, segment_ids: ``[S]`` or ``[B, S]`` ints: each token's global position and its
            document in the order given (negative segment ids: padding).
        local_window_size: ``w`` or ``(left, right)`` Python or NumPy ints, as jax.nn's: bounds
            inclusive, a query at position ``p`` sees keys at ``p - left`` to ``p + right``. A window
            ``W`` meaning ``|p_q - p_k| < W`` (Gemma, Hugging Face, Mistral) is ``(W - 1, W - 1)``,
            or ``(W - 1, 0)`` with ``is_causal``.
        kernel: ``"auto"`` or a ``jax_cp.kernels`` value or name (``jax_cp.describe_kernel``).
        kv_exchange: how K/V cross ``cp_colossal``: a ``jax_cp.exchanges`` value, its name or
            ``"auto"`` (the measured rule).
        block_q, block_kv: the blockwise kernel's tiles (``None``: ``jax_cp.kernels.auto_blocks``).
        logits_soft_cap: ``c`` caps the scaled logits to ``c * tanh(logits / c)`` before the mask
            (every kernel but cuDNN).
        sinks: ``[H]`` learned logits, one per query head, joining the softmax denominator once with
            no value (GPT-OSS); differentiable.
        return_max_logits: also return the per-head (``[H]``) largest logit that entered the
            softmax, over the whole mesh (``-inf`` if none; no gradient); blockwise and ``"xla"``.
        implementation: jax.nn's ``None``/``"xla"``/``"cudnn"`` (``kernel="auto"/"xla"/"cudnn"``).
        return_residual: also return each row's log-sum-exp (``[B, T, H]``; ``[B, H, T]`` for BNSD;
            the inputs' dtype; sinks included; ``-inf`` for a query that sees no key), differentiable.
        query_seq_lengths, key_value_seq_lengths: jax.nn's ``[B]`` lengths, counted as jax.nn
            counts them, by index in the arrays given (not by position): tokens from index
            ``length`` on are padding as queries (zero output) / as keys (never seen). For a
            reordered sequence (``load_balance``), pad with negative segment ids instead.
        kv_positions, kv_segment_ids: the keys' own (cross attention; ``arange(S)`` positions by
            default; segment ids on both sides or neither).
        span_ids, kv_span_ids: ``[B, S]`` bidirectional span ids (0: none; the keys' for cross
            attention): a causal mask also lets a token see the later tokens of its own span
            (within the window). Under a mask they cannot change (not causal, or a window whose
            right edge is 0) they are a ``ValueError``.

    Returns:
        ``out`` like ``query``; with ``return_max_logits``/``return_residual``:
        ``(out, [max_logits,] [residual])``. float64 inputs are computed in float64.

    Raises:
        ValueError: a shape, dtype, mask argument or kernel/exchange choice that cannot serve the
            call, naming the parameter and the fix.
    """
    return _call(query, key, value, bias, mask, mesh, layout, dict(
        is_causal=is_causal, scale=scale, local_window_size=local_window_size, kernel=kernel, kv_exchange=kv_exchange,
        block_q=block_q, block_kv=block_kv, logits_soft_cap=logits_soft_cap, record_max_logits=bool(return_max_logits),
        return_residual=bool(return_residual)), sinks, implementation,
        (positions, segment_ids, kv_positions, kv_segment_ids), (query_seq_lengths, key_value_seq_lengths),
        (span_ids, kv_span_ids))


def _call(query, key, value, bias, mask, mesh, layout, options: dict, sinks, implementation, given: tuple,
          lengths: tuple, spans: tuple):
    """``dot_product_attention``'s work: checks, the resolved spec, the placed metadata, the shard."""
    kernel = _check_jax_nn_arguments(bias, mask, implementation, options.pop("kernel"))
    dims, unbatched = mesh_dims(mesh), getattr(query, "ndim", None) == 3
    query, key, value = _check_qkv(query, key, value, layout)
    kernel = kernel_for_dtype(kernel, query.dtype, "kernel" if implementation is None else "implementation")
    query, options["scale"] = kernels.scaled_query(query, options["scale"])  # a traced scale: into the query
    (B, T, H, d), (S, K) = query.shape, key.shape[1:3]
    spec = _resolved_spec(mesh, query, K, S, (given[1], *lengths), spans[0], kernel=kernel,
                          use_sinks=sinks is not None, v_head_dim=value.shape[-1], **options)
    rep = spec.layout(dims).kv_expanded // K  # minimal repetition so t*u devices each hold whole kv heads
    meta, meta_specs = _placed_meta(mesh, dims, B, T, S, given, lengths, spans)
    key, value = (jnp.repeat(a, rep, axis=2) for a in (key, value)) if rep > 1 else (key, value)
    sinks = None if sinks is None else place(check_sinks(sinks, H), mesh, P(TP))
    out = _shard_attention(spec, mesh, [query, key, value, sinks, meta], meta_specs)
    return _as_given(out, layout, unbatched, query.dtype if spec.return_residual else None)


def _placed_meta(mesh, dims, batch: int, q_len: int, kv_len: int, given: tuple, lengths: tuple, spans: tuple):
    """Both lengths checked against the mesh; the placed metadata of queries and keys
    (``placed_metadata``'s two values) from the given positions/segment ids, jax.nn's lengths and
    the span ids."""
    check_seq_batch(batch, q_len, dims)
    check_seq_batch(batch, kv_len, dims, name="the key/value sequence length")
    pos, seg, kv_seg, kv_pos = _metadata(batch, q_len, kv_len, given, lengths)
    return placed_metadata(pos, seg, batch, q_len, mesh, kv_seg, kv_pos, spans)


def _metadata(batch: int, q_len: int, kv_len: int, given: tuple, lengths: tuple) -> tuple:
    """The checked ``(pos, seg, kv_seg, kv_pos)`` of queries and keys (``metadata_sides``) from the given
    positions/segment ids, with jax.nn's lengths as padding (``_length_padding``)."""
    sides = metadata_sides(*given, batch, q_len, kv_len)
    return _length_padding(*sides, *lengths, batch, q_len)


def visibility(
    batch, q_len, kv_len=None, *, is_causal=False, positions=None, segment_ids=None, local_window_size=None,
    query_seq_lengths=None, key_value_seq_lengths=None, kv_positions=None, kv_segment_ids=None, span_ids=None,
    kv_span_ids=None,
):
    """The boolean mask ``[B, T, S]`` that :func:`dot_product_attention` applies for this metadata.

    ``mask[b, t, s]``: query ``t`` of row ``b`` sees key ``s``, indices as given (the arrays'
    order, whatever it is). It is the dense mask a port's own attention would take, so a model can
    check its metadata against it: ``jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])``
    equals ``jax_cp.dot_product_attention(q, k, v, mesh=..., **metadata)`` on every query that
    sees a key (a query that sees none gets zeros from jax_cp, where jax.nn averages the values).
    Quadratic in the sequence: for tests and small inputs, not for the training step.

    Args:
        batch, q_len, kv_len: the shape ``[B, T, S]`` (``kv_len``: ``None`` means ``q_len``).
        is_causal, positions, segment_ids, local_window_size: as :func:`dot_product_attention`.
        query_seq_lengths, key_value_seq_lengths: as :func:`dot_product_attention` (by index).
        kv_positions, kv_segment_ids, span_ids, kv_span_ids: as :func:`dot_product_attention`
            (span ids are taken under any mask here, even where attention refuses them as changing
            nothing).

    Returns:
        ``mask [B, T, S]`` bool.

    Raises:
        ValueError: a size is not a positive int, or a metadata argument is invalid (as attention
            would refuse it).
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("batch", batch), ("q_len", q_len), ("kv_len", kv_len)):
        check_positive_int(name, n)
    pos, seg, kv_seg, kv_pos = _metadata(batch, q_len, kv_len, (positions, segment_ids, kv_positions, kv_segment_ids),
                                         (query_seq_lengths, key_value_seq_lengths))
    pos = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (batch, q_len)) if pos is None else pos
    meta = Meta(pos, seg, kv_seg, kv_pos, *span_sides(span_ids, kv_span_ids, batch, q_len, kv_len))
    return visible(meta.pos, meta.keys_pos, meta.seg, meta.keys_seg, is_causal=bool(is_causal),
                   window=normalize_window(local_window_size), q_span_BT=meta.span, kv_span_BS=meta.keys_span)


def _resolved_spec(mesh, query, num_kv_heads: int, kv_len: int, segments: tuple, span_ids,
                   **options) -> AttentionSpec:
    """The call's ``AttentionSpec`` (one head chunk, no fused exchange), ``"auto"`` resolved for ``mesh``
    (the memory rule sizes the K/V of ``kv_len`` tokens; the kernel is chosen for the query's dtype, and
    for segment ids if any of ``segments`` (segment ids, jax.nn's lengths) is given)."""
    B, _, H, d = query.shape
    spec = AttentionSpec(num_heads=H, num_kv_heads=num_kv_heads, head_dim=d, overlap_chunks=1, fused_qkv_chunks=0,
                         **options)
    return spec.resolve(mesh, batch=B, seq_len=kv_len, itemsize=query.dtype.itemsize, dtype=query.dtype,
                        has_segments=any(a is not None for a in segments), has_spans=span_ids is not None)[0]


def _length_padding(pos, seg, kv_seg, kv_pos, q_lengths, kv_lengths, batch: int, q_len: int):
    """``metadata_sides``' ``(pos, seg, kv_seg, kv_pos)`` with jax.nn's ``*_seq_lengths`` as negative
    segment ids (padding) of the queries / keys whose index in the given arrays is at or beyond
    their row's length (jax.nn's rule: by index, whatever the positions say)."""
    if q_lengths is None and kv_lengths is None:
        return pos, seg, kv_seg, kv_pos
    kv_len = q_len if kv_pos is None else kv_pos.shape[1]
    seg = jnp.zeros((batch, q_len), jnp.int32) if seg is None else seg
    if kv_seg is None:  # the keys' documents are the queries' (self-attention), or one (cross attention)
        kv_seg = seg if kv_len == q_len else jnp.zeros((batch, kv_len), jnp.int32)
    sides = []
    for name, lengths, s in (("query_seq_lengths", q_lengths, seg), ("key_value_seq_lengths", kv_lengths, kv_seg)):
        if lengths is None:
            sides.append(s)
            continue
        lengths = jnp.asarray(lengths)
        if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"{name} (shape={lengths.shape}, dtype={lengths.dtype}) must be an integer array of "
                             f"shape (batch,)=({batch},): each row's unpadded length.")
        index = jnp.arange(s.shape[1], dtype=jnp.int32)[None]
        sides.append(jnp.where(index < lengths.astype(jnp.int32)[:, None], s, -1))
    return pos, sides[0], sides[1], kv_pos


def _as_given(outs, layout: str, unbatched: bool, residual_dtype=None):
    """The caller's layout for the output and the residual (``[B, T, H]``; ``max_logits [H]`` as it
    is), without the batch axis for rank-3 inputs; one array when nothing else was asked for. The
    residual (last) in ``residual_dtype`` when given: jax.nn's, the inputs' dtype (a cotangent of
    that dtype flows back through the cast)."""
    if residual_dtype is not None:
        outs = (*outs[:-1], outs[-1].astype(residual_dtype))
    out, *extra = outs
    if layout == "BNSD":
        out, extra = jnp.swapaxes(out, 1, 2), [jnp.swapaxes(x, 1, 2) if x.ndim == 3 else x for x in extra]
    if unbatched:
        out, extra = out[0], [x[0] if x.ndim == 3 else x for x in extra]
    return (out, *extra) if extra else out


def _shard_attention(spec, mesh, args, meta_specs):
    """The per-shard body on placed ``q, k, v [B, S, H, d]``, sinks and the ``Meta`` (``meta_specs``:
    its in_specs): ``(out, [max_logits])``."""
    args = [place(a, mesh, X_SPEC) for a in args[:3]] + args[3:]
    extra = ((P(TP),) if spec.record_max_logits else ()) + ((P(DP, CP, TP),) if spec.return_residual else ())
    out_specs = (X_SPEC, *extra) if extra else X_SPEC
    fn = partial(_shard_fn, spec=spec)
    out = shard_call(fn, mesh, (X_SPEC,) * 3 + (P(TP), meta_specs), out_specs, args)
    return out if extra else (out,)
