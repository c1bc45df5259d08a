"""What every K/V exchange is: a frozen value with its collective, attend step and constraints.

An exchange moves K and V across ``cp_colossal`` so that each device's queries
(its contiguous colossal chunk, after the Ulysses all-to-all) meet every key.
Subclasses state the collective (with its ``jax.custom_vjp`` backward) and
``attend``; the defaults here are what most exchanges share.
Letters: B batch, T local queries (S/c), S keys, H local query heads, K local kv heads, d head dim.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jax_cp import kernels as _kernels
from jax_cp._meta import Meta
from jax_cp._mesh import COLOSSAL, ULYSSES, seq_chunk
from jax_cp._ulysses import seq_to_heads
from jax_cp.kernels import _dense

__all__ = ["KVExchange", "Meta", "attend_gathered", "pair_kv", "register", "REGISTRY"]

REGISTRY: list["KVExchange"] = []


def register(cls):
    """Class decorator: one instance of ``cls`` joins the exchanges the public strings name."""
    REGISTRY.append(cls())
    return cls


@dataclasses.dataclass(frozen=True)
class KVExchange:
    """Base of the K/V exchanges (``jax_cp.exchanges.AllGather``, ``AllToAll``, ``Ring``)."""

    name: ClassVar[str]
    fuses_qkv: ClassVar[bool] = True  # Q, K and V may share one Ulysses all-to-all (fused_qkv_chunks)
    ties_chunks: ClassVar[bool] = True  # the chunk-to-chunk gradient tie helps on hybrid layouts
    no_fuse_reason: ClassVar[str] = ""
    supplies_segments: ClassVar[bool] = False  # its kernel calls always get segment ids (the kernel rule must know)

    def __str__(self) -> str:
        return self.name

    def check_kernel(self, kernel: str) -> None:
        """Raises a ValueError if this exchange's attend step cannot run ``kernel``."""

    def keys_per_call(self, seq_len: int, c: int) -> int:
        """The keys one local kernel call sees on a layer of ``seq_len`` keys over ``c`` colossal ranks
        (a kernel's limits, e.g. splash's windows, depend on it): every key, once exchanged."""
        return seq_len

    def step_kernel(self, chosen: str) -> tuple[str, str]:
        """``(kernel, why)``: what this exchange's steps run when the local selection (``"auto"``)
        chose ``chosen``, and why it differs (``""`` when it does not)."""
        return chosen, ""

    def attend(self, q_BTHd, k_BTKd, v_BTKd, meta: Meta, spec, sinks=None):
        """Per device: queries and K/V of the colossal chunk (heads split) -> ``o [B, T, H, d]``;
        ``sinks [H]``: the device's query heads' sink logits (joining the softmax once), or None.
        With ``spec.record_max_logits`` / ``spec.return_residual``: ``o`` followed by ``max_logits [H]``
        and/or the log-sum-exp ``[B, T, H]`` of the device's queries."""
        raise NotImplementedError

    def reference(self, q_BTHd, k_BSKd, v_BSKd, q_meta: Meta, kv_meta: Meta, spec):
        """What ``attend`` computes, written plainly: the device's queries (their positions and
        segment ids in ``q_meta``) against every key of the global ``k, v [B, S, K, d]``."""
        return _dense.attend(q_BTHd, k_BSKd, v_BSKd, q_positions=q_meta.pos, kv_positions=kv_meta.pos,
                                q_segment_ids=q_meta.seg, kv_segment_ids=kv_meta.seg, is_causal=spec.is_causal,
                                local_window_size=spec.local_window_size, scale=spec.scale,
                                q_span_ids=q_meta.span, kv_span_ids=kv_meta.span)

    def attend_local(self, q_BTHd, k_BtKd, v_BtKd, meta: Meta, spec, sinks=None):
        """As ``attend``, with K/V still on the device's own tokens ``[B, S/(c*u), ...]``:
        K and V cross ``cp_ulysses`` in one all-to-all first."""
        k, v = seq_to_heads((k_BtKd, v_BtKd), ULYSSES)
        return self.attend(q_BTHd, k, v, meta, spec, sinks)


def pair_kv(k_BTKd, v_BTKd):
    """K and V as one tensor for one collective: stacked on axis 2 (``[B, T, 2, K, d]``), or, when
    their head dims differ (MLA), joined along it (``[B, T, 1, K, d_k + d_v]``)."""
    if k_BTKd.shape == v_BTKd.shape:
        return jnp.stack([k_BTKd, v_BTKd], axis=2)
    return jnp.concatenate([k_BTKd, v_BTKd], axis=-1)[:, :, None]


def _unpair_kv(kv, d_k: int):
    if kv.shape[2] == 2:
        return kv[:, :, 0], kv[:, :, 1]
    return kv[:, :, 0, :, :d_k], kv[:, :, 0, :, d_k:]


def attend_gathered(q_BTHd, kv_BS2Kd, meta: Meta, spec, sinks=None):
    """The local kernel on the colossal chunk of queries and every token's K and V (``pair_kv``'d)."""
    pos, seg = seq_chunk(meta.pos, (COLOSSAL,)), seq_chunk(meta.seg, (COLOSSAL,))
    k, v = _unpair_kv(kv_BS2Kd, q_BTHd.shape[-1])
    natural = meta.natural and jax.lax.axis_size(COLOSSAL) == 1  # every query and key: positions arange(S)
    return _kernels.local_attention(
        q_BTHd, k, v, kernel=spec.kernel, q_positions=pos,
        kv_positions=meta.keys_pos, q_segment_ids=seg, kv_segment_ids=meta.keys_seg, is_causal=spec.is_causal,
        local_window_size=spec.local_window_size, scale=spec.scale, block_q=spec.block_q, block_kv=spec.block_kv,
        logits_soft_cap=spec.logits_soft_cap, sinks=sinks, return_max_logits=spec.record_max_logits,
        return_residual=spec.return_residual, natural_positions=natural,
        **({} if meta.span is None else dict(q_span_ids=seq_chunk(meta.span, (COLOSSAL,)), kv_span_ids=meta.keys_span)),
    )
