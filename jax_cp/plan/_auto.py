"""Candidate layouts for ``strategy="auto"`` and a closed-form estimate to rank them.

The closed form counts per-device FLOPs and wire bytes of one layer,
forward+backward, with no overlap assumed; the planner then compiles the best
few and decides with the compiled figures (real memory, real overlap).
Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim,
T local tokens before the all-to-all.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp

from jax_cp._mesh import lcm
from jax_cp.plan._build import LayerShape
from jax_cp._chips import Chip

__all__ = ["Candidate", "candidates", "closed_form_seconds"]

CHUNKS = (1, 2, 4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: mesh degrees, K/V exchange, projection chunks."""

    c: int
    u: int
    t: int
    dp: int
    kv_exchange: str
    overlap_chunks: int

    @property
    def label(self) -> str:
        return (f"cp_colossal={self.c} cp_ulysses={self.u} tp={self.t} dp={self.dp} "
                f"kv_exchange={self.kv_exchange} overlap_chunks={self.overlap_chunks}")


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def candidates(n_devices: int, shape: LayerShape, exchanges: tuple[str, ...]) -> tuple[list[Candidate], list[str]]:
    """Every valid layout, and one line per rejected family saying why."""
    out, rejected = [], []
    H, B, S = shape.num_heads, shape.batch, shape.seq_len
    for c, u, t in itertools.product(*[_divisors(n_devices)] * 3):
        if n_devices % (c * u * t):
            continue
        dp = n_devices // (c * u * t)
        why = []
        if B % dp:
            why.append(f"batch={B} % dp={dp}")
        if S % (c * u):
            why.append(f"seq_len={S} % (c*u)={c * u}")
        if H % (t * u):
            why.append(f"num_heads={H} % (tp*u)={t * u}")
        if why:
            rejected.append(f"({c},{u},{t}) dp={dp}: " + ", ".join(why))
            continue
        for ex in (exchanges if c > 1 else exchanges[:1]):
            for n in CHUNKS:
                if H % (t * u * n) == 0:
                    out.append(Candidate(c=c, u=u, t=t, dp=dp, kv_exchange=ex, overlap_chunks=n))
    return out, rejected


def _projection_flops_fwd(shape: LayerShape, tokens: float, kv: int, t: int) -> float:
    """Forward FLOPs of the Q, K, V and output projections for ``tokens`` tokens on one device."""
    D, H, d = shape.d_model, shape.num_heads, shape.head_dim
    return 2 * tokens * D * (H + 2 * kv) * d / t + 2 * tokens * H * d * D / t


def layer_flops(shape: LayerShape, c: int, u: int, t: int, dp: int, *, splash: bool,
                balanced: bool = False) -> tuple[float, float]:
    """``(model, executed)`` FLOPs of one device's layer, forward + backward, counted from the shapes.

    ``model``: the layer's useful FLOPs divided evenly over the devices (each matmul once,
    backward = 2x forward, attention at its visible (query, key) pairs: half the square for a
    causal mask), the numerator of MFU. ``executed``: what the busiest device runs, with the
    kernels' backward recomputation (scores and probabilities again in both of splash's backward
    kernels, dq and dK/dV: 7 attention matmuls against the forward's 2; once in the blockwise
    kernel's: 5). For a causal mask in natural order the busiest device holds the last colossal
    chunk (``T (S - T) + T (T + 1) / 2`` pairs, ``T = S/c``); ``balanced`` (``jax_cp.load_balance``)
    evens it out. Projections use the kv heads after the layer's minimal repetition.
    """
    H, d, S = shape.num_heads, shape.head_dim, shape.seq_len
    chunks = shape.overlap_chunks if isinstance(shape.overlap_chunks, int) else 1
    kv = lcm(shape.num_kv_heads, t * u * chunks)
    proj_fwd = _projection_flops_fwd(shape, shape.batch * S / (dp * c * u), kv, t)
    T = S / c
    mean_pairs = S * (S + 1) / 2 / c if shape.is_causal else T * S
    busiest = T * (S - T) + T * (T + 1) / 2 if shape.is_causal and not balanced else mean_pairs
    per_pair = 4 * (shape.batch / dp) * (H / (t * u)) * d
    model = 3 * (proj_fwd + per_pair * mean_pairs)
    return model, 3 * proj_fwd + per_pair * busiest * (1 + (7 if splash else 5) / 2)


def closed_form_seconds(cand: Candidate, shape: LayerShape, chip: Chip) -> float:
    """Per-device compute + communication time, forward+backward, no overlap assumed."""
    c, u, t, dp = cand.c, cand.u, cand.t, cand.dp
    D, H, d = shape.d_model, shape.num_heads, shape.head_dim
    kv = lcm(shape.num_kv_heads, t * u * cand.overlap_chunks)  # kv heads after minimal repetition
    e = jnp.dtype(shape.dtype).itemsize
    b, T = shape.batch / dp, shape.batch * shape.seq_len / (dp * c * u)
    flops_fwd = _projection_flops_fwd(shape, T, kv, t)
    flops_fwd += 4 * b * (shape.seq_len / c) * shape.seq_len * (H / (t * u)) * d
    wire_fwd = (T * (2 * H + 2 * kv) / t * d * e) * (u - 1) / u  # q, k, v, o all-to-alls
    wire_fwd += 2 * b * (shape.seq_len / c) * (kv / (t * u)) * d * e * (c - 1)  # K/V exchange
    wire_fwd += 2 * T * D * e * (t - 1) / t  # output psum over tp
    wire = 2 * wire_fwd + 2 * b * (shape.seq_len / c) * (kv / (t * u)) * d * 4 * (c - 1)  # + f32 dK/dV
    return 3 * flops_fwd / chip.device_flops + wire / chip.device_ici_bandwidth
