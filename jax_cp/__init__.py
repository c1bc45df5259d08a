"""jax_cp: context-parallel attention for JAX and Flax."""
from jax_cp import kernels, linen, reference
from jax_cp._attention import dot_product_attention
from jax_cp._mesh import AXES, MeshDims, make_mesh, mesh_dims
from jax_cp._module import CPAttention

__all__ = [
    "AXES", "CPAttention", "MeshDims", "dot_product_attention", "kernels", "linen", "make_mesh", "mesh_dims",
    "reference",
]
__version__ = "0.1.0"
