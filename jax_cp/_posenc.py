"""Per-token, per-head transforms: rotary position embedding and RMS norm.

Both act on ``[B, S, H, d]`` with explicit global positions, so they give the
same result before or after the Ulysses all-to-all.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RoPE", "apply_rope", "rms_norm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoPE:
    """Rotary frequencies from a base ``theta``, optionally stretched for a longer context than trained.

    A value (hashable) that stands wherever a ``rope_theta`` float does: ``CPAttention(rope_theta=
    RoPE(theta=500_000.0, factor=8.0, ...))``. ``factor`` alone divides every frequency by it (linear
    scaling, i.e. position interpolation: Hugging Face's ``rope_type: linear``, Gemma 3's global
    layers). With ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``
    as well, Llama 3.1's rule (``rope_type: llama3``): wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and those
    between are interpolated smoothly.

    Attributes:
        theta: the base.
        factor: the context stretch (1: none).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: Llama 3's bands (all
            three or none).

    Raises:
        ValueError: a field is out of range, or only some of Llama 3's fields are given.
    """

    theta: float
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(f"RoPE(theta={self.theta}, factor={self.factor}) needs theta > 0 and factor > 0.")
        bands = (self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings)
        if any(b is not None for b in bands) and not all(b is not None for b in bands):
            raise ValueError(f"RoPE low_freq_factor={bands[0]}, high_freq_factor={bands[1]}, "
                             f"original_max_position_embeddings={bands[2]}: Llama 3 scaling needs all three "
                             "(or none of them for linear scaling by factor).")
        if self.llama3 and not (0 < self.low_freq_factor < self.high_freq_factor
                                and self.original_max_position_embeddings > 0):
            raise ValueError(f"RoPE low_freq_factor={self.low_freq_factor}, high_freq_factor="
                             f"{self.high_freq_factor}, original_max_position_embeddings="
                             f"{self.original_max_position_embeddings}: need 0 < low_freq_factor < "
                             "high_freq_factor and original_max_position_embeddings > 0.")

    @property
    def llama3(self) -> bool:
        """Whether Llama 3's band rule applies (else linear scaling by ``factor``)."""
        return self.original_max_position_embeddings is not None

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The ``head_dim // 2`` angular frequencies (float64, computed on the host)."""
        inv = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if not self.llama3:
            return inv / self.factor
        wavelen = 2 * math.pi / inv
        old = self.original_max_position_embeddings
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        between = (1 - smooth) * inv / self.factor + smooth * inv
        out = np.where(wavelen > old / self.low_freq_factor, inv / self.factor, between)
        return np.where(wavelen < old / self.high_freq_factor, inv, out)


def apply_rope(x_BSHd: jax.Array, pos_BS: jax.Array, theta: float | RoPE) -> jax.Array:
    """Rotary embedding (half-split convention) at the given global positions.

    Args:
        x_BSHd: ``[B, S, H, d]`` queries or keys.
        pos_BS: ``[B, S]`` global positions.
        theta: the RoPE base, or a :class:`RoPE` (scaled frequencies).

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
    if isinstance(theta, RoPE):
        freq = jnp.asarray(theta.inv_freq(d), acc)
    else:
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
