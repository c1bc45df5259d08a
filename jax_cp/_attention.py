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

from jax_cp._blockwise import check_sinks
from jax_cp._defaults import AUTO
from jax_cp._body import GivenQKV, attention_shard, check_dtype, placed_metadata, shard_call
from jax_cp._mesh import CP, DP, TP, mesh_dims, place
from jax_cp._spec import AttentionSpec, check_seq_batch

__all__ = ["dot_product_attention", "LAYOUTS"]

LAYOUTS = ("BSHD", "BNSD")
X_SPEC = P(DP, CP, TP, None)  # [B, S, H, d]


def _shard_fn(q, k, v, sinks, pos_BS, seg_BS=None, *, spec):
    return attention_shard(GivenQKV(q, k, v, sinks), pos_BS, seg_BS, spec=spec)


def _check_qkv(query, key, value, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}.")
    for name, a in (("query", query), ("key", key), ("value", value)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(f"{name}.shape={getattr(a, 'shape', None)} must have rank 4 ({layout}).")
    if layout == "BNSD":
        query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query, key, value))
    B, S, H, d = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key.shape={key.shape} and value.shape={value.shape} must match.")
    if key.shape[0] != B or key.shape[1] != S or key.shape[3] != d:
        raise ValueError(
            f"key.shape={key.shape} does not fit query.shape={query.shape}: batch, sequence and head dim "
            f"must match (layout={layout!r})."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} must be equal.")
    check_dtype("query", query.dtype)
    return query, key, value


def dot_product_attention(
    query, key, value, *, mesh, is_causal=False, scale=None, layout="BSHD",
    positions=None, segment_ids=None, local_window_size=None,
    kernel="auto", kv_exchange=AUTO, block_q=None, block_kv=None, logits_soft_cap=None, sinks=None,
    return_max_logits=False,
):
    """Context-parallel counterpart of ``jax.nn.dot_product_attention``.

    Global arrays in, a global array out (sharded over the mesh like the query
    after resharding: batch on ``dp``, sequence on ``(cp_colossal, cp_ulysses)``,
    heads on ``tp``). The strategy follows the mesh: Ulysses when
    ``cp_colossal=1``, Colossal when ``cp_ulysses=1``, hybrid when both are > 1.
    ``layout`` is ``"BSHD"`` or ``"BNSD"``. ``positions`` and ``segment_ids``
    (``[S]`` or ``[B, S]`` ints) give the global position and document of each
    token in the order given; masks come from them. ``kv_exchange`` moves K/V
    over ``cp_colossal``: a ``jax_cp.exchanges`` value, its name (see
    ``jax_cp.exchanges.NAMES``) or ``"auto"`` (the measured rule for the chip and layout).
    ``block_q``/``block_kv`` size the blockwise kernel's tiles on each device (``None``: from the
    local batch, heads and platform, ``jax_cp.kernels.auto_blocks``). ``logits_soft_cap=c`` caps
    the scaled logits to ``c * tanh(logits / c)`` before the mask (Gemma 2), on every kernel but cuDNN
    (``"auto"`` then runs blockwise on GPU). ``sinks [H]`` (float) give each query head a learned
    logit joining its softmax denominator once, with no value (GPT-OSS); gradients flow to it.
    ``return_max_logits=True`` returns ``(out, max_logits)``: per query head (``[H]`` float32) the
    largest logit that entered the softmax over every visible pair, reduced over the whole mesh
    (``-inf`` if none; no gradient), for QK-clip / MuonClip; blockwise and ``"xla"`` kernels only.
    """
    dims = mesh_dims(mesh)
    query, key, value = _check_qkv(query, key, value, layout)
    B, S, H, d = query.shape
    K = key.shape[2]
    spec = AttentionSpec(num_heads=H, num_kv_heads=K, head_dim=d, is_causal=is_causal, scale=scale,
                         local_window_size=local_window_size, kernel=kernel, kv_exchange=kv_exchange,
                         overlap_chunks=1, fused_qkv_chunks=0, block_q=block_q, block_kv=block_kv,
                         logits_soft_cap=logits_soft_cap, record_max_logits=bool(return_max_logits))
    spec, _ = spec.resolve(mesh, batch=B, seq_len=S, itemsize=query.dtype.itemsize)
    rep = spec.layout(dims).kv_expanded // K  # minimal repetition so t*u devices each hold whole kv heads
    check_seq_batch(B, S, dims)
    meta, meta_specs = placed_metadata(positions, segment_ids, B, S, mesh)
    if rep > 1:
        key, value = (jnp.repeat(a, rep, axis=2) for a in (key, value))
    sinks = None if sinks is None else place(check_sinks(sinks, H), mesh, P(TP))
    args = [place(a, mesh, X_SPEC) for a in (query, key, value)] + [sinks] + meta
    in_specs = [X_SPEC] * 3 + [P(TP)] + meta_specs
    out_specs = (X_SPEC, P(TP)) if spec.record_max_logits else X_SPEC
    out = shard_call(partial(_shard_fn, spec=spec), mesh, tuple(in_specs), out_specs, args)
    out, *max_logits = out if spec.record_max_logits else (out,)
    out = jnp.swapaxes(out, 1, 2) if layout == "BNSD" else out
    return (out, *max_logits) if max_logits else out
