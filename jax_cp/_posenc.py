"""Per-token, per-head transforms: rotary position embedding and RMS norm.

Both act on ``[B, S, H, d]`` with explicit global positions, so they give the
same result before or after the Ulysses all-to-all.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["apply_rope", "rms_norm"]


def apply_rope(x_BSHd: jax.Array, pos_BS: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split convention) at the given global positions.

    Args:
        x_BSHd: ``[B, S, H, d]`` queries or keys.
        pos_BS: ``[B, S]`` global positions.
        theta: the RoPE base.

    Returns:
        The rotated ``[B, S, H, d]`` array in ``x_BSHd``'s dtype (computed in
        float32, float64 for float64).

    Raises:
        ValueError: ``d`` is odd.
    """
    d = x_BSHd.shape[-1]
    if d % 2:
        raise ValueError(f"head_dim={d} must be even for RoPE (rope_theta={theta}).")
    acc = jnp.promote_types(x_BSHd.dtype, jnp.float32)  # float64 stays float64
    freq = theta ** (-jnp.arange(0, d // 2, dtype=acc) * 2.0 / d)
    ang_BSf = pos_BS.astype(acc)[..., None] * freq[None, None, :]
    sin, cos = jnp.sin(ang_BSf)[:, :, None, :], jnp.cos(ang_BSf)[:, :, None, :]
    x = x_BSHd.astype(acc)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSHd.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMS norm over the last axis, float32 statistics (float64 for float64), learned ``scale``.

    Args:
        x: the array to normalize over its last axis.
        scale: the learned scale, shape ``x.shape[-1:]``.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        The normalized, scaled array in ``x``'s dtype.
    """
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = scale.astype(acc).reshape((1,) * (x.ndim - 1) + scale.shape)
    return (y * scale).astype(x.dtype)
