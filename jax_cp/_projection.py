"""Projections and their Ulysses exchanges, each with a stated ``jax.custom_vjp`` backward.

``project_parts`` runs a chunk's projection matmuls with QK-norm and RoPE on the
device's own tokens; ``exchange_heads`` sends the result across ``cp_ulysses``
in one all-to-all. A chunk's exchange depends on nothing but its own matmuls, so
XLA can run it under the next chunk's matmuls or attention; the backward runs
the inverse all-to-all, then the input- and weight-gradient matmuls.
``heads_to_model`` is the output side: inverse all-to-all, then the output projection.
``tie_cotangents`` orders the chunks' projection backwards (identity forward).
Letters: B batch, S local sequence, D model width, H heads (of this chunk), d head dim.
"""
from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._collectives import _a2a
from jax_cp._posenc import apply_rope, rms_norm

__all__ = ["project_parts", "exchange_heads", "heads_to_model", "tie_cotangents"]


def _seq_to_heads(y, axis_name):
    return _a2a(y, axis_name, 2, 1)


def _heads_to_seq(y, axis_name):
    return _a2a(y, axis_name, 1, 2)


def _proj(x_BSD, w_DHd, b_Hd, dtype):
    y = jnp.einsum("bsd,dhe->bshe", x_BSD.astype(dtype), w_DHd.astype(dtype))
    return y if b_Hd is None else y + b_Hd.astype(dtype)[None, None]


def _per_token(y, norm_d, pos_BS, theta):
    """QK-norm then RoPE: per token and head, so they run before the all-to-all on local tokens."""
    if norm_d is not None:
        y = rms_norm(y, norm_d)
    if theta is not None:
        y = apply_rope(y, pos_BS, theta)
    return y


def _pack(parts, u: int):
    """Parts ``[B, S, H_i, d]`` -> ``[B, S, u, sum_i H_i/u, d]``: head group j of every part in slot j."""
    B, S = parts[0].shape[:2]
    return jnp.concatenate([p.reshape(B, S, u, p.shape[2] // u, p.shape[3]) for p in parts], axis=3)


def _split(a, sizes, axis: int):
    """``a`` cut along ``axis`` into consecutive pieces of ``sizes``."""
    return tuple(jnp.split(a, list(itertools.accumulate(sizes))[:-1], axis=axis)) if len(sizes) > 1 else (a,)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def exchange_heads(parts, axis_name):
    """One all-to-all for several tensors: each ``[B, S/u, H_i, d] -> [B, S, H_i/u, d]``.

    Head group j of every part travels to the device of ``axis_name`` rank j
    in the same collective (TPUs run one all-to-all at a time, so one larger
    exchange leaves more compute to hide it under than several small ones).
    Backward: the inverse all-to-all, also one collective.
    """
    u = lax.axis_size(axis_name)
    if u == 1:
        return tuple(parts)
    y = _a2a(_pack(parts, u), axis_name, 2, 1)  # [B, S, 1, sum H_i/u, d]
    return _split(y[:, :, 0], [p.shape[2] // u for p in parts], 2)


def _xh_fwd(parts, axis_name):
    return exchange_heads(parts, axis_name), None


def _xh_bwd(axis_name, _, gs):
    u = lax.axis_size(axis_name)
    if u == 1:
        return (tuple(gs),)
    B, S = gs[0].shape[:2]
    g = jnp.concatenate([g_[:, :, None] for g_ in gs], axis=3)  # [B, S, 1, sum h_i, d]
    g = _a2a(g, axis_name, 1, 2)  # [B, S/u, u, sum h_i, d]
    sizes = [g_.shape[2] for g_ in gs]
    chunks = _split(g, sizes, 3)
    return (tuple(c.reshape(B, S // u, u * h, c.shape[-1]) for c, h in zip(chunks, sizes)),)


exchange_heads.defvjp(_xh_fwd, _xh_bwd)


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
    ys = [_proj(x, w, b, dtype) for w, b in zip(ws, bs)]
    rotate = rotate or (False,) * len(ws)
    return ys, tuple(_per_token(y, n, pos, theta if r else None) for y, n, r in zip(ys, norms, rotate))


def _pp_fwd(x, ws, bs, norms, pos, dtype, theta, rotate):
    ys, out = _parts(x, ws, bs, norms, pos, dtype, theta, rotate)
    kept = tuple(y_ if n is not None else None for y_, n in zip(ys, norms))  # the norm's backward needs its input
    return out, (x, ws, bs, norms, pos, kept)


def _pp_bwd(dtype, theta, rotate, res, gs):
    x, ws, bs, norms, pos, kept = res
    rotate = rotate or (False,) * len(ws)
    dx, dws, dbs, dnorms = 0.0, [], [], []
    for g, w, b, n, y, r in zip(gs, ws, bs, norms, kept, rotate):
        th = theta if r else None
        dn = None
        if n is not None:
            _, vjp = jax.vjp(lambda y_, n_: _per_token(y_, n_, pos, th), y, n)
            g, dn = vjp(g)
        elif th is not None:
            g = apply_rope(g, -pos, th)  # the rotation's transpose is the rotation by -angle
        dx = dx + jnp.einsum("bshe,dhe->bsd", g, w.astype(dtype), preferred_element_type=jnp.float32)
        dws.append(jnp.einsum("bsd,bshe->dhe", x.astype(dtype), g, preferred_element_type=jnp.float32).astype(w.dtype))
        dbs.append(None if b is None else g.astype(jnp.float32).sum((0, 1)).astype(b.dtype))
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
    dz = jnp.einsum("bsd,hed->bshe", g_BSD, w.astype(z.dtype), preferred_element_type=jnp.float32).astype(z.dtype)
    dw = jnp.einsum("bshe,bsd->hed", z, g_BSD, preferred_element_type=jnp.float32).astype(w.dtype)
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
