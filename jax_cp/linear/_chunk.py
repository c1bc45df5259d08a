"""Chunked forms of the gated delta rule and of Mamba-2's SSD: what each chunk computes alone.

A chunk of ``C`` tokens holds runs (a run starts at the chunk's start and at each token that does
not continue the one before it). For the state ``X`` a run starts from, each token's output is affine:
``o_t = o_intra_t + q_eff_t X^T``, and the state after token ``tau`` is ``X A_tau + B_tau``
(:func:`maps_at`). The delta rule solves its chunk's triangular system once (flash-linear-attention's
WY/UT form: ``W = (I + diag(beta) L)^{-1} diag(beta) [V, K exp(G)]``); Mamba-2 writes ``dt x B^T``
with a scalar decay, so its ``A`` is ``[1, 1]``. All float32; gates cumulate within each chunk.
Letters: B batch, H heads, N chunks, C chunk length, k key dim (Mamba-2's n), v value dim (its p),
d gate width (1, or k for per-channel gates), M selected chunks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_cp.linear._products import scaled
from jax_cp.linear._topology import running

__all__ = ["Intra", "Runs", "decayed", "gdn_intra", "k_bar_at", "maps_at", "runs", "ssd_intra", "unit_lower_inverse"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs inside each chunk: ``run [B, N, C]`` (0 for the run open at the chunk's start) and
    ``head [B, N, C]`` the offset of each token's run head."""

    run: jax.Array
    head: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Intra:
    """A chunk's own part (``[B, H, N, C, *]``): ``o_intra``, ``q_eff`` (outputs), and what
    :func:`maps_at` reads: ``w_k`` (``None`` for Mamba-2), ``w_v``, ``k``, cumulative gates ``G`` and
    run-relative ``Gr`` (``[..., d]``), the ``runs``."""

    o_intra: jax.Array
    q_eff: jax.Array
    w_k: jax.Array | None
    w_v: jax.Array
    k: jax.Array
    G: jax.Array
    Gr: jax.Array
    runs: Runs


def runs(heads_BNC) -> Runs:
    """``Runs`` from ``heads [B, N, C]`` (True where a token starts a run; offset 0 always does)."""
    C = heads_BNC.shape[-1]
    t = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), heads_BNC.shape)
    heads = heads_BNC | (t == 0)
    return Runs(run=running(jnp.add, heads.astype(jnp.int32)) - 1, head=running(jnp.maximum, jnp.where(heads, t, 0)))


def _masked_exp(diff, mask):
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _pairs(a, b, G, mask):
    """``sum_d a_t[d] b_s[d] exp(G_t[d] - G_s[d])`` where ``mask [.., C, C]``, else 0 (``G [.., C, d]``)."""
    if G.shape[-1] == 1:
        return jnp.einsum("...td,...sd->...ts", a, b) * _masked_exp(G[..., :, None, 0] - G[..., None, :, 0], mask)
    decay = _masked_exp(G[..., :, None, :] - G[..., None, :, :], mask[..., None])
    return jnp.einsum("...td,...sd,...tsd->...ts", a, b, decay)


def _gates(g, r: Runs):
    """Cumulative gates within each chunk ``G`` and from each token's run start ``Gr``."""
    G = running(jnp.add, g, axis=-2)
    before = jnp.take_along_axis(G - g, r.head[:, None, ..., None], axis=-2)
    return G, G - before


def _masks(r: Runs):
    """Same-run pairs ``s < t`` and ``s <= t``, ``[B, 1, N, C, C]`` (one for all heads)."""
    C = r.run.shape[-1]
    same = r.run[..., :, None] == r.run[..., None, :]
    t = jnp.arange(C)
    s_t = (t[None, :], t[:, None])
    return (same & (s_t[0] < s_t[1])[None, None])[:, None], (same & (s_t[0] <= s_t[1])[None, None])[:, None]


@jax.custom_vjp
def unit_lower_inverse(m_CC):
    """``m^{-1}`` of unit lower triangular matrices ``[.., C, C]``: diagonal blocks of 1, 2, 4, ... tokens
    joined pairwise (``[[A, 0], [M, D]]^{-1} = [[A^-1, 0], [-D^-1 M A^-1, D^-1]]``): batched matmuls only,
    where a triangular solve is a loop over rows. Its gradient is ``-m^-T g m^-T`` on the strictly lower
    part (two matmuls, not the transposes of every block's slices and pads)."""
    return _blocked_inverse(m_CC)


def _blocked_inverse(m_CC):
    C = m_CC.shape[-1]
    n = 1 << (C - 1).bit_length()
    m = jnp.pad(m_CC, [(0, 0)] * (m_CC.ndim - 2) + [(0, n - C)] * 2)
    inv = jnp.ones(m.shape[:-2] + (n, 1, 1), m.dtype)  # the inverses of the 1x1 diagonal blocks
    size = 1
    while size < n:
        lower = jnp.stack([m[..., i + size:i + 2 * size, i:i + size] for i in range(0, n, 2 * size)], axis=-3)
        a, d = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        top = jnp.concatenate([a, jnp.zeros_like(a)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([-(d @ lower @ a), d], axis=-1)], axis=-2)
        size *= 2
    return inv.reshape(m.shape)[..., :C, :C]


