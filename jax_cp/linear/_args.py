"""Argument checks of the linear-attention layers: one message per mistake, naming the value and the fix.
Letters: B batch, S sequence, H heads, G groups, k key dim, v value dim, p head dim, n state dim,
W conv width, C channels.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax_cp._body import check_metadata  # the attention's own check: one rule for both

__all__ = ["check_conv", "check_gdn", "check_metadata", "check_ssd", "check_state", "refuse_spans"]


def _shape(name: str, a, want: tuple, what: str):
    if getattr(a, "shape", None) != tuple(want):
        raise ValueError(f"{name}.shape={getattr(a, 'shape', None)} must be {tuple(want)} ({what}).")


def _floating(name: str, a):
    dtype = jnp.result_type(a)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={dtype} must be a real floating dtype (float32, bfloat16, ...).")
    if dtype == jnp.float64:
        raise ValueError(f"{name}.dtype=float64: the linear layers carry their state in float32, so float64 inputs "
                         "(jax_enable_x64) would lose precision silently; cast the inputs to float32.")


def check_gdn(q, k, v, g, beta, chunk_size: int):
    """``q, k [B, S, H, dk]``, ``v [B, S, H, dv]``, ``g [B, S, H]`` or ``[B, S, H, dk]``, ``beta [B, S, H]``."""
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q.shape={getattr(q, 'shape', None)} must be [B, S, H, dk] (rank 4).")
    B, S, H, dk = q.shape
    _shape("k", k, q.shape, "as q: [B, S, H, dk]")
    if getattr(v, "ndim", None) != 4 or v.shape[:3] != (B, S, H):
        raise ValueError(f"v.shape={getattr(v, 'shape', None)} must be [B, S, H, dv] = ({B}, {S}, {H}, dv).")
    if getattr(g, "shape", None) not in ((B, S, H), (B, S, H, dk)):
        raise ValueError(f"g.shape={getattr(g, 'shape', None)} must be [B, S, H] = {(B, S, H)} (one log decay per "
                         f"head) or [B, S, H, dk] = {(B, S, H, dk)} (per key channel, KDA).")
    _shape("beta", beta, (B, S, H), "one write strength per token and head: [B, S, H]")
    for name, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _floating(name, a)
    check_chunk(chunk_size)
    return B, S, H, dk, v.shape[3]


def check_ssd(x, dt, A, B_, C_, D, chunk_size: int):
    """``x [B, S, H, p]``, ``dt [B, S, H]``, ``A [H]``, ``B, C [B, S, G, n]`` (G divides H), ``D [H]``."""
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [B, S, H, p] (rank 4).")
    Bz, S, H, p = x.shape
    _shape("dt", dt, (Bz, S, H), "one step per token and head: [B, S, H]")
    _shape("A", A, (H,), "one decay rate per head: [H]")
    if getattr(B_, "ndim", None) != 4 or B_.shape[:2] != (Bz, S) or H % B_.shape[2]:
        raise ValueError(f"B.shape={getattr(B_, 'shape', None)} must be [B, S, G, n] = ({Bz}, {S}, G, n) with G "
                         f"dividing the {H} heads.")
    _shape("C", C_, B_.shape, "as B: [B, S, G, n]")
    if D is not None:
        _shape("D", D, (H,), "one skip weight per head: [H]")
    for name, a in (("x", x), ("dt", dt), ("A", A), ("B", B_), ("C", C_)):
        _floating(name, a)
    check_chunk(chunk_size)
    return Bz, S, H, p, B_.shape[3]


def check_conv(x, w, bias):
    """``x [B, S, C]``, ``w [W, C]``, ``bias [C]``."""
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [B, S, C] (rank 3).")
    Bz, S, C = x.shape
    if getattr(w, "ndim", None) != 2 or w.shape[1] != C or w.shape[0] < 1:
        raise ValueError(f"w.shape={getattr(w, 'shape', None)} must be [W, C] = (W, {C}): one filter of width "
                         "W >= 1 per channel.")
    if bias is not None:
        _shape("bias", bias, (C,), "one bias per channel")
    _floating("x", x)
    return Bz, S, C, w.shape[0]


def check_chunk(chunk_size) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer (64 is a good default).")
    return chunk_size


def check_state(name: str, state, want: tuple, what: str):
    """``state`` (or None) of shape ``want``, as float32."""
    if state is None:
        return None
    _shape(name, state, want, what)
    return jnp.asarray(state, jnp.float32)


def refuse_spans(span_ids) -> None:
    """Bidirectional spans cannot be honoured by a recurrence, which only looks back."""
    if span_ids is not None:
        raise ValueError("span_ids= cannot be honoured by a linear-attention layer: its recurrence reads each "
                         "document strictly left to right, so a token never sees the later tokens of its span. "
                         "Pass span_ids only to the softmax attention layers (span_ids=None here).")
