"""``CPAttention``'s projections on one device, each with a stated ``jax.custom_vjp`` backward.

``LinearProjections`` (a frozen pytree of ``ChunkWeights``) is what the per-shard body
(``_body.attention_shard``) asks for each head chunk: ``project_parts`` runs a chunk's projection matmuls with
QK-norm and RoPE on the device's own tokens (so the Ulysses exchange can follow
at once); ``heads_to_model`` is the output side: inverse all-to-all, then the
output projection. ``tie_cotangents`` orders the chunks' projection backwards
(identity forward).
Letters: B batch, S local sequence, D model width, H heads (of this chunk), d head dim.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._mesh import AXES, CP, TP, ULYSSES, seq_chunk
from jax_cp._posenc import apply_rope, rms_norm
from jax_cp._ulysses import a2a

__all__ = ["ChunkWeights", "LinearProjections", "heads_to_model", "local_kv", "per_token", "project", "project_parts",
           "tie_cotangents"]


def _seq_to_heads(y, axis_name):
    return a2a(y, axis_name, 2, 1)


def _heads_to_seq(y, axis_name):
    return a2a(y, axis_name, 1, 2)


def project(x_BSD, w_DHd, b_Hd, dtype):
    """``x [B, S, D] @ w [D, H, d] (+ b [H, d])`` in ``dtype``."""
    y = jnp.einsum("bsd,dhe->bshe", x_BSD.astype(dtype), w_DHd.astype(dtype))
    return y if b_Hd is None else y + b_Hd.astype(dtype)[None, None]


def per_token(y, norm_d, pos_BS, theta):
    """QK-norm then RoPE: per token and head, so they run before the all-to-all on local tokens."""
    if norm_d is not None:
        y = rms_norm(y, norm_d)
    if theta is not None:
        y = apply_rope(y, pos_BS, theta)
    return y


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def project_parts(x_BSD, ws, bs, norms, pos_BS, dtype, theta=None, rotate=None):
    """Projections of the local tokens: ``x [B, S/u, D] @ ws[i] [D, H_i, d] (+ bs[i])`` in ``dtype``.

    Then QK-norm (scale ``norms[i]``) and RoPE (``theta``, where ``rotate[i]``,
    at the local tokens' positions ``pos_BS``) when given. The per-token
    transforms run here, *before* the exchange, so nothing sits between the
    exchange and the attention (or the colossal K/V exchange) that consumes
    it. Returns the tuple of parts ``[B, S/u, H_i, d]``. Weight gradients come
    back in the weights' own dtype (float32 parameters keep float32 gradients
    through every later sum).
    """
    return _parts(x_BSD, ws, bs, norms, pos_BS, dtype, theta, rotate)[1]


def _parts(x, ws, bs, norms, pos, dtype, theta, rotate):
    ys = [project(x, w, b, dtype) for w, b in zip(ws, bs)]
    rotate = rotate or (False,) * len(ws)
    return ys, tuple(per_token(y, n, pos, theta if r else None) for y, n, r in zip(ys, norms, rotate))


def _pp_fwd(x, ws, bs, norms, pos, dtype, theta, rotate):
    ys, out = _parts(x, ws, bs, norms, pos, dtype, theta, rotate)
    kept = tuple(y_ if n is not None else None for y_, n in zip(ys, norms))  # the norm's backward needs its input
    return out, (x, ws, bs, norms, pos, kept)


def _pp_bwd(dtype, theta, rotate, res, gs):
    x, ws, bs, norms, pos, kept = res
    rotate = rotate or (False,) * len(ws)
    acc = jnp.promote_types(dtype, jnp.float32)  # float64 stays float64
    dx, dws, dbs, dnorms = 0.0, [], [], []
    for g, w, b, n, y, r in zip(gs, ws, bs, norms, kept, rotate):
        th = theta if r else None
        dn = None
        if n is not None:
            _, vjp = jax.vjp(lambda y_, n_: per_token(y_, n_, pos, th), y, n)
            g, dn = vjp(g)
        elif th is not None:
            g = apply_rope(g, -pos, th)  # the rotation's transpose is the rotation by -angle
        dx = dx + jnp.einsum("bshe,dhe->bsd", g, w.astype(dtype), preferred_element_type=acc)
        dws.append(jnp.einsum("bsd,bshe->dhe", x.astype(dtype), g, preferred_element_type=acc).astype(w.dtype))
        dbs.append(None if b is None else g.astype(acc).sum((0, 1)).astype(b.dtype))
        dnorms.append(dn)
    return dx.astype(x.dtype), tuple(dws), tuple(dbs), tuple(dnorms), None


project_parts.defvjp(_pp_fwd, _pp_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def heads_to_model(o_BSHd, w_HdD, axis_name):
    """Inverse all-to-all ``[B, S, H/u, d] -> [B, S/u, H, d]``, then ``@ w [H, d, D]`` in o's dtype."""
    return jnp.einsum("bshe,hed->bsd", _heads_to_seq(o_BSHd, axis_name), w_HdD.astype(o_BSHd.dtype))


