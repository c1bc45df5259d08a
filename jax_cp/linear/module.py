"""``GatedDeltaNet``: the Qwen3-Next gated DeltaNet layer (Flax NNX) on the context-parallel mesh, its
single-device reference, and its recurrent cache for prefill and decode.

One layer: ``x`` -> q, k (``num_k_heads`` x ``head_k_dim``), v, z (``num_v_heads`` x ``head_v_dim``),
b, a (``num_v_heads``) -> a depthwise causal convolution of width ``conv_width`` with silu over the
q, k, v channels -> L2-normalised q and k, each key head repeated for its value heads -> the gated
delta rule with ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)`` -> the gated
RMSNorm ``rmsnorm(o) * silu(z)`` -> the output projection. Heads split over ``tp``; the sequence over
the CP axes as in ``CPAttention`` (``jax_cp.linear.causal_conv1d`` and ``gated_delta_rule`` carry the
halo and the state across devices, in document order from positions and segment ids).
Letters: B batch, S sequence, T new tokens, D model width, E output width, N key heads, H value heads,
K key head dim, V value head dim, W conv width, C conv channels.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_cp._checks import check_positive_fields
from jax_cp._decode import _check_lengths
from jax_cp._mesh import CP, DP, TP, MeshDims, gather, is_explicit, mesh_dims, place
from jax_cp._posenc import rms_norm
from jax_cp.linear import reference
from jax_cp.linear._args import refuse_spans
from jax_cp.linear._conv import causal_conv1d, conv_step
from jax_cp.linear._cp import pieces_for
from jax_cp.linear._gated_delta import gated_delta_rule, gated_delta_step

__all__ = ["CACHE_FIELDS", "CACHE_SPECS", "GatedDeltaNet", "GatedDeltaNetSpec", "gated_deltanet",
           "gated_deltanet_reference", "init_param"]

CACHE_SPECS = {"conv_state": P(DP, None, TP), "recurrent_state": P(DP, TP, None, None), "cache_index": P(DP)}
CACHE_FIELDS = tuple(CACHE_SPECS)  # the cache of one layer: where each part lives (heads over tp, rows over dp)
X_BSD, HEADS, GATES, CHANNELS = P(DP, CP, None), P(DP, CP, TP, None), P(DP, CP, TP), P(DP, CP, TP)
X_DECODE, HEADS_DECODE, GATES_DECODE = P(DP, None, None), P(DP, None, TP, None), P(DP, None, TP)
F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec:
    """The shapes of one gated DeltaNet layer; validated on creation.

    Attributes:
        in_features: the model width ``D``.
        num_k_heads: query and key heads ``N``.
        head_k_dim: query and key head dim ``K``.
        num_v_heads: value heads ``H``, the recurrence's heads: a multiple of ``num_k_heads`` (each key
            head serves ``H / N`` of them); ``None``: ``num_k_heads``.
        head_v_dim: value head dim ``V`` (``None``: ``head_k_dim``).
        out_features: the output width ``E`` (``None``: ``in_features``).
        conv_width: the causal convolution's width ``W`` (Qwen3-Next: 4).
        norm_eps: the gated RMSNorm's epsilon.
        chunk_size: the chunk length of the chunked delta rule.
        max_pieces: the state-passing slots per ``cp_colossal`` rank (``jax_cp.linear.gated_delta_rule``'s
            ``max_pieces``, at most ``S / cp_colossal`` used): the runs of a rank that continue a document
            from another rank or are continued on one. ``None``: the library's default, enough for the
            natural and dual-chunk orders; a dispatch plan needs up to twice its chunks per rank, plus one.
    """

    in_features: int
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int | None = None
    head_v_dim: int | None = None
    out_features: int | None = None
    conv_width: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    max_pieces: int | None = None

    def __post_init__(self):
        for name, default in (("num_v_heads", self.num_k_heads), ("head_v_dim", self.head_k_dim),
                              ("out_features", self.in_features)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        check_positive_fields(self, ("in_features", "num_k_heads", "head_k_dim", "num_v_heads", "head_v_dim",
                                     "out_features", "conv_width", "chunk_size"))
        if self.max_pieces is not None:
            check_positive_fields(self, ("max_pieces",))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} is not a multiple of num_k_heads={self.num_k_heads}; "
                             "each key head serves num_v_heads // num_k_heads value heads: choose num_v_heads = "
                             f"m * {self.num_k_heads}.")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be a number > 0 (e.g. 1e-6).")

    @property
    def scale(self) -> float:
        """The query scale of the delta rule: ``head_k_dim ** -0.5``."""
        return self.head_k_dim ** -0.5

    @property
    def channels(self) -> int:
        """``C``: the convolution's channels, q, k and v together."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the layer's parameters (names as Hugging Face's ``Qwen3NextGatedDeltaNet``'s
        where one exists; its fused ``in_proj_qkvz`` and ``in_proj_ba`` are kept apart here, by head)."""
        D, E, N, H, K, V, W = (self.in_features, self.out_features, self.num_k_heads, self.num_v_heads,
                               self.head_k_dim, self.head_v_dim, self.conv_width)
        return {"q_kernel": (D, N, K), "k_kernel": (D, N, K), "v_kernel": (D, H, V), "z_kernel": (D, H, V),
                "b_kernel": (D, H), "a_kernel": (D, H), "q_conv": (W, N, K), "k_conv": (W, N, K),
                "v_conv": (W, H, V), "dt_bias": (H,), "A_log": (H,), "norm": (V,), "o_kernel": (H, V, E)}

    def param_specs(self) -> dict[str, P]:
        """Each parameter's compute layout: split over ``tp`` by heads (the output kernel by rows), the
        norm's scale replicated."""
        specs = {name: P(None, TP, None) if len(shape) == 3 else P(None, TP) if len(shape) == 2 else P(TP)
                 for name, shape in self.param_shapes().items()}
        return specs | {"o_kernel": P(TP, None, None), "norm": P(None)}

    def check_mesh(self, mesh) -> MeshDims:
        """The mesh's sizes; a ``ValueError`` when ``tp`` does not divide the key heads."""
        dims = mesh_dims(mesh)
        if self.num_k_heads % dims.t:
            raise ValueError(f"num_k_heads={self.num_k_heads} is not divisible by tp={dims.t}; the layer splits its "
                             f"heads over tp: use a tp dividing {self.num_k_heads}, or more key heads.")
        return dims

    def given_pieces(self, seq_len: int, c: int) -> int | None:
        """``max_pieces`` as the layer passes it for ``seq_len`` tokens over ``c`` colossal ranks (at most
        ``S / c``), or ``None``."""
        return None if self.max_pieces is None else min(self.max_pieces, max(seq_len // c, 1))

    def held_slots(self, seq_len: int, dims: MeshDims) -> tuple[int, int]:
        """The state slots the layer holds where its metadata are traced (a training step's batch): per
        ``cp_colossal`` rank for the state passing, per CP device for the convolution halo. An order
        needing more (:func:`jax_cp.linear.needed_pieces`) comes out NaN there."""
        given = self.given_pieces(seq_len, dims.c)
        return pieces_for(given, seq_len // dims.c), pieces_for(given, seq_len // (dims.c * dims.u))


def init_param(name: str, shape, key, dtype=F32, kernel_init=nnx.initializers.lecun_normal()):
    """A parameter's initial value: projections by ``kernel_init`` as ``[fan_in, fan_out]`` matrices, the
    convolution uniform in ``+-1/sqrt(W)`` (torch's ``Conv1d``), ``dt_bias`` and the norm ones, ``A`` uniform
    in ``[1, 16]`` (Mamba-2's range; ``A_log = log A``).

    Args:
        name: the parameter's name (``GatedDeltaNetSpec.param_shapes``).
        shape: its shape.
        key: the random key.
        dtype: its dtype.
        kernel_init: the projections' initialiser.

    Returns:
        The value, unplaced.
    """
    if name.endswith("_kernel"):
        fan_in = shape[0] * shape[1] if name == "o_kernel" else shape[0]
        return kernel_init(key, (fan_in, math.prod(shape) // fan_in), dtype).reshape(shape)
    if name.endswith("_conv"):
        bound = shape[0] ** -0.5
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    if name == "A_log":
        return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))
    return jnp.ones(shape, dtype)


# ----------------------------------------------------------------------------- the maths, per token


def _reshape(x, shape, layout, *last):
    """``x.reshape(shape)``; on an Explicit mesh (``layout``: the leading dims' ``PartitionSpec`` entries,
    ``None`` elsewhere) told its result's layout ``P(*layout, *last)``, which it cannot infer there."""
    return jnp.reshape(x, shape) if layout is None else jnp.reshape(x, shape, out_sharding=P(*layout, *last))


def conv_channels(pieces, t: int, layout=None):
    """``[..., heads_i, dim_i]`` pieces (q, k, v; or their conv kernels) -> ``[..., C]``, rank-major: the
    ``t`` equal blocks of ``C`` hold each tp rank's own heads of every piece, so channels split over
    ``tp`` need no data moved. ``layout``: as ``_reshape``'s."""
    lead = pieces[0].shape[:-2]
    parts = [_reshape(p, (*lead, t, p.shape[-2] * p.shape[-1] // t), layout, TP, None) for p in pieces]
    c = jnp.concatenate(parts, axis=-1)
    return _reshape(c, (*lead, c.shape[-2] * c.shape[-1]), layout, TP)


def split_channels(c, spec: GatedDeltaNetSpec, t: int, layout=None):
    """The inverse of ``conv_channels``: ``[..., C]`` -> q, k ``[..., N, K]``, v ``[..., H, V]``."""
    lead, N, H, K, V = c.shape[:-1], spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    sizes = np.cumsum([N // t * K, N // t * K])
    q, k, v = jnp.split(_reshape(c, (*lead, t, c.shape[-1] // t), layout, TP, None), sizes.tolist(), axis=-1)
    return tuple(_reshape(a, (*lead, n, d), layout, TP, None) for a, n, d in ((q, N, K), (k, N, K), (v, H, V)))


def _l2norm(x, eps: float = 1e-6):
    xf = x.astype(F32)
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _heads(c, spec: GatedDeltaNetSpec, t: int, layout=None):
    """Convolved channels -> the recurrence's q, k ``[..., H, K]`` (L2-normalised, repeated) and v."""
    q, k, v = split_channels(c, spec, t, layout)
    r = spec.num_v_heads // spec.num_k_heads
    out = None if layout is None else P(*layout, TP, None)
    return jnp.repeat(_l2norm(q), r, axis=-2, out_sharding=out), jnp.repeat(_l2norm(k), r, axis=-2, out_sharding=out), v


def _gates(params, b, a):
    """``(g, beta)`` in float32: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    row = lambda p: p.astype(F32).reshape((1,) * (a.ndim - 1) + p.shape)  # noqa: E731
    g = -jnp.exp(row(params["A_log"])) * jax.nn.softplus(a.astype(F32) + row(params["dt_bias"]))
    return g, jax.nn.sigmoid(b.astype(F32))


def _project(params, x, dt):
    """``x [B, S, D]`` -> ``{q, k, v, z: [B, S, heads, dim], b, a: [B, S, H]}`` in ``dt``."""
    x = x.astype(dt)
    heads = {n: jnp.einsum("bsd,dhe->bshe", x, params[f"{n}_kernel"].astype(dt)) for n in "qkvz"}
    return heads | {n: jnp.einsum("bsd,dh->bsh", x, params[f"{n}_kernel"].astype(dt)) for n in "ba"}


def _output(params, o, z, spec: GatedDeltaNetSpec, dt, layout=None):
    """``rmsnorm(o) * silu(z)`` (float32) through the output projection: ``[B, S, H, V]`` -> ``[B, S, E]``."""
    h = rms_norm(o.astype(F32), params["norm"], spec.norm_eps) * jax.nn.silu(z.astype(F32))
    out = None if layout is None else P(*layout, None)
    return jnp.einsum("bshv,hve->bse", h.astype(dt), params["o_kernel"].astype(dt), out_sharding=out)


# ----------------------------------------------------------------------------- the layer on the mesh


def gated_deltanet(params: dict, x_BSD, *, spec: GatedDeltaNetSpec, mesh, dtype=None, positions=None,
                   segment_ids=None, return_state: bool = False):
    """The layer on a sequence sharded over the CP axes (the training path).

    Args:
        params: ``{name: value}`` of ``spec.param_shapes()`` (used in ``spec.param_specs()``'s layouts).
        x_BSD: ``[B, S, D]``, ideally sharded ``P("dp", ("cp_colossal", "cp_ulysses"), None)``.
        spec: the layer's shapes.
        mesh: the mesh (:func:`jax_cp.make_mesh`).
        dtype: the matmuls' dtype (``None``: ``x_BSD``'s); the recurrence runs in float32.
        positions, segment_ids: ``[B, S]`` per-token document positions and ids, in any order (a
            load-balanced or dispatch-planned row): the convolution's halo and the state follow them.
        return_state: also return what a decode continues from, each row's last document (its
            greatest segment id >= 0) after its greatest position: ``(conv_state [B, W-1, C],
            recurrent_state [B, H, V, K])``.

    Returns:
        ``y [B, S, E]`` sharded like ``x_BSD``; with ``return_state``, ``(y, (conv_state, recurrent_state))``.
    """
    dims = spec.check_mesh(mesh)
    t, dt = dims.t, jnp.dtype(dtype or x_BSD.dtype)
    meta = dict(positions=positions, segment_ids=segment_ids, return_state=return_state,
                max_pieces=spec.given_pieces(x_BSD.shape[1], dims.c))
    act, w = ((DP, CP), (None,)) if is_explicit(mesh) else (None, None)  # layouts an Explicit mesh is told
    p = {n: place(a, mesh, HEADS if a.ndim == 4 else GATES)
         for n, a in _project(params, place(x_BSD, mesh, X_BSD), dt).items()}
    w_WC = conv_channels([params[f"{n}_conv"] for n in "qkv"], t, w).astype(dt)
    c = causal_conv1d(place(conv_channels([p[n] for n in "qkv"], t, act), mesh, CHANNELS), w_WC, mesh=mesh,
                      activation="silu", **meta)
    c, conv_state = c if return_state else (c, None)
    # float32 into the rule: it computes in float32, and its Ulysses all-to-all carries q, k, v with the
    # float32 gates (one collective), so they travel as float32 either way.
    q, k, v = (place(a.astype(F32), mesh, HEADS) for a in _heads(c, spec, t, act))
    g, beta = (place(a, mesh, GATES) for a in _gates(params, p["b"], p["a"]))
    o = gated_delta_rule(q, k, v, g, beta, mesh=mesh, chunk_size=spec.chunk_size, scale=spec.scale, **meta)
    o, state = o if return_state else (o, None)
    y = place(_output(params, place(o, mesh, HEADS), p["z"], spec, dt, act), mesh, X_BSD)
    return (y, (conv_state, state)) if return_state else y


def decode_tokens(params: dict, x_BTD, conv_state, recurrent_state, *, spec: GatedDeltaNetSpec, mesh, dtype=None):
    """``T`` new tokens per sequence ``x [B, T, D]`` (replicated over the CP axes), one after the other
    from the cache: returns ``(y [B, T, E], conv_state, recurrent_state)``, the states advanced by ``T``."""
    t = spec.check_mesh(mesh).t
    dt = jnp.dtype(dtype or x_BTD.dtype)
    act, w = ((DP, None), (None,)) if is_explicit(mesh) else (None, None)  # layouts an Explicit mesh is told
    p = {n: place(a, mesh, HEADS_DECODE if a.ndim == 4 else GATES_DECODE)
         for n, a in _project(params, place(x_BTD, mesh, X_DECODE), dt).items()}
    w_WC = conv_channels([params[f"{n}_conv"] for n in "qkv"], t, w).astype(dt)
    c_BTC = conv_channels([p[n] for n in "qkv"], t, act)
    g, beta = _gates(params, p["b"], p["a"])
    outs = []
    for i in range(x_BTD.shape[1]):
        c, conv_state = conv_step(conv_state, c_BTC[:, i], w_WC, activation="silu")
        q, k, v = _heads(c, spec, t, act and act[:1])
        o, recurrent_state = gated_delta_step(recurrent_state, q, k, v, g[:, i], beta[:, i], scale=spec.scale)
        outs.append(o)
    o = place(jnp.stack(outs, axis=1), mesh, HEADS_DECODE)
    return place(_output(params, o, p["z"], spec, dt, act), mesh, X_DECODE), conv_state, recurrent_state


def prefill_cache(params: dict, x_BSD, *, spec: GatedDeltaNetSpec, mesh, dtype=None, positions=None,
                  segment_ids=None, lengths=None):
    """The prompt ``x [B, S, D]`` through the layer (``gated_deltanet``), and the cache a decode continues
    from: each row's last document (its largest segment id >= 0), up to its ``lengths`` real tokens
    (positions below ``lengths [B]``; the rest is right padding, moved into a document of its own,
    id -1, which the last document never sees). Returns ``(y, {conv_state, recurrent_state,
    cache_index})``, ``cache_index [B]`` one past the largest position kept."""
    B, S = x_BSD.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if positions is None else jnp.asarray(positions), (B, S))
    seg = None if segment_ids is None else jnp.broadcast_to(jnp.asarray(segment_ids), (B, S))
    keep = jnp.ones((B, S), bool) if seg is None else seg >= 0
    if lengths is not None:
        lengths = _check_lengths(lengths, B, S)
        keep &= pos < lengths[:, None]
        seg = jnp.where(keep, 0 if seg is None else seg, -1)
    if seg is not None:
        last = jnp.where(keep, seg, -1).max(axis=1, keepdims=True)
        keep &= seg == last
    next_B = jnp.where(keep, pos, -1).max(axis=1).astype(jnp.int32) + 1
    if not isinstance(next_B, jax.core.Tracer) and int(next_B.min()) < 1:
        rows = np.flatnonzero(np.asarray(next_B) < 1).tolist()
        raise ValueError(f"prompt rows {rows} have no real token (every segment id is negative or every position "
                         "is at or past its length): each row needs one to decode from; check segment_ids/lengths.")
    y, (conv, state) = gated_deltanet(params, x_BSD, spec=spec, mesh=mesh, dtype=dtype, positions=positions,
                                      segment_ids=seg, return_state=True)
    return y, {n: place(v, mesh, CACHE_SPECS[n]) for n, v in zip(CACHE_FIELDS, (conv, state, next_B))}


def empty_cache(spec: GatedDeltaNetSpec, mesh, batch: int, dtype) -> dict[str, jax.Array]:
    """One layer's fresh cache (``CACHE_FIELDS``, zeros: an empty prompt), created already sharded
    (``CACHE_SPECS``); ``dtype`` is the convolution state's, the recurrent state is float32."""
    dims = spec.check_mesh(mesh)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or batch % dims.dp:
        raise ValueError(f"batch={batch!r} must be a positive int divisible by dp={dims.dp}.")
    shapes = {"conv_state": ((batch, spec.conv_width - 1, spec.channels), dtype),
              "recurrent_state": ((batch, spec.num_v_heads, spec.head_v_dim, spec.head_k_dim), F32),
              "cache_index": ((batch,), jnp.int32)}
    return {name: jax.jit(lambda shape=shape, dt=dt: jnp.zeros(shape, dt),
                          out_shardings=NamedSharding(mesh, CACHE_SPECS[name]))()
            for name, (shape, dt) in shapes.items()}


def infer(params: dict, x_BSD, cache: dict, *, spec: GatedDeltaNetSpec, mesh, dtype=None, prefill: bool,
          positions=None, segment_ids=None, lengths=None):
    """``prefill_cache`` or one ``decode_tokens`` step on ``cache`` (``CACHE_FIELDS``): the inference call of
    the NNX and Linen modules. Returns ``(y, cache)``, the new cache in the old one's dtypes."""
    if cache is None or any(cache.get(n) is None for n in CACHE_FIELDS):
        raise ValueError("prefill=True and decode=True need a cache: call init_cache((batch_size, max_length)) on "
                         "the layer first (Linen: init with decode=True on a [batch, max_length, D] input).")
    B, batch = getattr(x_BSD, "shape", (None,))[0], cache["recurrent_state"].shape[0]
    if B != batch:
        raise ValueError(f"the input's batch={B} does not match the cache's batch={batch}; init_cache again with "
                         f"batch_size={B}, or pass {batch} sequences.")
    kw = dict(spec=spec, mesh=mesh, dtype=dtype)
    if prefill:
        y, new = prefill_cache(params, x_BSD, positions=positions, segment_ids=segment_ids, lengths=lengths, **kw)
    else:
        if positions is not None or segment_ids is not None or lengths is not None:
            raise ValueError("decode=True continues each row from its cache (cache_index); pass positions, "
                             "segment_ids and lengths to the prefill call (prefill=True) only.")
        y, conv, state = decode_tokens(params, x_BSD, cache["conv_state"], cache["recurrent_state"], **kw)
        new = dict(conv_state=conv, recurrent_state=state, cache_index=cache["cache_index"] + x_BSD.shape[1])
    return y, {n: new[n].astype(cache[n].dtype) for n in CACHE_FIELDS}


# ----------------------------------------------------------------------------- the reference


def gated_deltanet_reference(params: dict, x_BSD, *, spec: GatedDeltaNetSpec, positions=None, segment_ids=None):
    """The layer on one device, token by token: the ground truth the CP layer is tested against.

    The projections, gates and output as :func:`gated_deltanet`; the convolution and the delta rule
    as their recurrences (``jax_cp.linear.reference``): each row in document order (segment id, then
    position), a token continuing its document's token at position - 1, the state (float32) zero at
    each document's start.

    Args:
        params: ``{name: value}`` of ``spec.param_shapes()``.
        x_BSD: ``[B, S, D]``; its dtype is the matmuls'.
        spec: the layer's shapes.
        positions, segment_ids: ``[B, S]`` (or ``[S]``) positions and document ids, in any order.

    Returns:
        ``y [B, S, E]`` in the tokens' own order.
    """
    dt, meta = x_BSD.dtype, dict(positions=positions, segment_ids=segment_ids)
    p = _project(params, x_BSD, dt)
    w_WC = conv_channels([params[f"{n}_conv"] for n in "qkv"], 1).astype(dt)
    c = reference.causal_conv1d(conv_channels([p[n] for n in "qkv"], 1), w_WC, activation="silu", **meta)
    q, k, v = _heads(c, spec, 1)
    g, beta = _gates(params, p["b"], p["a"])
    o = reference.gated_delta_rule(q, k, v, g, beta, scale=spec.scale, **meta)
    return _output(params, o, p["z"], spec, dt)


# ----------------------------------------------------------------------------- the module


class GatedDeltaNet(nnx.Module):
    """The Qwen3-Next gated DeltaNet layer over a sequence sharded on ``mesh`` (arguments as ``CPAttention``'s).

    Call on a global ``x [B, S, D]`` (sharded ``P("dp", ("cp_colossal", "cp_ulysses"), None)``) with the
    tokens' ``positions`` and ``segment_ids`` in any order (natural, dual-chunk, a dispatch plan's);
    returns ``y [B, S, out_features]`` sharded the same way. Parameters are created already sharded
    (heads over ``tp``) and carry ``out_sharding`` metadata. Inference as ``CPAttention``:
    ``init_cache((batch, max_length))``, ``prefill=True`` on a prompt, ``decode=True`` on new tokens;
    the cache is the recurrent state, not the tokens, so ``max_length`` only has to be given.

    Args:
        in_features: the model width ``D``.
        num_k_heads, head_k_dim, num_v_heads, head_v_dim: as :class:`GatedDeltaNetSpec`.
        out_features, conv_width, norm_eps, chunk_size, max_pieces: as :class:`GatedDeltaNetSpec`.
        mesh: the mesh (:func:`jax_cp.make_mesh`).
        dtype: the matmuls' dtype (``None``: the input's); the recurrence runs in float32.
        param_dtype: the parameters' dtype.
        kernel_init: the projections' initialiser (as ``[fan_in, fan_out]`` matrices).
        sharding: ``{name: PartitionSpec}`` storing some parameters otherwise than their compute layout
            (``GatedDeltaNetSpec.param_specs``), e.g. FSDP over ``dp``: each call gathers them.
        decode: run calls as decode steps on the cache.
        rngs: the ``nnx.Rngs`` the parameters are drawn from.

    Raises:
        ValueError: an argument is invalid (see :class:`GatedDeltaNetSpec`), ``tp`` does not divide
            ``num_k_heads``, or ``sharding`` names no parameter.
    """

    def __init__(self, in_features: int, *, num_k_heads: int, head_k_dim: int, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, out_features: int | None = None, conv_width: int = 4,
                 norm_eps: float = 1e-6, chunk_size: int = 64, max_pieces: int | None = None, mesh, dtype=None,
                 param_dtype=F32,
                 kernel_init=nnx.initializers.lecun_normal(), sharding: Mapping[str, P] | None = None,
                 decode: bool = False, rngs: nnx.Rngs):
        self.spec = GatedDeltaNetSpec(in_features=in_features, num_k_heads=num_k_heads, head_k_dim=head_k_dim,
                                      num_v_heads=num_v_heads, head_v_dim=head_v_dim, out_features=out_features,
                                      conv_width=conv_width, norm_eps=norm_eps, chunk_size=chunk_size,
                                      max_pieces=max_pieces)
        self.spec.check_mesh(mesh)
        self.mesh, self.dtype, self.decode = mesh, dtype, decode
        shapes = self.spec.param_shapes()
        unknown = sorted(set(sharding or {}) - set(shapes))
        if unknown:
            raise ValueError(f"sharding names {unknown}, which are not parameters of the layer; use names among "
                             f"{sorted(shapes)}.")
        stored = self.spec.param_specs() | dict(sharding or {})
        for name, shape in shapes.items():
            value = place(init_param(name, shape, rngs.params(), param_dtype, kernel_init), mesh, stored[name])
            setattr(self, name, nnx.Param(value, out_sharding=tuple(stored[name]), eager_sharding=False))

    def params(self) -> dict:
        """The parameters' values in their compute layout (``jax_cp.gather``: stored ones all-gathered)."""
        compute = self.spec.param_specs()
        return {n: gather(getattr(self, n)[...], self.mesh, P(*getattr(self, n).get_metadata()["out_sharding"]),
                          compute[n]) for n in compute}

    def reference(self, x_BSD, *, positions=None, segment_ids=None):
        """This layer's parameters through :func:`gated_deltanet_reference` (one device, token by token;
        on an Explicit mesh, parameters and input replicated first)."""
        explicit = is_explicit(self.mesh)
        whole = lambda a: place(jnp.asarray(a), self.mesh, P()) if explicit and a is not None else a  # noqa: E731
        params = {n: whole(getattr(self, n)[...]) for n in self.spec.param_shapes()}
        return gated_deltanet_reference(params, whole(x_BSD).astype(self.dtype or x_BSD.dtype), spec=self.spec,
                                        positions=whole(positions), segment_ids=whole(segment_ids))

    def init_cache(self, input_shape, dtype=None):
        """Creates the cache for ``prefill``/``decode`` calls, already sharded: ``input_shape`` is ``(batch_size,
        max_length)`` or ``(batch_size, max_length, in_features)`` (``max_length`` is not needed: the state has
        a fixed size); ``dtype`` (default the layer's, float32 when None) is the convolution state's. Variables
        (``nnx.Cache``): ``conv_state [B, W-1, C]`` (the last ``W - 1`` convolution inputs, split over tp by
        heads), ``recurrent_state [B, H, V, K]`` (float32, split over tp by heads), ``cache_index [B]``
        (each sequence's next position); all zero: a fresh cache is an empty prompt."""
        dtype = jnp.dtype(dtype or self.dtype or F32)
        for name, value in empty_cache(self.spec, self.mesh, tuple(input_shape)[0], dtype).items():
            setattr(self, name, nnx.Cache(value, out_sharding=tuple(CACHE_SPECS[name]), eager_sharding=False))

    def __call__(self, x_BSD, *, positions=None, segment_ids=None, prefill: bool = False, lengths=None,
                 decode: bool | None = None, span_ids=None):
        """The layer over ``x [B, S, D]`` at ``positions`` with ``segment_ids`` (packed documents; each starts
        from a zero state). ``prefill=True`` also writes the cache a decode continues from: each row's
        last document (its largest segment id), up to ``lengths [B]`` real tokens (the rest right padding).
        ``decode=True`` (or the module's ``decode``): ``T`` new tokens per sequence ``[B, T, D]``, each
        advancing the cache. ``span_ids`` (bidirectional spans) are refused: the layer is causal."""
        refuse_spans(span_ids)
        decode = self.decode if decode is None else decode
        kw = dict(spec=self.spec, mesh=self.mesh, dtype=self.dtype)
        if not (prefill or decode):
            return gated_deltanet(self.params(), x_BSD, positions=positions, segment_ids=segment_ids, **kw)
        cache = {n: getattr(self, n, None) for n in CACHE_FIELDS}
        y, cache = infer(self.params(), x_BSD, {n: None if v is None else v[...] for n, v in cache.items()},
                         prefill=prefill, positions=positions, segment_ids=segment_ids, lengths=lengths, **kw)
        for name, value in cache.items():
            getattr(self, name)[...] = value
        return y
