"""One token of each linear-attention layer: the recurrences every other form is checked against.

The gated delta rule (Gated DeltaNet; Kimi's KDA with a per-channel gate), Mamba-2's selective state
space step and the depthwise causal convolution before them, each as ``(output, new_state)`` of one
token. States are float32; outputs take the inputs' dtype.
Letters: B batch, H heads, G groups of Mamba-2's B/C, k key dim, v value dim, p Mamba-2 head dim,
n Mamba-2 state dim, W conv width, C channels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ACTIVATIONS", "activate", "conv_step", "default_scale", "gated_delta_step", "mamba2_step"]

F32 = jnp.float32
ACTIVATIONS = ("silu", None)


def default_scale(scale, head_k_dim: int) -> float:
    """``scale``, or ``head_k_dim ** -0.5`` (flash-linear-attention's and Qwen3-Next's default) when None."""
    return head_k_dim ** -0.5 if scale is None else float(scale)


def activate(y, activation):
    """``silu`` or nothing (``None``): the convolution's activations."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}.")
    return jax.nn.silu(y) if activation == "silu" else y


def decay_state(state_BHvk, g_BH):
    """``state * exp(g)``: a scalar gate per head ``[B, H]`` or a per-key-channel gate ``[B, H, k]``."""
    a = jnp.exp(g_BH.astype(F32))
    return state_BHvk * (a[..., None, :] if a.ndim == state_BHvk.ndim - 1 else a[..., None, None])


def gated_delta_step(state_BHvk, q_BHk, k_BHk, v_BHv, g_BH, beta_BH, *, scale=None):
    """One token of the gated delta rule.

    ``S = S diag(exp(g)) (I - beta k k^T) + beta v k^T``, ``o = S q * scale``: the decayed state
    forgets along ``k`` by ``beta`` and writes ``v`` there.

    Args:
        state_BHvk: ``[B, H, dv, dk]`` the state before the token (float32).
        q_BHk, k_BHk: ``[B, H, dk]`` query and key.
        v_BHv: ``[B, H, dv]`` value.
        g_BH: ``[B, H]`` log decay (``<= 0``), or ``[B, H, dk]`` per key channel (KDA).
        beta_BH: ``[B, H]`` write strength.
        scale: the query's scale (default ``dk ** -0.5``).

    Returns:
        ``(o [B, H, dv]`` in ``v``'s dtype, ``new_state [B, H, dv, dk]`` float32``)``.
    """
    scale = default_scale(scale, q_BHk.shape[-1])
    q, k, v, beta = (a.astype(F32) for a in (q_BHk, k_BHk, v_BHv, beta_BH))
    s = decay_state(state_BHvk.astype(F32), g_BH)
    delta = (v - jnp.einsum("bhvk,bhk->bhv", s, k)) * beta[..., None]
    s = s + jnp.einsum("bhv,bhk->bhvk", delta, k)
    return jnp.einsum("bhvk,bhk->bhv", s, q * scale).astype(v_BHv.dtype), s


def group_heads(a_BGn, num_heads: int):
    """Mamba-2's B or C of ``G`` groups, one row per head (heads ``[g*H/G, (g+1)*H/G)`` share group g)."""
    return jnp.repeat(a_BGn, num_heads // a_BGn.shape[-2], axis=-2)


def mamba2_step(state_BHpn, x_BHp, dt_BH, A_H, B_BGn, C_BGn, *, D_H=None):
    """One token of Mamba-2's selective state space model (the SSD recurrence).

    ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``.

    Args:
        state_BHpn: ``[B, H, p, n]`` the state before the token (float32).
        x_BHp: ``[B, H, p]`` the input.
        dt_BH: ``[B, H]`` the step (positive: after ``softplus(dt + dt_bias)``).
        A_H: ``[H]`` the decay rates (negative).
        B_BGn, C_BGn: ``[B, G, n]`` input and output projections of ``G`` head groups.
        D_H: ``[H]`` the skip connection (optional).

    Returns:
        ``(y [B, H, p]`` in ``x``'s dtype, ``new_state [B, H, p, n]`` float32``)``.
    """
    H = x_BHp.shape[1]
    x, dt = x_BHp.astype(F32), dt_BH.astype(F32)
    b, c = (group_heads(a.astype(F32), H) for a in (B_BGn, C_BGn))
    h = state_BHpn.astype(F32) * jnp.exp(dt * A_H.astype(F32)[None])[..., None, None]
    h = h + jnp.einsum("bhp,bhn->bhpn", x * dt[..., None], b)
    y = jnp.einsum("bhpn,bhn->bhp", h, c)
    if D_H is not None:
        y = y + x * D_H.astype(F32)[None, :, None]
    return y.astype(x_BHp.dtype), h


def conv_step(conv_state_BWC, x_BC, w_WC, *, bias_C=None, activation="silu"):
    """One token of the depthwise causal convolution.

    ``y = act(sum_i w[i] * window[i] + bias)`` over the window of the last ``W - 1`` inputs and ``x``
    (``w[W-1]`` weighs the current token, as ``Conv1d(padding=W-1)``).

    Args:
        conv_state_BWC: ``[B, W-1, C]`` the previous ``W - 1`` inputs, oldest first.
        x_BC: ``[B, C]`` this token's input.
        w_WC: ``[W, C]`` the per-channel filter.
        bias_C: ``[C]`` (optional).
        activation: ``"silu"`` or ``None``.

    Returns:
        ``(y [B, C]`` in ``x``'s dtype, ``new_state [B, W-1, C])`` (the state keeps ``x``'s dtype).
    """
    window = jnp.concatenate([conv_state_BWC.astype(x_BC.dtype), x_BC[:, None]], axis=1)
    y = jnp.einsum("bwc,wc->bc", window.astype(F32), w_WC.astype(F32))
    if bias_C is not None:
        y = y + bias_C.astype(F32)[None]
    return activate(y, activation).astype(x_BC.dtype), window[:, 1:]
