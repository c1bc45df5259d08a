"""Inputs shared by the linear-attention tests: packed rows whose documents cross chunks and ranks, and
each layer's arguments (float32, gates in their natural ranges)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def packed(rows=((5, 40, 19), (30, 27, 7)), pad=(0, 0)):
    """``(positions, segment_ids)`` ``[B, S]`` int32 NumPy: row ``b`` holds documents of the given
    lengths, then ``pad[b]`` padding tokens (segment id -1), in natural order."""
    segs, poss = [], []
    for lengths, p in zip(rows, pad):
        segs.append(np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(p, -1)]))
        poss.append(np.concatenate([np.arange(n) for n in lengths] + [np.arange(p)]))
    return np.stack(poss).astype(np.int32), np.stack(segs).astype(np.int32)


def gdn_args(B, S, H, dk, dv, *, per_channel=False, seed=0):
    """``(q, k, v, g, beta, initial_state)``: unit-norm keys (as Qwen3-Next), gates ``g <= 0``."""
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (B, S, H, dk), F32)
    k = jax.random.normal(ks[1], (B, S, H, dk), F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, S, H, dv), F32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, S, H) + ((dk,) if per_channel else ()), F32)) / 2
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, S, H), F32))
    return q, k, v, g, beta, jax.random.normal(ks[5], (B, H, dv, dk), F32)


def ssd_args(B, S, H, p, n, G, *, seed=0):
    """``(x, dt, A, B, C, D, initial_state)`` of Mamba-2."""
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (B, S, H, p), F32)
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, S, H), F32) - 1)
    A = -jnp.exp(jax.random.normal(ks[2], (H,), F32) / 2)
    b, c = (jax.random.normal(k, (B, S, G, n), F32) / 2 for k in ks[3:5])
    return x, dt, A, b, c, jax.random.normal(ks[5], (H,), F32), jax.random.normal(ks[6], (B, H, p, n), F32)


def conv_args(B, S, C, W, *, seed=0):
    """``(x, w, bias, initial_state)`` of the causal convolution."""
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, S, C), F32), jax.random.normal(ks[1], (W, C), F32) / 2,
            jax.random.normal(ks[2], (C,), F32), jax.random.normal(ks[3], (B, W - 1, C), F32))


def cotangent(out, seed=7):
    """A random cotangent shaped like ``out`` (a pytree)."""
    leaves, tree = jax.tree.flatten(out)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, jnp.shape(a), F32) for k, a in zip(keys, leaves)])
