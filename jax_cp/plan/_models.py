"""Attention shapes of well-known models, by name (``--model llama3-8b``)."""
from __future__ import annotations

import dataclasses

from jax_cp._spec import AttentionSpec

__all__ = ["ModelSpec", "MODELS", "model_spec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One attention layer's sizes: D model width, H query heads, K kv heads, d head dim.

    Attributes:
        d_model: D, the model width.
        num_heads: H, query heads.
        num_kv_heads: K, kv heads.
        head_dim: d, the head dim.
        rope_theta: the RoPE base.
    """

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float | None = 500_000.0

    def __post_init__(self):
        self.attention  # noqa: B018  (validates the shapes once, with the layer's own messages)

    @property
    def attention(self) -> AttentionSpec:
        return AttentionSpec(num_heads=self.num_heads, in_features=self.d_model, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, rope_theta=self.rope_theta)


MODELS = {
    "llama3-8b": ModelSpec(d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128),
    "llama3-70b": ModelSpec(d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128),
    "llama3-405b": ModelSpec(d_model=16384, num_heads=128, num_kv_heads=8, head_dim=128),
    "tiny": ModelSpec(d_model=256, num_heads=8, num_kv_heads=2, head_dim=32, rope_theta=10_000.0),
}


def model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"model={name!r} is unknown; choose one of {sorted(MODELS)} or pass a ModelSpec.")
    return MODELS[name]
