"""TPU splash attention with masks from the data (``jax_cp.kernels._splash``); off a TPU it runs in Pallas
interpret mode (for tests). Returns the log-sum-exp a ring step merges (``splash_ring_attention``)."""
from __future__ import annotations

from jax_cp._platform import target_platform
from jax_cp.kernels._splash import splash_attention, splash_unsupported_reason
from jax_cp.kernels._base import Kernel, register

__all__ = ["Splash"]


@register
class Splash(Kernel):
    """``splash``: windows and span ids over at most ``_splash.MAX_WINDOW_KEYS`` keys a call, no max-logit statistic
    and no residual gradient; needs JAX's private splash backward (``_splash.unavailable_reason``)."""

    name = "splash"
    merges_lse = True
    takes_spans = True  # causal spans: a second call per row, over at most _splash.MAX_WINDOW_KEYS keys

    def unsupported_reason(self, *, window=None, kv_len=None, max_logits=False, residual=False, spans=False,
                           is_causal=True, **_) -> str | None:
        return splash_unsupported_reason(window=window, kv_len=kv_len, max_logits=max_logits, residual=residual,
                                         spans=spans, is_causal=is_causal)

    def attend(self, q_BTHd, k_BSKd, v_BSKd, *, natural_positions=False, block_q=None, block_kv=None,
               return_max_logits=False, return_residual=False, **kw):
        return splash_attention(q_BTHd, k_BSKd, v_BSKd, interpret=target_platform() != "tpu",
                                natural_positions=natural_positions, **kw)
