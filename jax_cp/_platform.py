"""The platform being compiled for: the ground floor every kernel choice reads."""
from __future__ import annotations

import jax

__all__ = ["target_platform"]


def target_platform() -> str:
    """The platform being compiled for.

    Inside ``jax.shard_map`` the mesh's devices decide (so ahead-of-time
    compiles for TPU topology devices select TPU kernels); elsewhere the
    default backend. ``"gpu"`` for CUDA/ROCm.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform
