"""Attention masks from data: global positions, segment ids and windows.

Masks are never derived from array indices, so they stay right when the
sequence is split, gathered, rotated or reordered for load balance.
Letters: B batch, T query length, S key length.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

Window = tuple[int, int] | None


def normalize_window(local_window_size) -> Window:
    """``None``, ``w`` or ``(left, right)`` -> ``(left, right)`` of Python ints, or ``None``.

    The bounds are inclusive, as jax.nn's: a query at position ``p`` sees keys at positions
    ``p - left`` to ``p + right``, both ends included (``w`` is ``(w, w)``). A window ``W`` meaning
    ``|p_q - p_k| < W`` (Gemma, Hugging Face, Mistral) is ``(W - 1, W - 1)``, ``(W - 1, 0)`` causal.
    Python and NumPy integers are taken; bools and floats are refused.
    """
    if local_window_size is None:
        return None
    if _is_int(local_window_size):
        window = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
        window = tuple(local_window_size)
    else:
        raise ValueError(
            f"local_window_size={local_window_size!r} must be None, an int, or a (left, right) pair of ints."
        )
    if not all(_is_int(w) for w in window):
        raise ValueError(f"local_window_size={local_window_size!r} must hold ints (Python or NumPy integers; "
                         "not bools or floats), e.g. (127, 0).")
    if min(window) < 0:
        raise ValueError(f"local_window_size={local_window_size!r} is negative; use sizes >= 0 (or None for no window).")
    return (int(window[0]), int(window[1]))


def _is_int(x) -> bool:
    """A Python or NumPy integer, not a bool (``numbers.Integral`` counts ``True`` as one)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def spans_ignored_reason(is_causal: bool, window: Window) -> str | None:
    """Why span ids can change nothing under this mask, or ``None`` where they can.

    A span only lets a query see *later* keys of its span, which only a causal mask hides and only a
    window reaching right (``right > 0``, or no window) lets through.
    """
    if not is_causal:
        return "without is_causal=True every key of the segment is visible already, so spans change nothing"
    if window is not None and window[1] == 0:
        return (f"local_window_size={window} (right edge 0) hides every later key, which is all a span would "
                "let a query see, so spans change nothing")
    return None


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

    Keys must be in the query's segment (negative ids are padding: never visible), within the
    window (inclusive: ``p_q - left <= p_k <= p_q + right``), and, when causal, not after the query
    unless both are in the same bidirectional span (``q_span_BT``/``kv_span_BS``: equal ids other
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
