"""Context-parallel dot-product attention over the four-axis mesh.

Per device (inside one ``jax.shard_map``), with c=|cp_colossal|, u=|cp_ulysses|, t=|tp|:

    q, k, v [B, S/(c*u), H/t, d]  --all-to-all over cp_ulysses-->  [B, S/c, H/(t*u), d]
    k, v  --all-gather (or ring) over cp_colossal-->  [B, S, K/(t*u), d]
    (kv_exchange="all_to_all": k, v reach [B, S, K/(t*u), d] in one all-to-all over both CP axes)
    local kernel on global positions   -->  o [B, S/c, H/(t*u), d]
    o  --inverse all-to-all-->  [B, S/(c*u), H/t, d]

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cp import kernels as _kernels
from jax_cp._collectives import gather_seq, heads_to_seq, spread_kv
from jax_cp._projection import exchange_heads
from jax_cp._masks import normalize_window
from jax_cp._mesh import COLOSSAL, CP, DP, TP, ULYSSES, MeshDims, lcm, mesh_dims, place

__all__ = [
    "dot_product_attention", "attend_shard", "attend_gathered", "attend_local_kv", "placed_metadata", "seq_chunk", "kv_head_replication",
    "LAYOUTS", "KV_EXCHANGES",
]

LAYOUTS = ("BSHD", "BNSD")
KV_EXCHANGES = ("all_gather", "all_to_all", "ring")

X_SPEC = P(DP, CP, TP, None)  # [B, S, H, d]
# [B, S] positions / segment ids: replicated over the sequence axes. Each device slices
# the parts it needs, so the layer runs no collective for metadata (ints, B*S*4 bytes,
# gathered once outside the layer and shared by every layer of a model).
META_SPEC = P(DP, None)


def kv_head_replication(num_heads: int, num_kv_heads: int, dims: MeshDims) -> int:
    """How many times each kv head is repeated so that ``t*u`` devices each hold whole kv heads.

    1 when ``num_kv_heads`` is a multiple of ``t*u``; otherwise the minimal
    factor ``lcm(K, t*u) / K`` (MQA under Ulysses: ``t*u``).
    """
    # H is a multiple of both K and t*u (checked first), so of their lcm too.
    return lcm(num_kv_heads, dims.t * dims.u) // num_kv_heads


def check_heads(num_heads: int, num_kv_heads: int, dims: MeshDims) -> int:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs kv heads dividing the query heads."
        )
    if num_heads % (dims.t * dims.u):
        raise ValueError(
            f"num_heads={num_heads} is not divisible by tp*cp_ulysses={dims.t}*{dims.u}={dims.t * dims.u}; "
            "choose a head count divisible by it or a smaller tp/cp_ulysses."
        )
    return kv_head_replication(num_heads, num_kv_heads, dims)


def check_seq_batch(batch: int, seq_len: int, dims: MeshDims) -> None:
    if seq_len % dims.cp:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by cp_colossal*cp_ulysses={dims.c}*{dims.u}={dims.cp}; "
            "pad the sequence to a multiple of it."
        )
    if batch % dims.dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dims.dp}; use a batch that is a multiple of dp.")


def check_metadata(name: str, value, batch: int, seq_len: int):
    """``[S]`` or ``[B, S]`` integer array -> ``[B, S]`` int32 (``None`` passes)."""
    if value is None:
        return None
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={value.dtype} must be an integer dtype (e.g. int32).")
    if value.shape not in ((seq_len,), (batch, seq_len)):
        raise ValueError(f"{name}.shape={value.shape} must be (seq_len,)=({seq_len},) or (batch, seq_len)=({batch}, {seq_len}).")
    return jnp.broadcast_to(value.astype(jnp.int32), (batch, seq_len))


def placed_metadata(positions, segment_ids, batch: int, seq_len: int, mesh):
    """Checked, placed ``[B, S]`` positions (``arange`` when None) and segment ids (if given).

    Returns the shard_map arguments and their in_specs, so every entry point
    hands its per-shard function ``pos_BS`` and, only when given, ``seg_BS``.
    """
    positions = check_metadata("positions", positions, batch, seq_len)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    segment_ids = check_metadata("segment_ids", segment_ids, batch, seq_len)
    present = [place(a, mesh, META_SPEC) for a in (positions, segment_ids) if a is not None]
    # Opaque to constant folding: folded into the kernel's per-block bounds, the default arange
    # becomes a reduce over an iota that libtpu 0.0.52 aborts on while splitting it over a v5p
    # chip's two TensorCores (MegacoreTransformWindow check failure).
    return list(lax.optimization_barrier(tuple(present))), [META_SPEC] * len(present)


def seq_chunk(a_BS, axis_names: tuple[str, ...]):
    """This device's contiguous piece of a full-sequence array, for the sequence split over ``axis_names``."""
    if a_BS is None:
        return None
    n, idx = 1, 0
    for name in axis_names:  # row-major over the named axes, like P(..., (cp_colossal, cp_ulysses))
        size = lax.axis_size(name)
        n, idx = n * size, idx * size + lax.axis_index(name)
    if n == 1:
        return a_BS
    T = a_BS.shape[1] // n
    return lax.dynamic_slice_in_dim(a_BS, idx * T, T, axis=1)


