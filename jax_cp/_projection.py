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

__all__ = ["project_to_heads", "heads_to_model"]


def _seq_to_heads(y, axis_name):
    return _a2a(y, axis_name, 2, 1)


def _heads_to_seq(y, axis_name):
    return _a2a(y, axis_name, 1, 2)


def _proj(x_BSD, w_DHd, b_Hd, dtype):
    y = jnp.einsum("bsd,dhe->bshe", x_BSD.astype(dtype), w_DHd.astype(dtype))
    return y if b_Hd is None else y + b_Hd.astype(dtype)[None, None]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def project_to_heads(x_BSD, w_DHd, b_Hd, axis_name, dtype):
    """``x [B, S/u, D] @ w [D, H, d] (+ b)`` in ``dtype``, then all-to-all to ``[B, S, H/u, d]``.

    Weight gradients come back in the weights' own dtype (float32 parameters keep
    float32 gradients through every later sum).
    """
    return _seq_to_heads(_proj(x_BSD, w_DHd, b_Hd, dtype), axis_name)


def _pth_fwd(x, w, b, axis_name, dtype):
    return project_to_heads(x, w, b, axis_name, dtype), (x, w, b)


def _pth_bwd(axis_name, dtype, res, g_BSHd):
    x, w, b = res
    g = _heads_to_seq(g_BSHd, axis_name)  # inverse all-to-all first, then its two matmuls
    dx = jnp.einsum("bshe,dhe->bsd", g, w.astype(dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("bsd,bshe->dhe", x.astype(dtype), g, preferred_element_type=jnp.float32).astype(w.dtype)
    db = None if b is None else g.astype(jnp.float32).sum((0, 1)).astype(b.dtype)
    return dx, dw, db


project_to_heads.defvjp(_pth_fwd, _pth_bwd)


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
