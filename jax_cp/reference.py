"""Single-device ground truth: plain softmax attention, computed in float32 (float64 for float64 inputs).

Every fast path in jax_cp is tested against this module.
Letters: B batch, S sequence, H query heads, K kv heads, d head dim.

Cross attention in :func:`attention_layer`: keys from ``inputs_k``, values from ``inputs_v``
(each defaulting to the one before), at ``kv_positions`` (``arange(S_kv)`` when None) with
``kv_segment_ids``.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jax_cp._params import derive_dims, init_param, param_shapes
from jax_cp._posenc import apply_rope, rms_norm
from jax_cp.kernels._dense import attend

__all__ = ["Attention", "LayerSpec", "attend", "attention_layer", "dot_product_attention"]


def dot_product_attention(
    query, key, value, *, is_causal=False, scale=None, layout="BSHD",
    positions=None, segment_ids=None, local_window_size=None, logits_soft_cap=None, sinks=None,
    return_max_logits=False, return_residual=False, kv_positions=None, kv_segment_ids=None, span_ids=None,
    kv_span_ids=None,
):
    """The single-device twin of :func:`jax_cp.dot_product_attention`: same arguments (without ``mesh``).

    Args:
        query, key, value, layout: the inputs in ``layout``, ``"BSHD"`` or ``"BNSD"``.
        is_causal, scale, local_window_size, logits_soft_cap, sinks, return_max_logits, return_residual: as
            :func:`jax_cp.dot_product_attention`.
        positions, segment_ids: ``[B, T]`` or ``[T]``; ``None`` positions mean ``arange(T)``.
        kv_positions, kv_segment_ids: the keys' (``[B, S]``), defaulting to the queries'
            (cross attention: ``arange(S)``, segment ids given on both sides).
        span_ids, kv_span_ids: bidirectional span ids (0: none), the keys' defaulting to the queries'.

    Returns:
        ``out``, or ``(out, [max_logits,] residual)`` (the residual in the inputs' dtype).

    Raises:
        ValueError: ``layout`` is neither ``"BSHD"`` nor ``"BNSD"``.
    """
    if layout == "BNSD":
        query, key, value = (jnp.swapaxes(a, 1, 2) for a in (query, key, value))
    elif layout != "BSHD":
        raise ValueError(f"layout={layout!r} must be 'BSHD' or 'BNSD'.")
    (B, T), S = query.shape[:2], key.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) if positions is None else positions, (B, T))
    if kv_positions is None:
        kv_positions = positions if S == T else jnp.arange(S, dtype=jnp.int32)
    kv_positions = jnp.broadcast_to(kv_positions, (B, S))
    if segment_ids is not None:
        segment_ids = jnp.broadcast_to(segment_ids, (B, T))
        kv_segment_ids = jnp.broadcast_to(segment_ids if kv_segment_ids is None else kv_segment_ids, (B, S))
    if span_ids is not None:
        span_ids = jnp.broadcast_to(span_ids, (B, T))
        kv_span_ids = jnp.broadcast_to(span_ids if kv_span_ids is None else kv_span_ids, (B, S))
    out = attend(query, key, value, q_positions=positions, kv_positions=kv_positions,
                 q_span_ids=span_ids, kv_span_ids=kv_span_ids,
                 q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, is_causal=is_causal,
                 local_window_size=local_window_size, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 return_max_logits=return_max_logits, return_residual=return_residual)
    out, *extra = out if return_max_logits or return_residual else (out,)
    if return_residual:  # in the inputs' dtype, as jax.nn's and jax_cp.dot_product_attention's
        extra[-1] = extra[-1].astype(query.dtype)
    if layout == "BNSD":
        out, extra = jnp.swapaxes(out, 1, 2), [jnp.swapaxes(x, 1, 2) if x.ndim == 3 else x for x in extra]
    return (out, *extra) if extra else out


def attention_layer(params: dict, x_BSD, *, spec, dtype=None, positions=None,
                    segment_ids=None, local_window_size=None, scale=None, inputs_k=None, inputs_v=None,
                    kv_positions=None, kv_segment_ids=None, span_ids=None, kv_span_ids=None):
    """Single-device twin of ``jax_cp.CPAttention``'s forward (plain jnp, float32 math; float64 for float64).

    Args:
        params, x_BSD, dtype: parameters by name (``param_shapes``), inputs ``[B, S, D]``, result dtype (``None``: x's).
        spec: a :class:`LayerSpec` or a layer's ``jax_cp.AttentionSpec`` (the fields both have are read).
        positions, segment_ids, local_window_size, scale: as :func:`dot_product_attention`.
        inputs_k, inputs_v, kv_positions, kv_segment_ids: cross attention (see the module docstring).
        span_ids, kv_span_ids: bidirectional span ids (0: none), the keys' defaulting to the queries'.

    Returns:
        ``y [B, S, out_features]``; ``(y, max_logits)`` with ``spec.record_max_logits``.
    """
    B, S, _ = x_BSD.shape
    dtype = jnp.dtype(x_BSD.dtype if dtype is None else dtype)
    # Ground truth: every operation in float32 (float64 for float64 inputs) from the given values;
    # only the result is cast.
    acc = jnp.promote_types(x_BSD.dtype, jnp.float32)
    w = {k: v.astype(acc) for k, v in params.items()}
    x = x_BSD.astype(acc)
    x_k = x if inputs_k is None else inputs_k.astype(acc)
    x_v = x_k if inputs_v is None else inputs_v.astype(acc)
    S_kv = x_k.shape[1]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if positions is None else positions, (B, S))
    seg = None if segment_ids is None else jnp.broadcast_to(segment_ids, (B, S))
    kv_pos = (pos if S_kv == S else jnp.arange(S_kv, dtype=jnp.int32)) if kv_positions is None else kv_positions
    kv_pos = jnp.broadcast_to(kv_pos, (B, S_kv))
    kv_seg = seg if kv_segment_ids is None else jnp.broadcast_to(kv_segment_ids, (B, S_kv))
    span, kv_span = (None, None) if span_ids is None else (jnp.broadcast_to(span_ids, (B, S)), jnp.broadcast_to(
        span_ids if kv_span_ids is None else kv_span_ids, (B, S_kv)))
    q = jnp.einsum("bsd,dhe->bshe", x, w["q_kernel"])
    k = jnp.einsum("bsd,dhe->bshe", x_k, w["k_kernel"])
    v = jnp.einsum("bsd,dhe->bshe", x_v, w["v_kernel"])
    if spec.use_bias:
        q, k, v = q + w["q_bias"][None, None], k + w["k_bias"][None, None], v + w["v_bias"][None, None]
    if spec.use_qk_norm:
        q, k = rms_norm(q, w["q_norm"]), rms_norm(k, w["k_norm"])
    if spec.rope_theta is not None:
        q, k = apply_rope(q, pos, spec.rope_theta), apply_rope(k, kv_pos, spec.rope_theta)
    o = attend(q, k, v, q_positions=pos, kv_positions=kv_pos, q_segment_ids=seg, kv_segment_ids=kv_seg, q_span_ids=span,
               kv_span_ids=kv_span,
               is_causal=spec.is_causal, local_window_size=local_window_size, scale=scale,
               logits_soft_cap=spec.logits_soft_cap, sinks=w.get("sinks"), return_max_logits=spec.record_max_logits)
    o, *max_logits = o if spec.record_max_logits else (o,)
    y = jnp.einsum("bshe,hed->bsd", o, w["o_kernel"])
    if spec.use_bias:
        y = y + w["o_bias"][None, None]
    return (y.astype(dtype), *max_logits) if max_logits else y.astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """What the reference layer computes: ``jax_cp.AttentionSpec``'s head dims and mask, without the CP-only fields.

    Head dims are derived and checked alike (``_params.derive_dims``).

    Attributes:
        num_heads, in_features, num_kv_heads, head_dim, out_features, v_head_dim: as
            ``jax_cp.AttentionSpec``.
        is_causal, use_qk_norm, rope_theta, use_bias: as ``jax_cp.AttentionSpec``.
        use_sinks, logits_soft_cap, record_max_logits: as ``jax_cp.AttentionSpec``.
    """

    num_heads: int
    in_features: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    v_head_dim: int | None = None
    is_causal: bool = False
    use_qk_norm: bool = False
    rope_theta: float | None = None
    use_bias: bool = False
    use_sinks: bool = False
    logits_soft_cap: float | None = None
    record_max_logits: bool = False

    def __post_init__(self):
        dims = derive_dims(num_heads=self.num_heads, in_features=self.in_features, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, out_features=self.out_features, v_head_dim=self.v_head_dim,
                           rope_theta=self.rope_theta)
        for name, value in dims.items():
            object.__setattr__(self, name, value)


class Attention(nnx.Module):
    """Plain single-device attention holding the same parameters as ``jax_cp.CPAttention``.

    Same constructor (without ``mesh`` and the CP-only options); built from the
    same ``rngs`` it holds the same values, and ``nnx.update(ref, nnx.state(cp))``
    copies a CP module's parameters into it.

    Args:
        num_heads, in_features, num_kv_heads, head_dim, out_features, v_head_dim: as
            ``jax_cp.CPAttention``.
        is_causal, use_qk_norm, rope_theta, use_bias: as ``jax_cp.CPAttention``.
        use_sinks, logits_soft_cap, record_max_logits: as ``jax_cp.CPAttention``.
        dtype, param_dtype, kernel_init, rngs: as ``jax_cp.CPAttention``.
    """

    def __init__(self, num_heads, in_features, *, num_kv_heads=None, head_dim=None, out_features=None, v_head_dim=None,
                 is_causal=False,
                 use_qk_norm=False, rope_theta=None, use_bias=False, use_sinks=False, logits_soft_cap=None,
                 record_max_logits=False, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        self.spec = LayerSpec(
            num_heads=num_heads, in_features=in_features, num_kv_heads=num_kv_heads, head_dim=head_dim,
            out_features=out_features, v_head_dim=v_head_dim, is_causal=is_causal, use_qk_norm=use_qk_norm, rope_theta=rope_theta, use_bias=use_bias,
            use_sinks=use_sinks, logits_soft_cap=logits_soft_cap, record_max_logits=record_max_logits,
        )
        self.dtype = dtype
        for name, shape in param_shapes(self.spec).items():
            setattr(self, name, nnx.Param(init_param(name, shape, rngs.params(), param_dtype, kernel_init)))

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, positions=None, segment_ids=None,
                 kv_positions=None, kv_segment_ids=None, local_window_size=None, span_ids=None, kv_span_ids=None):
        """``CPAttention``'s call without its inference arguments (``attention_layer``)."""
        params = {name: getattr(self, name)[...] for name in param_shapes(self.spec)}
        y = attention_layer(params, inputs_q, spec=self.spec, dtype=self.dtype, positions=positions,
                            segment_ids=segment_ids, local_window_size=local_window_size,
                            inputs_k=inputs_kv if inputs_k is None else inputs_k, inputs_v=inputs_v,
                            kv_positions=kv_positions, kv_segment_ids=kv_segment_ids, span_ids=span_ids,
                            kv_span_ids=kv_span_ids)
        if self.spec.record_max_logits:
            y, max_logits = y
            self.sow(nnx.Intermediate, "max_logits", max_logits)
        return y
