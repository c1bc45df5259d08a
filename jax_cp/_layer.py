"""One context-parallel attention layer as a pure function of its parameters.

Shared by the NNX and Linen modules. Per device, inside one ``jax.shard_map``:
x -> per head chunk: q/k/v projections (tp-local weights) with QK-norm and RoPE
on the local tokens, each followed by its all-to-all -> colossal K/V exchange +
local kernel -> inverse all-to-all + output projection -> psum over tp.
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cp import kernels as _kernels
from jax_cp._attention import (
    KV_EXCHANGES, attend_local_kv, attend_shard, check_seq_batch, placed_metadata, seq_chunk,
)
from jax_cp._checks import check_positive_fields
from jax_cp._masks import normalize_window
from jax_cp._mesh import AXES, COLOSSAL, CP, DP, TP, ULYSSES, MeshDims, lcm, mesh_dims, place
from jax_cp._projection import exchange_heads, heads_to_model, project_parts, tie_cotangents

X_SPEC = P(DP, CP, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerConfig:
    """Shape and behaviour of one attention layer (mesh-independent), validated on creation."""

    in_features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_causal: bool = False
    use_qk_norm: bool = False
    rope_theta: float | None = None
    use_bias: bool = False
    overlap_chunks: int = 1
    kernel: str = "auto"
    kv_exchange: str = "all_gather"
    fused_qkv_chunks: int = 0

    def __post_init__(self):
        check_positive_fields(self, ("in_features", "num_heads", "num_kv_heads", "head_dim", "overlap_chunks"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs kv heads dividing the query heads."
            )
        if self.rope_theta is not None and (self.rope_theta <= 0 or self.head_dim % 2):
            raise ValueError(f"rope_theta={self.rope_theta} needs rope_theta > 0 and an even head_dim (got {self.head_dim}).")
        _kernels.check_kernel(self.kernel)
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange={self.kv_exchange!r} must be one of {KV_EXCHANGES}.")
        f = self.fused_qkv_chunks
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= self.overlap_chunks:
            raise ValueError(f"fused_qkv_chunks={f!r} must be an integer from 0 to "
                             f"overlap_chunks={self.overlap_chunks} (how many leading head chunks send "
                             "Q, K and V in one all-to-all).")
        if f and self.kv_exchange == "all_to_all":
            raise ValueError(
                f"fused_qkv_chunks={f} cannot be combined with kv_exchange='all_to_all': K and V then take "
                "their own all-to-all over both CP axes. Use kv_exchange='all_gather' or 'ring', or "
                "fused_qkv_chunks=0."
            )


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a layer's heads land on a mesh: kv repetition and whether kv weights split over tp."""

    dims: MeshDims
    kv_expanded: int  # kv heads after minimal repetition, a multiple of t*u*chunks
    kv_sharded: bool  # kv weights split over tp (else replicated, sliced per tp rank)


def layout_for(cfg: LayerConfig, dims: MeshDims) -> Layout:
    shards = dims.t * dims.u * cfg.overlap_chunks
    if cfg.num_heads % (dims.t * dims.u):
        raise ValueError(
            f"num_heads={cfg.num_heads} is not divisible by tp*cp_ulysses={dims.t}*{dims.u}={dims.t * dims.u}; "
            "choose a head count divisible by it or a smaller tp/cp_ulysses."
        )
    if cfg.num_heads % shards:
        raise ValueError(
            f"overlap_chunks={cfg.overlap_chunks} does not divide the {cfg.num_heads // (dims.t * dims.u)} query heads "
            f"per device (num_heads={cfg.num_heads}, tp*cp_ulysses={dims.t * dims.u}); choose a divisor of it."
        )
    return Layout(dims, lcm(cfg.num_kv_heads, shards), cfg.num_kv_heads % dims.t == 0)


