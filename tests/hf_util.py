"""The jax_cp side of the checkpoint comparisons: a mesh of the first devices, and a loaded model's logits."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp


def mesh_of(c, u, t):
    """A ``(cp_colossal, cp_ulysses, tp)`` Auto mesh of the first ``c * u * t`` devices."""
    n = c * u * t
    return jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, devices=jax.devices()[:n], axis_types=AxisType.Auto)


def logits_of(model, tokens):
    """``model``'s logits for ``tokens [B, S]`` at positions ``arange(S)``, the batch sharded as training's."""
    sharding = NamedSharding(model.mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with jax.set_mesh(model.mesh):
        return nnx.jit(lambda m, t, p: m(t, positions=p))(model, jax.device_put(tokens, sharding),
                                                          jax.device_put(positions, sharding))
