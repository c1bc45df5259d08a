"""What a rematerialised layer may keep of its attention: the kernels' outputs, by name.

Every attention kernel's forward rule (splash, blockwise, Pallas GPU, both rings) names its output
and log-sum-exp ``ATTENTION_RESIDUALS`` with ``jax.ad_checkpoint.checkpoint_name``. Under
``jax.checkpoint(..., policy=save_attention_residuals)`` those two are kept from the forward pass,
so the backward pass recomputes the layer's projections (and their exchanges) but not the
attention itself: at long context, where the kernels are most of a step's FLOPs, about two ninths
of the attention's work, for one ``[B, T, H, d]`` output and one ``[B, H, T]`` float32 statistic a
layer. The dense and cuDNN kernels keep nothing by this name (their residuals are not ours).
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["ATTENTION_RESIDUALS", "save_attention_residuals", "name_attention_residuals"]

ATTENTION_RESIDUALS = "jax_cp_attention_residuals"

_SAVE = jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)


def save_attention_residuals(prim, *avals, **params):
    """A ``jax.checkpoint`` policy that keeps the attention kernels' output and log-sum-exp and nothing
    else: ``jax.checkpoint(layer, policy=jax_cp.save_attention_residuals)``. Combine it with others by
    ``jax.checkpoint_policies.save_from_both_policies``.

    Args:
        prim: the primitive ``jax.checkpoint`` asks about.
        *avals: its operands' abstract values.
        **params: its parameters.

    Returns:
        Whether its output is kept: true for the values named ``ATTENTION_RESIDUALS`` only.
    """
    return _SAVE(prim, *avals, **params)


def name_attention_residuals(*xs):
    """``xs`` named ``ATTENTION_RESIDUALS`` (an identity outside ``jax.checkpoint``)."""
    return tuple(checkpoint_name(x, ATTENTION_RESIDUALS) for x in xs)