def param_specs(cfg: LayerConfig, layout: Layout) -> dict[str, P]:
    kv = P(None, TP, None) if layout.kv_sharded else P(None, None, None)
    specs = {"q_kernel": P(None, TP, None), "k_kernel": kv, "v_kernel": kv, "o_kernel": P(TP, None, None)}
    if cfg.use_bias:
        kvb = P(TP, None) if layout.kv_sharded else P(None, None)
        specs |= {"q_bias": P(TP, None), "k_bias": kvb, "v_bias": kvb, "o_bias": P(None)}
    if cfg.use_qk_norm:
        specs |= {"q_norm": P(None), "k_norm": P(None)}
    return specs


def param_shapes(cfg: LayerConfig) -> dict[str, tuple[int, ...]]:
    D, H, K, d = cfg.in_features, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"q_kernel": (D, H, d), "k_kernel": (D, K, d), "v_kernel": (D, K, d), "o_kernel": (H, d, D)}
    if cfg.use_bias:
        shapes |= {"q_bias": (H, d), "k_bias": (K, d), "v_bias": (K, d), "o_bias": (D,)}
    if cfg.use_qk_norm:
        shapes |= {"q_norm": (d,), "k_norm": (d,)}
    return shapes


def init_param(name: str, shape, key, dtype, kernel_init):
    """Kernels are initialised as 2-D ``[fan_in, fan_out]`` matrices, then reshaped."""
    if name.endswith("_kernel"):
        fan_in = shape[0] if name != "o_kernel" else shape[0] * shape[1]
        flat = kernel_init(key, (fan_in, math.prod(shape) // fan_in), dtype)
        return flat.reshape(shape)
    if name.endswith("_norm"):
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


def _local_kv(w, layout: Layout, axis: int):
    """Repeat this tp rank's kv heads (axis ``axis``) to the expanded count, minimal."""
    dims, K_exp = layout.dims, layout.kv_expanded
    K = w.shape[axis] * (dims.t if layout.kv_sharded else 1)
    w = jnp.repeat(w, K_exp // K, axis=axis)
    if not layout.kv_sharded and dims.t > 1:
        per = K_exp // dims.t
        w = lax.dynamic_slice_in_dim(w, lax.axis_index(TP) * per, per, axis=axis)
    return w


def _varying(a):
    """Marks ``a`` as varying over every mesh axis, so the custom_vjp blocks see
    one type and the transpose (a psum) of that cast sums the weight gradients."""
    aval = jax.typeof(a)
    vma = aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying  # renamed across JAX versions
    missing = tuple(ax for ax in AXES if ax not in vma)
    return lax.pcast(a, missing, to="varying") if missing else a


def _chunks(a, n, axis):
    return list(jnp.split(a, n, axis=axis)) if n > 1 else [a]


def _layer_shard(params, x_BSD, pos_BS, seg_BS=None, *, cfg: LayerConfig, layout: Layout, dtype, window, scale):
    n = cfg.overlap_chunks
    x = _varying(x_BSD.astype(dtype))
    w = {k: _varying(v) for k, v in params.items()}  # parameter dtype; cast to dtype inside each block
    wq, wo = w["q_kernel"], w["o_kernel"]
    wk, wv = _local_kv(w["k_kernel"], layout, 1), _local_kv(w["v_kernel"], layout, 1)
    bq = bk = bv = None
    if cfg.use_bias:
        bq, bk, bv = w["q_bias"], _local_kv(w["k_bias"], layout, 0), _local_kv(w["v_bias"], layout, 0)
    norms = (w.get("q_norm"), w.get("k_norm"), None)
    pos_local = seq_chunk(pos_BS, (COLOSSAL, ULYSSES))  # this device's tokens, for RoPE before the exchange

    def project(ws, bs, idx):  # parts idx of (q, k, v) on the local tokens, QK-norm and RoPE (q, k) included
        parts = (tuple(t[j] for j in idx) for t in (ws, bs, norms))
        return project_parts(x, *parts, pos_local, dtype, cfg.rope_theta, tuple(j < 2 for j in idx))

    # One pipeline stage per head chunk: chunk i's collectives and attention are
    # independent of chunk i+1's matmuls, so XLA can hide one under the other.
    wqs = _chunks(wq, n, 1)
    wkvs, wos = list(zip(_chunks(wk, n, 1), _chunks(wv, n, 1))), _chunks(wo, n, 0)
    bss = list(zip(*(_chunks(b, n, 0) if b is not None else [None] * n for b in (bq, bk, bv))))
    kw = dict(kv_exchange=cfg.kv_exchange, kernel=cfg.kernel, is_causal=cfg.is_causal,
              local_window_size=window, scale=scale)
    # Hybrid layouts: chunk i's projected Q (or QKV) is tied to chunk i+1's Q weight, so in the
    # backward chunk i's projection gradients wait for chunk i+1's dWq, and XLA hides chunk i's
    # Q-gradient all-to-all under that matmul (else it leaves it empty: v5e (2,2,4) 0.92 -> 1.00).
    # Not with the ring (measured worse: v5e (2,4,2) 4 chunks 1.00 -> 0.77) nor on pure Ulysses (mixed:
    # v5e 4 chunks 0.81 -> 0.94, v5p 2 chunks 1.00 -> 0.88); TPU schedules in benchmarks/RESULTS.md.
    tie = layout.dims.c > 1 and layout.dims.u > 1 and cfg.kv_exchange != "ring"
    y = 0
    for i in range(n):
        ws, bs = (wqs[i], *wkvs[i]), bss[i]
        fused = i < cfg.fused_qkv_chunks  # Q, K and V cross cp_ulysses in one all-to-all
        parts = project(ws, bs, (0, 1, 2) if fused else (0,))
        if tie and i + 1 < n:
            parts, wqs[i + 1] = tie_cotangents(parts, wqs[i + 1])
        if fused:  # then the colossal exchange
            q, k, v = exchange_heads(parts, ULYSSES)
            o = attend_shard(q, k, v, pos_BS, seg_BS, **kw)
        else:  # Q in its own all-to-all, issued before the K/V projections and their exchange(s)
            (q,) = exchange_heads(parts, ULYSSES)
            o = attend_local_kv(q, *project(ws, bs, (1, 2)), pos_BS, seg_BS, **kw)
        y = y + lax.optimization_barrier(heads_to_model(o, wos[i], ULYSSES))
    y = lax.psum(y, TP)
    if cfg.use_bias:
        y = y + params["o_bias"][None, None]  # once, after the psum; in the parameter dtype
    return y.astype(dtype)


def layer_forward(params: dict, x_BSD, *, mesh, cfg: LayerConfig, dtype=None, positions=None,
                  segment_ids=None, local_window_size=None, scale=None):
    """Applies the layer to a global ``x [B, S, D]``; returns ``y [B, S, D]`` sharded like x."""
    dims = mesh_dims(mesh)
    layout = layout_for(cfg, dims)
    if getattr(x_BSD, "ndim", None) != 3 or x_BSD.shape[-1] != cfg.in_features:
        raise ValueError(f"x.shape={getattr(x_BSD, 'shape', None)} must be (batch, seq_len, in_features={cfg.in_features}).")
    B, S, _ = x_BSD.shape
    check_seq_batch(B, S, dims)
    window = normalize_window(local_window_size)
    meta, meta_specs = placed_metadata(positions, segment_ids, B, S, mesh)
    dtype = jnp.dtype(x_BSD.dtype if dtype is None else dtype)
    specs = param_specs(cfg, layout)
    params = {k: place(params[k], mesh, specs[k]) for k in specs}
    args = [params, place(x_BSD, mesh, X_SPEC)] + meta
    in_specs = [specs, X_SPEC] + meta_specs
    fn = partial(_layer_shard, cfg=cfg, layout=layout, dtype=dtype, window=window, scale=scale)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=X_SPEC)(*args)