def _htm_fwd(o, w, axis_name):
    z = _heads_to_seq(o, axis_name)
    return jnp.einsum("bshe,hed->bsd", z, w.astype(z.dtype)), (z, w)


def _htm_bwd(axis_name, res, g_BSD):
    z, w = res
    acc = jnp.promote_types(z.dtype, jnp.float32)  # float64 stays float64
    dz = jnp.einsum("bsd,hed->bshe", g_BSD, w.astype(z.dtype), preferred_element_type=acc).astype(z.dtype)
    dw = jnp.einsum("bshe,bsd->hed", z, g_BSD, preferred_element_type=acc).astype(w.dtype)
    return _seq_to_heads(dz, axis_name), dw


heads_to_model.defvjp(_htm_fwd, _htm_bwd)


@jax.custom_vjp
def tie_cotangents(a, b):
    """Identity on ``(a, b)``; in the backward their cotangents pass one ``optimization_barrier``.

    The forward is untouched (no data flows between ``a`` and ``b``). In the
    backward, whatever consumes ``a``'s cotangent waits until ``b``'s exists:
    on hybrid layouts the layer ties chunk i's projected Q to chunk i+1's Q
    weight, so chunk i's Q-projection backward cannot start before chunk i+1's
    weight gradient is done, and XLA places that matmul inside chunk i's
    Q-gradient all-to-all instead of leaving the all-to-all empty.
    """
    return a, b


def _tie_fwd(a, b):
    return (a, b), None


def _tie_bwd(_, g):
    return lax.optimization_barrier(g)


tie_cotangents.defvjp(_tie_fwd, _tie_bwd)


def _varying(a):
    """Marks ``a`` as varying over every mesh axis, so the custom_vjp blocks see
    one type and the transpose (a psum) of that cast sums the weight gradients."""
    aval = jax.typeof(a)
    vma = aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying  # renamed across JAX versions
    missing = tuple(ax for ax in AXES if ax not in vma)
    return lax.pcast(a, missing, to="varying") if missing else a


