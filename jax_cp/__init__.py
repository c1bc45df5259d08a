"""jax_cp: context-parallel attention for JAX and Flax.

Public API: ``make_mesh``, ``dot_product_attention``, ``CPAttention`` (NNX),
``linen.CPAttention``, ``load_balance``, ``kernels``, ``reference`` (the
single-device ground truth); ``jax_cp.plan`` (the pod planner) is imported on use.
"""
from jax_cp import kernels, linen, load_balance, reference
from jax_cp._attention import dot_product_attention
from jax_cp._mesh import AXES, MeshDims, make_mesh, mesh_dims
from jax_cp._module import CPAttention

__all__ = [
    "AXES", "CPAttention", "MeshDims", "dot_product_attention", "kernels", "linen", "load_balance", "make_mesh",
    "mesh_dims", "reference",
]
__version__ = "0.1.0"
