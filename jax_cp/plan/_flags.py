"""Recommended XLA flags that let collectives run asynchronously under compute.

TPU flags go to libtpu through ``LIBTPU_INIT_ARGS``; GPU flags go to XLA through
``XLA_FLAGS``. Both are read once, when the backend first compiles, so apply
them at the very start of the program (before the first ``jax.jit`` call).
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping

__all__ = ["PLATFORMS", "FLAG_ENV", "recommended_xla_flags", "apply_recommended_flags"]

PLATFORMS = ("tpu", "gpu")
FLAG_ENV = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}

_TPU_FLAGS = (
    # all-to-all is synchronous on TPU unless asked: the Ulysses exchange needs this one.
    "--xla_tpu_enable_async_all_to_all=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_reduce_scatter_fusion=true",
    "--xla_enable_async_all_reduce=true",
    "--xla_enable_async_collective_permute=true",
    # Async collective fusion: all-gather / reduce-scatter run in steps fused with matmuls.
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
)

_GPU_FLAGS = (
    # The scheduler that moves collective starts early and dones late, around compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Collectives on a high-priority stream, so they are not starved by compute kernels.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # Across scanned layers: move a layer's collectives into the previous iteration.
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


def _check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} must be one of {PLATFORMS}.")
    return platform


def recommended_xla_flags(platform: str = "tpu") -> tuple[str, ...]:
    """The flags (``--name=value`` strings) we recommend for ``platform``.

    On TPU they make all-to-all, all-gather, reduce-scatter, all-reduce and
    collective-permute asynchronous so XLA's latency-hiding scheduler can place
    matmuls between start and done. On GPU they enable that scheduler and
    pipelining of collectives across layers. All names were checked against
    jaxlib 0.10.2 / libtpu 0.0.52; unknown flags make XLA abort at start-up.
    """
    return _TPU_FLAGS if _check_platform(platform) == "tpu" else _GPU_FLAGS


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merge_flags(existing: str, flags: tuple[str, ...]) -> str:
    """Appends ``flags`` to the ``existing`` flag string; flags already set there win."""
    present = {_flag_name(f) for f in existing.split()}
    added = [f for f in flags if _flag_name(f) not in present]
    return " ".join([*existing.split(), *added])


def apply_recommended_flags(
    platform: str = "tpu", *, environ: MutableMapping[str, str] | None = None
) -> str:
    """Adds the recommended flags to ``LIBTPU_INIT_ARGS`` (TPU) or ``XLA_FLAGS`` (GPU).

    Flags the user already set keep their value. Returns the new variable's
    value. Has effect only before the backend's first compilation in this
    process (libtpu and XLA read the variable once).
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    name = FLAG_ENV[_check_platform(platform)]
    env[name] = merge_flags(env.get(name, ""), recommended_xla_flags(platform))
    return env[name]


def flag_string(platform: str, environ: Mapping[str, str] | None = None) -> str:
    """The flag variable's current value for ``platform`` (what a report records)."""
    env = os.environ if environ is None else environ
    return env.get(FLAG_ENV[_check_platform(platform)], "")