def local_kv(w, layout, axis: int):
    """Repeat this tp rank's kv heads (axis ``axis``) to the expanded count, minimal."""
    dims, K_exp = layout.dims, layout.kv_expanded
    K = w.shape[axis] * (dims.t if layout.kv_sharded else 1)
    w = jnp.repeat(w, K_exp // K, axis=axis)
    if not layout.kv_sharded and dims.t > 1:
        per = K_exp // dims.t
        w = lax.dynamic_slice_in_dim(w, lax.axis_index(TP) * per, per, axis=axis)
    return w


def _chunks(a, n, axis):
    if a is None:
        return [None] * n
    return list(jnp.split(a, n, axis=axis)) if n > 1 else [a]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkWeights:
    """One head chunk's weights on one device (parameter dtype; ``None`` where the layer has none):
    ``wq [D, H_i, d]``, ``wk``/``wv [D, K_i, d]`` (kv heads repeated to the layout's count),
    ``wo [H_i, dv, E]``, the biases and the chunk's sink logits ``[H_i]``."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    bq: jax.Array | None = None
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    sinks: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearProjections:
    """The layer's weights and inputs on one device, cut into ``spec.overlap_chunks`` head chunks.

    A frozen pytree built once per call (:meth:`build`); every method is a pure function of it:
    ``q_parts(i, carry)`` projects chunk i's Q (Q, K and V when the chunk is fused) and hands back the
    next chunk's carry; on hybrid layouts it also ties those parts to chunk i+1's Q weight
    (``tie_cotangents``): chunk i's projection backward then waits for chunk i+1's dWq, and XLA
    hides chunk i's Q-gradient all-to-all under that matmul (benchmarks/RESULTS.md; not on pure
    Ulysses, nor with exchanges that measured worse: ``KVExchange.ties_chunks``).
    """

    chunks: tuple[ChunkWeights, ...]
    norms: tuple  # (q_norm, k_norm, None): QK-norm scales, or None
    o_bias: jax.Array | None
    x: jax.Array  # this device's tokens [B, S/(c*u), D], in the compute dtype
    pos: jax.Array  # their positions, for RoPE before the exchange
    kv_x: tuple  # cross attention's K/V inputs (one for both, or K's and V's), else ()
    kv_pos: jax.Array  # the K/V tokens' positions
    spec: object = dataclasses.field(metadata=dict(static=True))
    dtype: object = dataclasses.field(metadata=dict(static=True))
    tie: bool = dataclasses.field(metadata=dict(static=True))
    split: bool = dataclasses.field(default=False, metadata=dict(static=True))  # output split over tp along D

    @classmethod
    def build(cls, params, x_BSD, pos_BS, *, spec, layout, dtype, kv_x=(), kv_pos_BS=None,
              split: bool = False) -> "LinearProjections":
        """This device's share of ``params`` (compute layout) cut into chunks, with the inputs. ``split``:
        ``x_BSD`` is this tp rank's slice of the features (all-gathered here: its gradient a reduce-scatter)
        and :meth:`finish` returns the output split the same way (a reduce-scatter, not an all-reduce)."""
        n = spec.overlap_chunks
        if split:
            x_BSD = lax.all_gather(x_BSD.astype(dtype), TP, axis=2, tiled=True)
        x = _varying(x_BSD.astype(dtype))  # (the order of these steps is the traced program's)
        w = {k: _varying(v) for k, v in params.items()}  # parameter dtype; cast to dtype inside each block
        wk, wv = local_kv(w["k_kernel"], layout, 1), local_kv(w["v_kernel"], layout, 1)
        b = (w["q_bias"], local_kv(w["k_bias"], layout, 0), local_kv(w["v_bias"], layout, 0)) \
            if spec.use_bias else (None, None, None)
        pos = seq_chunk(pos_BS, CP)
        # Cross attention: K and V projected from other tokens (one input for both, or K's and V's)
        # at their own positions; never fused with Q (the layer refuses fused_qkv_chunks then).
        kv_x = tuple(_varying(a.astype(dtype)) for a in kv_x)
        kv_pos = pos if kv_pos_BS is None else seq_chunk(kv_pos_BS, CP)
        chunks = tuple(ChunkWeights(*ws) for ws in zip(
            _chunks(w["q_kernel"], n, 1), _chunks(wk, n, 1), _chunks(wv, n, 1), _chunks(w["o_kernel"], n, 0),
            *(_chunks(bias, n, 0) for bias in b), _chunks(w.get("sinks"), n, 0)))
        return cls(chunks=chunks, norms=(w.get("q_norm"), w.get("k_norm"), None), o_bias=params.get("o_bias"),
                   x=x, pos=pos, kv_x=kv_x, kv_pos=kv_pos, spec=spec, dtype=dtype, tie=spec.ties_chunks(layout.dims),
                   split=split)

    def _project(self, i, wq, idx, x=None, pos=None):
        c = self.chunks[i]
        ws, bs = (wq, c.wk, c.wv), (c.bq, c.bk, c.bv)
        w, b, n = (tuple(t[j] for j in idx) for t in (ws, bs, self.norms))
        rotate = tuple(j < 2 for j in idx)  # RoPE on q and k
        x, pos = (self.x, self.pos) if x is None else (x, pos)
        return project_parts(x, w, b, n, pos, self.dtype, self.spec.rope_theta, rotate)

    def start(self):
        """The chunk loop's carry before chunk 0: its Q weight."""
        return self.chunks[0].wq

    def q_parts(self, i, wq):
        """Chunk i's Q (Q, K and V when the chunk is fused) from its Q weight ``wq`` (the carry), and
        the next carry: chunk i+1's Q weight, tied to these parts on hybrid layouts (``None`` after
        the last chunk)."""
        fused = i < self.spec.fused_qkv_chunks  # Q, K and V cross cp_ulysses in one all-to-all
        parts = self._project(i, wq, (0, 1, 2) if fused else (0,))
        if i + 1 == len(self.chunks):
            return parts, None
        nxt = self.chunks[i + 1].wq
        return tie_cotangents(parts, nxt) if self.tie else (parts, nxt)

    def sinks(self, i):
        return self.chunks[i].sinks

    def kv_parts(self, i):
        if len(self.kv_x) == 2:  # cross attention, K and V from inputs of their own
            return (*self._project(i, None, (1,), self.kv_x[0], self.kv_pos),
                    *self._project(i, None, (2,), self.kv_x[1], self.kv_pos))
        x = self.kv_x[0] if self.kv_x else None
        return self._project(i, None, (1, 2), x, self.kv_pos)

    def output(self, i, o):
        return lax.optimization_barrier(heads_to_model(o, self.chunks[i].wo, ULYSSES))

    def finish(self, y):
        if not self.split:
            y = lax.psum(y, TP)
            return y.astype(self.dtype) if self.o_bias is None else (y + self.o_bias[None, None]).astype(self.dtype)
        # The barrier keeps the sum in y's dtype: without it the TPU compiler widens the chunks' bf16 sum to
        # float32 before the reduce-scatter (the caller's residual add is float32), twice the bytes over tp.
        y = lax.optimization_barrier(lax.psum_scatter(y, TP, scatter_dimension=2, tiled=True))
        if self.o_bias is not None:  # this rank's slice of it, once, after the sum
            n = y.shape[2]
            y = y + lax.dynamic_slice_in_dim(self.o_bias, lax.axis_index(TP) * n, n)[None, None]
        return y.astype(self.dtype)
