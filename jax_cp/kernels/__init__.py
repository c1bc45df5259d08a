"""Local attention kernels as values: what each device runs after the collectives.

Every kernel takes explicit global positions (never ``arange``), optional segment ids and window,
in BSHd layout with grouped kv heads. One value per file: ``BLOCKWISE`` (portable), ``SPLASH`` (TPU),
``PALLAS_GPU`` and ``CUDNN`` (GPU), ``DENSE`` (``"xla"``, the scores materialised). ``resolve`` is the
one place a name becomes a value; ``select_kernel`` is the ``"auto"`` rule and checks an explicit
choice; ``local_attention`` runs the selection on one device's share. (``jax_cp.describe_kernel``,
beside the layer's ``auto`` rule, says which kernel a call runs and why.)
Letters: B batch, T queries, S keys, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

from jax_cp._masks import normalize_window
from jax_cp._platform import target_platform
from jax_cp._softmax import check_sinks, check_soft_cap, varying_sinks
from jax_cp.kernels._blockwise import auto_blocks, blockwise_attention, check_block
from jax_cp.kernels._splash import splash_attention
from jax_cp.kernels._base import AUTO, REGISTRY, Kernel, resolve, scaled_query
from jax_cp.kernels.blockwise import Blockwise
from jax_cp.kernels.dense import Dense, dense_attention
from jax_cp.kernels.splash import Splash
from jax_cp.kernels.cudnn import CuDNN, cudnn_attention
from jax_cp.kernels.pallas_gpu import PallasGPU

__all__ = [
    "AUTO", "BLOCKWISE", "CUDNN", "DENSE", "IMPLEMENTATIONS", "KERNELS", "Kernel", "PALLAS_GPU", "SPLASH",
    "auto_blocks", "blockwise_attention", "check_block", "check_sinks", "check_soft_cap",
    "cudnn_attention", "dense_attention", "from_implementation", "local_attention", "resolve", "scaled_query",
    "select_kernel", "splash_attention", "target_platform",
]

BLOCKWISE, DENSE, SPLASH, CUDNN, PALLAS_GPU = (REGISTRY[k.name] for k in (Blockwise, Dense, Splash, CuDNN, PallasGPU))
KERNELS = (AUTO, *REGISTRY)  # the names the public arguments take
# jax.nn.dot_product_attention's ``implementation=`` values and the kernel each names.
IMPLEMENTATIONS = {None: AUTO, "xla": DENSE, "cudnn": CUDNN}


def from_implementation(implementation, kernel) -> Kernel | str:
    """jax.nn's ``implementation=`` as the kernel it names; one of the two may be given.

    Args:
        implementation: jax.nn's value (``None``, ``"xla"``, ``"cudnn"``).
        kernel: the ``kernel=`` the caller passed.

    Returns:
        ``kernel`` when ``implementation`` is ``None``, else the kernel ``implementation`` names.

    Raises:
        ValueError: ``implementation`` is not one of jax.nn's values, or both are given.
    """
    if implementation is None:
        return kernel
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {tuple(IMPLEMENTATIONS)} (jax.nn's values; "
                         f"or pass kernel=, one of {KERNELS}).")
    if kernel != AUTO:
        raise ValueError(f"implementation={implementation!r} and kernel={kernel!r} both choose the kernel; pass one.")
    return IMPLEMENTATIONS[implementation]


def select_kernel(kernel, *, platform: str, is_causal: bool, window, has_segments: bool, dtype, head_dim: int,
                  soft_cap: bool = False, sinks: bool = False, max_logits: bool = False, residual: bool = False,
                  v_head_dim: int | None = None, kv_len: int | None = None, spans: bool = False) -> Kernel:
    """Resolves ``"auto"`` and checks that an explicit choice can serve the mask.

    ``"auto"``: splash on TPU; on GPU cuDNN when the mask is expressible there, else the fused
    Pallas GPU kernel (positions, segments, windows as data); blockwise otherwise. Explicit splash
    off TPU and pallas_gpu off GPU run Pallas interpret mode (slow, for tests); explicit cuDNN needs
    a GPU.

    Args:
        kernel: ``"auto"``, a kernel name or a :class:`Kernel` value.
        platform: the target platform (``"tpu"``, ``"gpu"``, ``"cpu"``).
        is_causal, window, has_segments: the mask.
        dtype, head_dim, v_head_dim: the inputs' dtype and head sizes.
        soft_cap, sinks, max_logits, residual: whether the call uses a logit soft cap, sinks,
            returns the max logits, returns the residual.
        kv_len: keys per kernel call (splash takes windows over at most
            ``_splash.MAX_WINDOW_KEYS``; ``None``: not known, assumed to fit).
        spans: span ids are given (blockwise, splash, pallas_gpu and ``"xla"`` take them; splash over at most
            ``_splash.MAX_WINDOW_KEYS`` keys a call).

    Returns:
        The :class:`Kernel` to run.

    Raises:
        ValueError: the name is unknown, or an explicit choice cannot serve the call.
    """
    kernel = resolve(kernel)
    needs = dict(is_causal=is_causal, window=window, has_segments=has_segments, dtype=dtype, head_dim=head_dim,
                 soft_cap=soft_cap, sinks=sinks, max_logits=max_logits, residual=residual, v_head_dim=v_head_dim,
                 kv_len=kv_len, spans=spans)
    if kernel != AUTO:
        kernel.check(platform=platform, **needs)
        return kernel
    for candidate, where in ((SPLASH, "tpu"), (CUDNN, "gpu"), (PALLAS_GPU, "gpu")):
        if platform == where and candidate.why_not(**needs) is None:
            return candidate
    return BLOCKWISE


def local_attention(
    q_BTHd, k_BSKd, v_BSKd, *, kernel=AUTO, q_positions, kv_positions, q_segment_ids=None,
    kv_segment_ids=None, is_causal=False, local_window_size=None, scale=None, block_q=None, block_kv=None,
    logits_soft_cap=None, sinks=None, return_max_logits: bool = False, return_residual: bool = False,
    natural_positions: bool = False, q_span_ids=None, kv_span_ids=None,
):
    """Runs the selected kernel (see ``KERNELS``, ``select_kernel``) on one device's share.

    Args:
        q_BTHd, k_BSKd, v_BSKd: the local queries, keys and values.
        kernel: ``"auto"``, a kernel name or value (:func:`select_kernel`).
        q_positions, kv_positions: global positions of the queries and keys.
        q_segment_ids, kv_segment_ids: document ids of the queries and keys (or None).
        is_causal, local_window_size, scale, logits_soft_cap: the mask (the window's bounds
            inclusive, as jax.nn's), the scale (a traced one is multiplied into the queries:
            :func:`scaled_query`) and soft cap.
        block_q, block_kv: the blockwise kernel's tiles (``None``: ``auto_blocks``); the
            platform kernels choose their own.
        sinks: ``[H]`` per-query-head sink logits (or None).
        return_max_logits, return_residual: also return ``max_logits [H]`` and/or the
            log-sum-exp ``[B, T, H]`` (blockwise, pallas_gpu and ``"xla"`` only).
        natural_positions: both sides' positions are ``arange(S)`` (self-attention, no segment
            ids): splash then builds its mask when traced instead of sorting keys at run time;
            the other kernels read the positions.
        q_span_ids, kv_span_ids: bidirectional span ids (0: none; every kernel but cuDNN), or None.

    Returns:
        ``o`` ``[B, T, H, dv]``, then ``max_logits`` and/or the log-sum-exp when asked.
    """
    window = normalize_window(local_window_size)
    q_BTHd, scale = scaled_query(q_BTHd, scale)
    chosen = select_kernel(kernel, platform=target_platform(), is_causal=is_causal, window=window,
                           has_segments=q_segment_ids is not None, dtype=q_BTHd.dtype, head_dim=q_BTHd.shape[-1],
                           soft_cap=logits_soft_cap is not None, sinks=sinks is not None,
                           max_logits=return_max_logits, residual=return_residual, v_head_dim=v_BSKd.shape[-1],
                           kv_len=k_BSKd.shape[1], spans=q_span_ids is not None)
    sinks = varying_sinks(sinks, q_BTHd, k_BSKd, v_BSKd, q_positions, kv_positions)
    return chosen.attend(q_BTHd, k_BSKd, v_BSKd, q_positions=q_positions, kv_positions=kv_positions,
                         q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, is_causal=is_causal,
                         local_window_size=window, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                         block_q=block_q, block_kv=block_kv, return_max_logits=return_max_logits,
                         return_residual=return_residual, natural_positions=natural_positions,
                         **({} if q_span_ids is None else dict(q_span_ids=q_span_ids, kv_span_ids=kv_span_ids)))