def attend_shard(q_BSHd, k_BSKd, v_BSKd, pos_all, seg_all, *, kv_exchange="all_gather", kernel="auto", **mask):
    """Colossal K/V exchange and the local kernel, after the Ulysses all-to-all.

    Takes the device's contiguous colossal chunk ``[B, S/c, ...]`` of heads and
    the full-sequence metadata ``[B, S]``; returns ``o [B, S/c, H_local, d]``.
    """
    if kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange={kv_exchange!r} must be one of {KV_EXCHANGES}.")
    if kv_exchange == "ring":
        if _kernels.check_kernel(kernel) not in ("auto", "blockwise"):
            raise ValueError(f"kernel={kernel!r} cannot run kv_exchange='ring', whose steps merge the blockwise "
                             "kernel's log-sum-exps; use kernel='auto' or 'blockwise' (or kv_exchange='all_gather').")
        from jax_cp._ring import ring_attention  # the ring builds on the kernels; imported where used

        pos, seg = seq_chunk(pos_all, (COLOSSAL,)), seq_chunk(seg_all, (COLOSSAL,))
        return ring_attention(q_BSHd, k_BSKd, v_BSKd, pos, seg, axis_name=COLOSSAL, **mask)
    # K and V travel in one collective: fewer, larger exchanges leave more compute to hide
    # each under (TPU runs one all-to-all at a time).
    kv = jnp.stack([k_BSKd, v_BSKd], axis=2)
    kv_all = gather_seq(kv, COLOSSAL) if kv_exchange == "all_gather" else spread_kv(kv, COLOSSAL)
    return attend_gathered(q_BSHd, kv_all, pos_all, seg_all, kernel=kernel, **mask)


def attend_gathered(q_BSHd, kv_BS2Kd, pos_all, seg_all, *, kernel="auto", **mask):
    """The local kernel on the colossal chunk of queries and every token's K and V (stacked on axis 2)."""
    pos, seg = seq_chunk(pos_all, (COLOSSAL,)), seq_chunk(seg_all, (COLOSSAL,))
    return _kernels.local_attention(
        q_BSHd, kv_BS2Kd[:, :, 0], kv_BS2Kd[:, :, 1], kernel=kernel, q_positions=pos, kv_positions=pos_all,
        q_segment_ids=seg, kv_segment_ids=seg_all, **mask,
    )


def attend_local_kv(q_BSHd, k_BTKd, v_BTKd, pos_all, seg_all, *, kv_exchange="all_gather", **kw):
    """Queries after the Ulysses all-to-all; K and V still on the device's own tokens ``[B, S/(c*u), ...]``.

    ``kv_exchange="all_to_all"`` (with a ``cp_colossal`` axis): K/V reach every token in one
    all-to-all over both CP axes. Otherwise K and V cross ``cp_ulysses`` in one all-to-all,
    then the colossal exchange (``attend_shard``).
    """
    if kv_exchange == "all_to_all" and lax.axis_size(COLOSSAL) > 1:
        kv_all = spread_kv(jnp.stack([k_BTKd, v_BTKd], axis=2), COLOSSAL, ULYSSES)
        return attend_gathered(q_BSHd, kv_all, pos_all, seg_all, **kw)
    k, v = exchange_heads((k_BTKd, v_BTKd), ULYSSES)
    return attend_shard(q_BSHd, k, v, pos_all, seg_all, kv_exchange=kv_exchange, **kw)


def _shard_fn(q, k, v, pos_all, seg_all=None, **kw):
    (q,) = exchange_heads((q,), ULYSSES)
    return heads_to_seq(attend_local_kv(q, k, v, pos_all, seg_all, **kw), ULYSSES)


def dot_product_attention(
    query, key, value, *, mesh, is_causal=False, scale=None, layout="BSHD",
    positions=None, segment_ids=None, local_window_size=None,
    kernel="auto", kv_exchange="all_gather",
):
    """Context-parallel counterpart of ``jax.nn.dot_product_attention``.

    Global arrays in, a global array out (sharded over the mesh like the query
    after resharding: batch on ``dp``, sequence on ``(cp_colossal, cp_ulysses)``,
    heads on ``tp``). The strategy follows the mesh: Ulysses when
    ``cp_colossal=1``, Colossal all-gather when ``cp_ulysses=1``, hybrid when
    both are > 1. ``layout`` is ``"BSHD"`` or ``"BNSD"``. ``positions`` and
    ``segment_ids`` (``[S]`` or ``[B, S]`` ints) give the global position and
    document of each token in the order given; masks come from them.
    ``kv_exchange`` moves K/V over ``cp_colossal``: ``"all_gather"``,
    ``"all_to_all"`` (with the Ulysses exchange, one all-to-all over both CP
    axes; asynchronous on every TPU generation) or ``"ring"`` (O(S/c) memory).
    """
    dims = mesh_dims(mesh)
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
    K = key.shape[2]
    rep = check_heads(H, K, dims)
    check_seq_batch(B, S, dims)
    if kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange={kv_exchange!r} must be one of {KV_EXCHANGES}.")
    _kernels.check_kernel(kernel)
    window = normalize_window(local_window_size)
    meta, meta_specs = placed_metadata(positions, segment_ids, B, S, mesh)

    if rep > 1:
        key, value = (jnp.repeat(a, rep, axis=2) for a in (key, value))
    args = [place(a, mesh, X_SPEC) for a in (query, key, value)] + meta
    in_specs = [X_SPEC] * 3 + meta_specs
    fn = partial(_shard_fn, is_causal=is_causal, scale=scale, local_window_size=window,
                 kernel=kernel, kv_exchange=kv_exchange)
    out = jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=X_SPEC)(*args)
    return jnp.swapaxes(out, 1, 2) if layout == "BNSD" else out
