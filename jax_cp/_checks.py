"""Argument checks shared by configs: one message for one mistake."""
from __future__ import annotations

__all__ = ["check_positive_int", "check_positive_fields", "refuse_dense"]


def check_positive_int(name: str, value) -> int:
    """``value`` unchanged if it is an int >= 1 (bools refused), else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value


def check_positive_fields(obj, names) -> None:
    """``check_positive_int`` on each named attribute of a (dataclass) config."""
    for name in names:
        check_positive_int(name, getattr(obj, name))


def refuse_dense(bias=None, mask=None) -> None:
    """jax.nn / flax's dense ``bias=`` and ``mask=`` refused, naming the data-driven arguments instead."""
    if bias is not None:
        raise ValueError("bias= is not supported: a dense [B, N, T, S] bias is quadratic in the sequence, which "
                         "context parallelism shards. State the pattern by data instead: positions=, segment_ids=, "
                         "is_causal=, local_window_size= (masks), logits_soft_cap= or sinks=.")
    if mask is not None:
        raise ValueError("mask= is not supported: a dense [B, N, T, S] boolean mask is quadratic in the sequence, "
                         "which context parallelism shards. State it by data instead: is_causal=, "
                         "local_window_size=, segment_ids= (documents; a negative id pads a token) and positions=.")
