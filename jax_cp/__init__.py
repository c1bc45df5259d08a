"""jax_cp: context-parallel attention for JAX and Flax.

Public API: ``make_mesh``, ``dot_product_attention``, ``visibility`` (the mask it applies, as a
dense array), ``CPAttention`` (NNX), ``linen.CPAttention``, ``AttentionSpec`` (the validated layer description),
``AttentionSharding`` (parameter storage layout), ``place_metadata`` (positions, segment ids and span ids
whole per row, as the layers read them, once before the layers), ``place``/``gather`` (arrays into a layout;
``gather`` as explicit all-gathers whose gradients are reduce-scatters; ``unshard`` the same inside
a ``shard_map``, where the gradient is one reduce-scatter of each device's partial sum; ``vma`` the axes a
value varies over there), ``seq_to_heads``/
``heads_to_seq`` (the Ulysses all-to-all per shard), ``save_attention_residuals`` (a ``jax.checkpoint``
policy keeping the attention kernels' outputs, named ``ATTENTION_RESIDUALS``), ``linear`` (the linear-attention layers of hybrid
models, on the same mesh and token order), ``exchanges`` (the K/V
exchanges as values), ``load_balance``, ``kernels``, ``reference`` (the
single-device ground truth); ``jax_cp.plan`` (the pod planner) is imported on use.
"""
from jax_cp import exchanges, kernels, linear, linen, load_balance, reference
from jax_cp._attention import dot_product_attention, visibility
from jax_cp._defaults import describe_kernel
from jax_cp._layer import AttentionSharding, param_shapes, param_specs
from jax_cp._mesh import AXES, COLOSSAL, DP, TP, ULYSSES, MeshDims, gather, make_mesh, mesh_dims, place, place_metadata, \
    unshard
from jax_cp._module import CPAttention
from jax_cp._posenc import RoPE, apply_rope, rms_norm
from jax_cp._remat import ATTENTION_RESIDUALS, save_attention_residuals
from jax_cp._spec import AttentionSpec
from jax_cp._ulysses import heads_to_seq, seq_to_heads
from jax_cp._vma import vma

__all__ = [
    "ATTENTION_RESIDUALS", "AXES", "AttentionSharding", "AttentionSpec", "COLOSSAL", "CPAttention", "DP", "MeshDims", "RoPE", "TP",
    "ULYSSES",
    "apply_rope", "describe_kernel", "dot_product_attention", "exchanges", "gather", "heads_to_seq", "kernels", "linear", "linen", "load_balance",
    "make_mesh", "mesh_dims", "param_shapes", "param_specs", "place", "place_metadata", "reference", "rms_norm", "save_attention_residuals", "seq_to_heads",
    "unshard", "visibility", "vma",
]
__version__ = "0.1.0"
