"""Attention masks from data: global positions, segment ids and windows.

Masks are never derived from array indices, so they stay right when the
sequence is split, gathered, rotated or reordered for load balance.
Letters: B batch, T query length, S key length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Window = tuple[int, int] | None


def normalize_window(local_window_size) -> Window:
    """``None``, ``w`` or ``(left, right)`` -> ``(left, right)`` or ``None``."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int,)) and not isinstance(local_window_size, bool):
        window = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        window = tuple(local_window_size)
    else:
        raise ValueError(
            f"local_window_size={local_window_size!r} must be None, an int, or a (left, right) pair of ints."
        )
    if not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        raise ValueError(f"local_window_size={local_window_size!r} must hold ints.")
    if min(window) < 0:
        raise ValueError(f"local_window_size={local_window_size!r} is negative; use sizes >= 0 (or None for no window).")
    return (int(window[0]), int(window[1]))


def visible(
    q_pos_BT: jax.Array,
    kv_pos_BS: jax.Array,
    q_seg_BT: jax.Array | None = None,
    kv_seg_BS: jax.Array | None = None,
    *,
    is_causal: bool = False,
    window: Window = None,
    q_span_BT: jax.Array | None = None,
    kv_span_BS: jax.Array | None = None,
) -> jax.Array:
    """``mask_BTS[b, t, s]``: may query ``t`` see key ``s``.

    Keys must be in the query's segment (negative ids are padding: never
    visible), within the window, and, when causal, not after the query unless both
    are in the same bidirectional span (``q_span_BT``/``kv_span_BS``: equal ids other
    than 0; prefix-LM prompts, image tokens, video frames).
    """
    qp = q_pos_BT[:, :, None]
    kp = kv_pos_BS[:, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(qp.shape, kp.shape), dtype=bool)
    if is_causal and q_span_BT is not None:
        qs, ks = q_span_BT[:, :, None], kv_span_BS[:, None, :]
        mask &= (kp <= qp) | ((qs == ks) & (qs != 0))
    elif is_causal:
        mask &= kp <= qp
    if window is not None:
        left, right = window
        mask &= (kp >= qp - left) & (kp <= qp + right)
    if q_seg_BT is not None:
        # Negative segment ids mark padding: it sees nothing and nothing sees it.
        mask &= (q_seg_BT[:, :, None] == kv_seg_BS[:, None, :]) & (kv_seg_BS[:, None, :] >= 0)
    return mask
