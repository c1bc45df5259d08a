"""The layer's parameters: the head dims they derive from, their shapes and their initial values.

On the ground floor (no mesh, kernel or exchange): the modules, the single-device reference and the
planner all read it. Letters: D model width, H query heads, K kv heads, d head dim, E output width.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jax_cp._checks import check_positive_int
from jax_cp._posenc import RoPE

__all__ = ["DERIVED", "derive_dims", "init_param", "param_shapes"]

DERIVED = ("head_dim", "num_kv_heads", "v_head_dim", "out_features")  # None: from the other fields


def derive_dims(*, num_heads, in_features=None, num_kv_heads=None, head_dim=None, out_features=None,
                v_head_dim=None, rope_theta=None) -> dict[str, int | None]:
    """The ``DERIVED`` dims, each given or derived (``head_dim = in_features // num_heads``,
    ``num_kv_heads = num_heads``, ``v_head_dim = head_dim``, ``out_features = in_features``); a
    ``ValueError`` naming the field when they do not fit together."""
    check_positive_int("num_heads", num_heads)
    if in_features is not None:
        check_positive_int("in_features", in_features)
    if head_dim is None:
        if in_features is None:
            raise ValueError("head_dim=None needs in_features to derive it from; pass head_dim.")
        if in_features % num_heads:
            raise ValueError(f"in_features={in_features} is not divisible by num_heads={num_heads}; "
                             "pass head_dim explicitly.")
        head_dim = in_features // num_heads
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int("num_kv_heads", num_kv_heads)
    check_positive_int("head_dim", head_dim)
    v_head_dim = check_positive_int("v_head_dim", head_dim if v_head_dim is None else v_head_dim)
    if out_features is not None:
        check_positive_int("out_features", out_features)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "grouped-query attention needs kv heads dividing the query heads."
        )
    if isinstance(rope_theta, RoPE) and head_dim % 2:
        raise ValueError(f"rope_theta={rope_theta} needs an even head_dim (got {head_dim}).")
    if rope_theta is not None and not isinstance(rope_theta, RoPE) and (rope_theta <= 0 or head_dim % 2):
        raise ValueError(f"rope_theta={rope_theta} needs rope_theta > 0 and an even head_dim (got {head_dim}).")
    return dict(head_dim=head_dim, num_kv_heads=num_kv_heads, v_head_dim=v_head_dim,
                out_features=in_features if out_features is None else out_features)


def param_shapes(spec) -> dict[str, tuple[int, ...]]:
    """The shape of each attention parameter.

    Args:
        spec: the :class:`AttentionSpec` (or any object with its dimension and
            ``use_bias`` / ``use_qk_norm`` / ``use_sinks`` fields).

    Returns:
        ``{name: shape}``: ``q_kernel``, ``k_kernel``, ``v_kernel``,
        ``o_kernel``; with ``use_bias`` the four biases; with ``use_qk_norm``
        ``q_norm`` and ``k_norm``; with ``use_sinks`` ``sinks``.
    """
    D, H, K, d, E = spec.in_features, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.out_features
    dv = spec.v_head_dim
    shapes = {"q_kernel": (D, H, d), "k_kernel": (D, K, d), "v_kernel": (D, K, dv), "o_kernel": (H, dv, E)}
    if spec.use_bias:
        shapes |= {"q_bias": (H, d), "k_bias": (K, d), "v_bias": (K, dv), "o_bias": (E,)}
    if spec.use_qk_norm:
        shapes |= {"q_norm": (d,), "k_norm": (d,)}
    if spec.use_sinks:
        shapes |= {"sinks": (H,)}
    return shapes


def init_param(name: str, shape, key, dtype, kernel_init):
    """Kernels are initialised as 2-D ``[fan_in, fan_out]`` matrices, then reshaped; norms to ones,
    biases and sinks to zeros."""
    if name.endswith("_kernel"):
        fan_in = shape[0] if name != "o_kernel" else shape[0] * shape[1]
        flat = kernel_init(key, (fan_in, math.prod(shape) // fan_in), dtype)
        return flat.reshape(shape)
    if name.endswith("_norm"):
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)
