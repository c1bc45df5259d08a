"""GPU cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN masks are index patterns (causal, window, padding lengths); they cannot
follow explicit positions or segment ids, so only unmasked attention is served.
Letters: B batch, T queries, S keys, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp.kernels._base import REGISTRY, Kernel, register

__all__ = ["CuDNN", "cudnn_attention", "cudnn_unsupported_reason"]

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cudnn_unsupported_reason(*, is_causal, window, has_segments, dtype, head_dim, soft_cap=False,
                             sinks=False, max_logits=False, residual=False, v_head_dim=None) -> str | None:
    """Why cuDNN cannot serve this call (``None`` when it can)."""
    if v_head_dim not in (None, head_dim):
        return f"a value head dim ({v_head_dim}) other than the query/key head dim ({head_dim}) is not served here"
    if residual:
        return "return_residual is not served by jax_cp's cuDNN call"
    if max_logits:
        return "jax.nn.dot_product_attention's cuDNN path does not return the max-logit statistic"
    if soft_cap:
        return "logits_soft_cap is not an option of jax.nn.dot_product_attention's cuDNN path"
    if sinks:
        return "attention sinks are not an option of jax.nn.dot_product_attention's cuDNN path"
    if is_causal:
        return "is_causal=True over explicit positions is not a cuDNN index mask"
    if window is not None:
        return f"local_window_size={window} over explicit positions is not a cuDNN index mask"
    if has_segments:
        return "segment_ids are not expressible as a cuDNN mask"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype={jnp.dtype(dtype)} is not bfloat16/float16"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim={head_dim} is not a multiple of 8 that is <= 128"
    return None


def cudnn_attention(q_BTHd, k_BSKd, v_BSKd, *, scale=None, **_unused_mask):
    """Unmasked attention on cuDNN (positions are irrelevant without a mask).

    Args:
        q_BTHd, k_BSKd, v_BSKd: the local queries, keys and values.
        scale: the logit scale (``None``: ``d**-0.5``, jax.nn's default).

    Returns:
        ``jax.nn.dot_product_attention(..., implementation="cudnn")``'s output.
    """
    return jax.nn.dot_product_attention(q_BTHd, k_BSKd, v_BSKd, scale=scale, implementation="cudnn")


@register
class CuDNN(Kernel):
    """``cudnn``: unmasked attention on a CUDA GPU; a ring step runs the Pallas GPU kernel instead
    (cuDNN returns no log-sum-exp)."""

    name = "cudnn"
    label = "cuDNN"

    def unsupported_reason(self, *, is_causal=False, window=None, has_segments=False, dtype=jnp.bfloat16,
                           head_dim=128, soft_cap=False, sinks=False, max_logits=False, residual=False,
                           v_head_dim=None, **_) -> str | None:
        return cudnn_unsupported_reason(is_causal=is_causal, window=window, has_segments=has_segments, dtype=dtype,
                                        head_dim=head_dim, soft_cap=soft_cap, sinks=sinks, max_logits=max_logits,
                                        residual=residual, v_head_dim=v_head_dim)

    def check(self, *, platform: str, **needs) -> None:
        if platform != "gpu":
            raise ValueError(f"kernel='cudnn' needs a CUDA GPU, but the target platform is {platform!r}; "
                             "use kernel='auto' or 'blockwise'.")
        super().check(platform=platform, **needs)

    def ring_step(self) -> Kernel:
        return REGISTRY["pallas_gpu"]

    def attend(self, q_BTHd, k_BSKd, v_BSKd, *, scale=None, **_):
        return cudnn_attention(q_BTHd, k_BSKd, v_BSKd, scale=scale)