def _inverse_fwd(m_CC):
    inv = _blocked_inverse(m_CC)
    return inv, inv


def _inverse_bwd(inv, g):
    inv_t = jnp.swapaxes(inv, -1, -2)
    return (jnp.tril(-(inv_t @ g @ inv_t), -1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def gdn_intra(q, k, v, g, beta, r: Runs) -> Intra:
    """The delta rule's chunk parts: ``q`` (scaled), ``k`` ``[B, H, N, C, k]``, ``v [.., v]``, ``g [.., d]``
    (log decays), ``beta [B, H, N, C]``."""
    G, Gr = _gates(g, r)
    strict, incl = _masks(r)
    a_kk = _pairs(k, k, G, strict)
    a_qk = _pairs(q, k, G, incl)
    system = jnp.eye(a_kk.shape[-1], dtype=a_kk.dtype)[None, None, None] + scaled(a_kk, beta)
    inv, decay = unit_lower_inverse(system), jnp.exp(Gr)
    w_v, w_k = inv @ scaled(v, beta), inv @ scaled(scaled(k, decay), beta)
    q_eff = scaled(q, decay) - a_qk @ w_k
    return Intra(o_intra=a_qk @ w_v, q_eff=q_eff, w_k=w_k, w_v=w_v, k=k, G=G, Gr=Gr, runs=r)


def ssd_intra(c, b, x, g, r: Runs) -> Intra:
    """Mamba-2's chunk parts: ``c`` (queries), ``b`` (keys) ``[B, H, N, C, n]``, ``x`` = ``dt * x``
    ``[.., p]``, ``g = dt * A`` ``[.., 1]``."""
    G, Gr = _gates(g, r)
    _, incl = _masks(r)
    a_qk = _pairs(c, b, G, incl)
    return Intra(o_intra=a_qk @ x, q_eff=scaled(c, jnp.exp(Gr)), w_k=None, w_v=x, k=b, G=G, Gr=Gr, runs=r)


def select(intra: Intra, chunk_BM) -> Intra:
    """The chunks ``chunk [B, M]`` of ``intra`` (per row), as an ``Intra`` of ``M`` chunks."""
    def take(a, heads_axis=True):
        idx = chunk_BM[:, None] if heads_axis else chunk_BM
        idx = idx.reshape(idx.shape + (1,) * (a.ndim - idx.ndim))
        return jnp.take_along_axis(a, idx, axis=2 if heads_axis else 1)

    r = Runs(run=take(intra.runs.run, False), head=take(intra.runs.head, False))
    return Intra(*(None if a is None else take(a) for a in (intra.o_intra, intra.q_eff, intra.w_k, intra.w_v,
                                                              intra.k, intra.G, intra.Gr)), runs=r)


def k_bar_at(intra: Intra, tau_BN):
    """``(k_bar [B, H, N, C, k], decay [B, H, N, d])``: the keys of the run holding token ``tau [B, N]``
    up to it, decayed to it, and the run's decay from its start to ``tau``."""
    at = lambda a: jnp.take_along_axis(a, tau_BN[:, None, :, None, None], axis=-2)  # noqa: E731  [.., 1, d]
    run_tau = jnp.take_along_axis(intra.runs.run, tau_BN[..., None], axis=-1)
    C = intra.k.shape[-2]
    keep = ((jnp.arange(C)[None, None] <= tau_BN[..., None]) & (intra.runs.run == run_tau))[:, None, ..., None]
    return scaled(intra.k, _masked_exp(at(intra.G) - intra.G, keep)), jnp.exp(at(intra.Gr))[..., 0, :]


def decayed(S, decay):
    """``S [.., v, k]`` times a run's decay ``[.., d]`` (one per key channel, or ``d = 1`` for all of ``S``)."""
    return S * (decay[..., None, :] if decay.shape[-1] > 1 else decay[..., None])


def maps_at(intra: Intra, tau_BN):
    """``(A, B)`` of the run holding token ``tau [B, N]`` of each chunk: the state after ``tau`` is
    ``X A + B`` for the state ``X`` the run started from. ``A [B, H, N, k, k]`` (``[.., 1, 1]`` for
    Mamba-2), ``B [B, H, N, v, k]``."""
    k_bar, decay = k_bar_at(intra, tau_BN)
    b = jnp.einsum("...sv,...sk->...vk", intra.w_v, k_bar)
    if intra.w_k is None:
        return decay[..., None], b
    a = -jnp.einsum("...sj,...sk->...jk", intra.w_k, k_bar)
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)[None, None, None]
    return a + decayed(eye, decay), b
