"""Argument checks shared by configs: one message for one mistake."""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_positive_int", "check_positive_fields", "check_scale", "refuse_dense"]


def check_positive_int(name: str, value) -> int:
    """``value`` unchanged if it is an int >= 1 (bools refused), else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value


def check_positive_fields(obj, names) -> None:
    """``check_positive_int`` on each named attribute of a (dataclass) config."""
    for name in names:
        check_positive_int(name, getattr(obj, name))


def check_scale(scale, *, allow_traced: bool = False):
    """A logit scale as a Python float (Python or NumPy numbers, concrete scalar arrays); ``None`` passes.

    Bools, complex numbers and arrays that are not scalars are a ValueError; so is a traced scale
    unless ``allow_traced`` (then it is returned as it is, for the caller to multiply into the query).
    """
    if scale is None:
        return None
    dtype = np.dtype(type(scale)) if isinstance(scale, numbers.Number) else getattr(scale, "dtype", None)
    if (isinstance(scale, (bool, np.bool_)) or dtype is None or np.shape(scale) != ()
            or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))):
        raise ValueError(f"scale={scale!r} must be a real number (e.g. 0.125), or None for head_dim ** -0.5.")
    if not isinstance(scale, jax.core.Tracer):
        return float(scale)
    if allow_traced:
        return scale
    raise ValueError(f"scale={scale!r} is traced, but this path needs its value when it is traced: pass a Python "
                     "number (a layer's scale is fixed when it is built), or multiply the query by the scale and "
                     "pass scale=1.0.")


def refuse_dense(bias=None, mask=None) -> None:
    """jax.nn / flax's dense ``bias=`` and ``mask=`` refused, naming the data-driven arguments instead."""
    if bias is not None:
        raise ValueError("bias= is not supported: a dense [B, N, T, S] bias is quadratic in the sequence, which "
                         "context parallelism shards. State the pattern by data instead: positions=, segment_ids=, "
                         "is_causal=, local_window_size=, span_ids= (masks), logits_soft_cap= or sinks=.")
    if mask is not None:
        raise ValueError("mask= is not supported: a dense [B, N, T, S] boolean mask is quadratic in the sequence, "
                         "which context parallelism shards. State it by data instead: is_causal=, "
                         "local_window_size=, segment_ids= (documents; a negative id pads a token), positions=, "
                         "span_ids= (bidirectional blocks in a causal mask: a prompt prefix, an image) and "
                         "key_value_seq_lengths= or kv_segment_ids= (keys that are padding, self-attention "
                         "included). jax_cp.visibility(...) returns the [B, T, S] mask they make, to compare "
                         "with a dense one.")
