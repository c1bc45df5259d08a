"""Projection + collective blocks with a mirrored ``jax.custom_vjp`` backward.

Each block pairs one projection matmul with its own collective, so a chunk's
collective depends on nothing but its own matmul and XLA can run it under the
next chunk's matmul; the backward issues the inverse collective next to the
matching input- and weight-gradient matmuls.
Letters: B batch, S local sequence, D model width, H heads (of this chunk), d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_cp._collectives import _a2a
from jax_cp._posenc import apply_rope, rms_norm

__all__ = ["project_to_heads", "project_parts", "exchange_heads", "heads_to_model"]


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


def _stacked_to_heads(y_BSPHd, axis_name):  # [B, S/u, P, H, d] -> [B, S, P, H/u, d]
    return _a2a(y_BSPHd, axis_name, 3, 1)


def _stacked_to_seq(y_BSPHd, axis_name):  # the inverse
    return _a2a(y_BSPHd, axis_name, 1, 3)


def project_to_heads(x_BSD, ws, bs, norms, pos_BS, axis_name, dtype, theta=None, rotate=None):
    """``P`` projections of the same tokens sharing one all-to-all: ``[B, S/u, D] -> [B, S, P, H/u, d]``.

    ``project_parts`` (the matmuls, QK-norm and RoPE on the local tokens) then
    ``exchange_heads`` (one all-to-all for all ``P`` parts: K and V travel
    together; on TPU only one all-to-all is in flight at a time, so fewer,
    larger exchanges leave more matmuls to hide each one under).
    """
    return exchange_heads(project_parts(x_BSD, ws, bs, norms, pos_BS, dtype, theta, rotate), axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def exchange_heads(y_BSPHd, axis_name):
    """All-to-all ``[B, S/u, P, H, d] -> [B, S, P, H/u, d]``; backward: the inverse all-to-all."""
    return _stacked_to_heads(y_BSPHd, axis_name)


exchange_heads.defvjp(lambda y, axis_name: (exchange_heads(y, axis_name), None),
                      lambda axis_name, _, g: (_stacked_to_seq(g, axis_name),))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def project_parts(x_BSD, ws, bs, norms, pos_BS, dtype, theta=None, rotate=None):
    """``P`` projections of the local tokens, stacked on axis 2: ``[B, S/u, D] -> [B, S/u, P, H, d]``.

    For each part ``i``: ``x @ ws[i] [D, H, d] (+ bs[i])`` in ``dtype``, then QK-norm
    (scale ``norms[i]``) and RoPE (``theta``, where ``rotate[i]``, at the local
    tokens' positions ``pos_BS``) when given. The per-token transforms run
    here, *before* the exchange, so nothing sits between the exchange and the
    attention (or the colossal K/V exchange) that consumes it. Weight
    gradients come back in the weights' own dtype (float32 parameters keep
    float32 gradients through every later sum).
    """
    return _parts(x_BSD, ws, bs, norms, pos_BS, dtype, theta, rotate)[1]


def _parts(x, ws, bs, norms, pos, dtype, theta, rotate):
    ys = [_proj(x, w, b, dtype) for w, b in zip(ws, bs)]
    rotate = rotate or (False,) * len(ws)
    outs = [_per_token(y, n, pos, theta if r else None) for y, n, r in zip(ys, norms, rotate)]
    return ys, jnp.stack(outs, axis=2)


def _pp_fwd(x, ws, bs, norms, pos, dtype, theta, rotate):
    ys, y = _parts(x, ws, bs, norms, pos, dtype, theta, rotate)
    kept = tuple(y_ if n is not None else None for y_, n in zip(ys, norms))  # the norm's backward needs its input
    return y, (x, ws, bs, norms, pos, kept)


def _pp_bwd(dtype, theta, rotate, res, g_BSPHd):
    x, ws, bs, norms, pos, kept = res
    rotate = rotate or (False,) * len(ws)
    dx, dws, dbs, dnorms = 0.0, [], [], []
    for i, (w, b, n, y, r) in enumerate(zip(ws, bs, norms, kept, rotate)):
        g, th = g_BSPHd[:, :, i], theta if r else None
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
