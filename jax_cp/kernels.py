"""Local attention kernels: what each device runs after the collectives.

Every kernel takes explicit global positions (never ``arange``), optional segment ids and window,
in BSHd layout with grouped kv heads. ``local_attention`` runs the kernel ``select_kernel`` picks
(``KERNELS``); ``describe`` says which kernel a call runs and why (it lives beside the ``auto`` rule,
which also weighs the K/V exchange).
"""
from jax_cp._defaults import describe
from jax_cp._kernels import (KERNELS, auto_blocks, blockwise_attention, check_block, check_kernel, check_sinks,
                             check_soft_cap, cudnn_attention, dense_attention, local_attention, select_kernel,
                             splash_attention, target_platform)

__all__ = [
    "KERNELS", "auto_blocks", "blockwise_attention", "check_block", "check_kernel", "check_sinks", "check_soft_cap",
    "cudnn_attention", "dense_attention", "describe", "local_attention", "select_kernel", "splash_attention",
    "target_platform",
]
