"""Recommended XLA flags that let collectives run asynchronously under compute.

Two ways to apply them: process-wide, through ``LIBTPU_INIT_ARGS`` (TPU) or
``XLA_FLAGS`` (GPU), read once when the backend starts, so set them first thing
(``apply_recommended_flags``); or per program, as
``jax.jit(f).lower(...).compile(compiler_options=compiler_options(flags))``,
which the planner uses so one process can compile for several chips.
"""
from __future__ import annotations

import importlib.util
import os
from typing import MutableMapping

__all__ = ["PLATFORMS", "FLAG_ENV", "recommended_xla_flags", "apply_recommended_flags", "apply_for_this_host",
           "compiler_options"]

PLATFORMS = ("tpu", "gpu")
FLAG_ENV = {"tpu": "LIBTPU_INIT_ARGS", "gpu": "XLA_FLAGS"}

_TPU_FLAGS = (
    # all-to-all is synchronous on TPU unless asked: the Ulysses exchange needs this one.
    "--xla_tpu_enable_async_all_to_all=true",
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_reduce_scatter_fusion=true",
    "--xla_enable_async_all_reduce=true",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
)
# Async collective fusion: an all-gather continued step by step inside the fusions of the
# matmuls that follow it. libtpu 0.0.52 supports it on v5e only and refuses to compile
# ("Continuation fusion for AllGather ... not supported ... other than TPU v5e") elsewhere.
_TPU_V5E_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    # The same continuation for all-reduce: tp's backward activation sums and the head's gradient sum
    # run inside the matmuls that follow them (v5e has no SparseCores to offload them to); the exposed
    # communication of a planned step falls (benchmarks/RESULTS.md, a whole training step).
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
)
# v5p (libtpu 0.0.52): with the default scheduler features, XLA front-loads the projections and
# leaves half the all-to-alls with nothing inside; this one switch hides them (benchmarks/RESULTS.md).
# On v5e it changes no schedule we compiled, so it stays v5p-only.
_TPU_V5P_FLAGS = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true",
    # v5p has no async all-gather fusion (above); offloaded to the SparseCores an all-gather runs
    # asynchronously beside the TensorCore's matmuls.
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    # The same for all-reduce: the gradient sums over the CP axes and tp's backward activation sums,
    # synchronous on the TensorCore in every v5p schedule we read, run on the SparseCores beside the
    # matmuls (the forward tp sums become asynchronous too, but half have nothing to run beside);
    # the exposed communication of a planned step falls (benchmarks/RESULTS.md, a whole training step).
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
)
# v5p with FSDP (parameters stored sharded, gathered for each layer, gradients reduce-scattered): the
# SparseCores also take the reduce-scatters and the all-gathers over two mesh axes (cp_colossal x
# cp_ulysses), synchronous on the TensorCore without them. The 8B step on v5p:4x4x4 at 32K, 8 scanned
# layers: exposed communication 15.0 -> 10.5 ms with FSDP; replicated weights 10.8 -> 12.2 ms, so these
# stay FSDP-only (benchmarks/RESULTS.md, "Beside MaxText").
_TPU_V5P_FSDP_FLAGS = (
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
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


def recommended_xla_flags(platform: str = "tpu", *, chip: str | None = None, fsdp: bool = False) -> tuple[str, ...]:
    """The flags (``--name=value`` strings) we recommend for ``platform``.

    On TPU they make all-to-all, all-gather, reduce-scatter, all-reduce and
    collective-permute asynchronous so XLA's latency-hiding scheduler can place
    matmuls between start and done; ``chip="v5e"`` adds async collective
    fusion, which libtpu supports on v5e only, ``chip="v5p"`` the scheduler
    features that hide all-to-alls there and SparseCore offload of all-gather and
    all-reduce (the training step's gradient sums; ``chip=None``: the flags safe
    on every generation), and with ``fsdp`` also of reduce-scatter and two-axis
    all-gather (an FSDP step's weight gathers and gradient reduce-scatters). On
    GPU they enable that scheduler and pipelining of collectives across layers. All names were checked against jaxlib 0.10.2 /
    libtpu 0.0.52; unknown flags make XLA abort at start-up.

    Args:
        platform: ``"tpu"`` or ``"gpu"``.
        chip: the TPU generation (``"v5e"``, ``"v5p"``, ...); ``None``: the flags safe on
            every generation.
        fsdp: the programs store parameters sharded over the data and CP axes (``models.train
            --fsdp``); adds the v5p flags that help such a step and cost a replicated one.

    Returns:
        The flags, ``--name=value`` strings.
    """
    if _check_platform(platform) == "gpu":
        return _GPU_FLAGS
    extra = _TPU_V5P_FSDP_FLAGS if fsdp and chip == "v5p" else ()
    return _TPU_FLAGS + {"v5e": _TPU_V5E_FLAGS, "v5p": _TPU_V5P_FLAGS}.get(chip, ()) + extra


def compiler_options(flags: tuple[str, ...]) -> dict[str, bool | int | str]:
    """``("--name=true", ...)`` -> ``{"name": True, ...}`` for ``jitted.lower(...).compile(compiler_options=...)``.

    Per-compile options override the process-wide flag variable for that one
    program (libtpu honours its own flags this way too), so one process can
    compile for several chips with different flags.

    Args:
        flags: ``--name=value`` strings.

    Returns:
        ``{name: value}`` with booleans and integers parsed.
    """
    out: dict[str, bool | int | str] = {}
    for flag in flags:
        name, _, value = flag.lstrip("-").partition("=")
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
        else:
            try:
                out[name] = int(value)
            except ValueError:
                out[name] = value
    return out


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merge_flags(existing: str, flags: tuple[str, ...]) -> str:
    """Appends ``flags`` to the ``existing`` flag string; flags already set there win."""
    present = {_flag_name(f) for f in existing.split()}
    added = [f for f in flags if _flag_name(f) not in present]
    return " ".join([*existing.split(), *added])


def apply_recommended_flags(
    platform: str = "tpu", *, chip: str | None = None, fsdp: bool = False,
    environ: MutableMapping[str, str] | None = None
) -> str:
    """Adds the recommended flags to ``LIBTPU_INIT_ARGS`` (TPU) or ``XLA_FLAGS`` (GPU).

    Flags the user already set keep their value. Has effect only before the backend's first
    compilation in this process (libtpu and XLA read the variable once).

    Args:
        platform, chip, fsdp: as :func:`recommended_xla_flags`.
        environ: the environment to change (default ``os.environ``).

    Returns:
        The new variable's value.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    name = FLAG_ENV[_check_platform(platform)]
    env[name] = merge_flags(env.get(name, ""), recommended_xla_flags(platform, chip=chip, fsdp=fsdp))
    return env[name]


# TPU_ACCELERATOR_TYPE on Cloud TPU VMs (e.g. "v5litepod-16", "v5p-128", "v6e-8") -> chip name.
_ACCELERATOR_CHIPS = (("v5lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6e", "v6e"), ("v4", "v4"))


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(m) is not None for m in modules)


def apply_for_this_host(environ: MutableMapping[str, str] | None = None, *,
                        fsdp: bool = False) -> tuple[str, str] | None:
    """Before JAX starts: the recommended flags for the accelerator this host will use, if any.

    TPU when the ``libtpu`` wheel is installed (the chip from ``TPU_ACCELERATOR_TYPE``;
    unknown: the flags safe on every generation), GPU when a JAX CUDA plugin is; nothing
    when ``JAX_PLATFORMS`` names neither (e.g. ``cpu``).

    Args:
        environ: the environment to read and change (default ``os.environ``).
        fsdp: as :func:`recommended_xla_flags`.

    Returns:
        ``(variable, value)``, or None when nothing was applied.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    wanted = env.get("JAX_PLATFORMS", "").lower()
    if wanted and not any(p in wanted for p in ("tpu", "cuda", "gpu", "rocm")):
        return None
    if (not wanted or "tpu" in wanted) and _installed("libtpu"):
        kind = env.get("TPU_ACCELERATOR_TYPE", "").lower()
        chip = next((name for key, name in _ACCELERATOR_CHIPS if kind.startswith(key)), None)
        return FLAG_ENV["tpu"], apply_recommended_flags("tpu", chip=chip, fsdp=fsdp, environ=env)
    if _installed("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"):
        return FLAG_ENV["gpu"], apply_recommended_flags("gpu", environ=env)
    return None
