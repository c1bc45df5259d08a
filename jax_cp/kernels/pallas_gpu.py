"""The fused GPU kernel: blockwise's algorithm as Pallas (Triton) kernels (``jax_cp.kernels._pallas_gpu``),
every mask as data; off a GPU it runs in Pallas interpret mode (for tests)."""
from __future__ import annotations

from jax_cp.kernels import _pallas_gpu
from jax_cp.kernels.blockwise import Blockwise
from jax_cp.kernels._base import register

__all__ = ["PallasGPU"]


@register
class PallasGPU(Blockwise):
    """``pallas_gpu``: blockwise's contract, forward and backward as fused Pallas GPU kernels."""

    name = "pallas_gpu"
    fused = (_pallas_gpu.forward, _pallas_gpu.backward)

    def unsupported_reason(self, *, head_dim: int, v_head_dim: int | None = None, **_) -> str | None:
        return _pallas_gpu.unsupported_reason(head_dim=head_dim, v_head_dim=v_head_dim)
