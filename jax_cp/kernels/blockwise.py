"""The portable kernel: blockwise online softmax in plain JAX (``jax_cp.kernels._blockwise``), every mask,
every platform, memory linear in the sequence; returns the log-sum-exp a ring step merges."""
from __future__ import annotations

from jax_cp.kernels._blockwise import blockwise_attention
from jax_cp.kernels._base import Kernel, register

__all__ = ["Blockwise"]


@register
class Blockwise(Kernel):
    """``blockwise``: serves every call."""

    name = "blockwise"
    merges_lse = True
    takes_spans = True

    def attend(self, q_BTHd, k_BSKd, v_BSKd, *, block_q=None, block_kv=None, return_max_logits=False,
               return_residual=False, natural_positions=False, **kw):
        return blockwise_attention(q_BTHd, k_BSKd, v_BSKd, **kw, block_q=block_q, block_kv=block_kv,
                                   return_max_logits=return_max_logits, return_residual=return_residual,
                                   fused=self.fused)
