"""Linear-attention layers of hybrid models (Qwen3-Next, Kimi Linear, Nemotron-H) on the CP mesh.

The gated delta rule (:func:`gated_delta_rule`, per-channel gates for KDA), Mamba-2's SSD
(:func:`mamba2_ssd`) and the short causal convolution before them (:func:`causal_conv1d`) over a
sequence sharded as the softmax layers' (same mesh, token order and packed rows), chunked in
float32; one token each for decode (:func:`gated_delta_step`, :func:`mamba2_step`,
:func:`conv_step`); :mod:`jax_cp.linear.reference` holds the token-by-token ground truth;
:func:`needed_pieces` counts the state slots an order needs, on the host; :func:`sized_pieces` the slots
a layer holds for that need.
Over ``cp_colossal`` the state passes between runs of tokens in document order (found from positions
and segment ids), over ``cp_ulysses`` the sequence becomes heads, ``tp`` splits heads.
"""
from jax_cp.linear import reference
from jax_cp.linear._conv import causal_conv1d, conv_step
from jax_cp.linear._cp import needed_pieces, sized_pieces
from jax_cp.linear._gated_delta import gated_delta_rule, gated_delta_step
from jax_cp.linear._ssd import mamba2_ssd, mamba2_step
from jax_cp.linear.module import GatedDeltaNet, GatedDeltaNetSpec, gated_deltanet, gated_deltanet_reference
from jax_cp.linear import linen

__all__ = ["GatedDeltaNet", "GatedDeltaNetSpec", "causal_conv1d", "conv_step", "gated_delta_rule",
           "gated_delta_step", "gated_deltanet", "gated_deltanet_reference", "linen", "mamba2_ssd", "mamba2_step",
           "needed_pieces", "reference", "sized_pieces"]
