"""``--scan-layers``: a model's blocks as one ``lax.scan`` over their stacked parameters (``Llama._scanned``)
give the loop's loss and gradients, with FSDP storage and remat, on Auto and Explicit meshes, for Llama
and the hybrid model (a scan over groups of a DeltaNet and an attention layer)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jax_cp
from conftest import needs_devices
from models import hybrid, llama
from util import TOL


def _loss_and_grads(name, layers, mesh, scan_layers, remat):
    cfg = dataclasses.replace(hybrid.get_config(name), num_layers=layers)
    if isinstance(cfg, hybrid.HybridConfig):  # DeltaNet, attention, DeltaNet, attention: two groups of two
        cfg = dataclasses.replace(cfg, full_attention_interval=2)
    B, S = 2, 64
    rng = np.random.default_rng(0)
    batch = dict(tokens=rng.integers(0, 256, (B, S)), labels=rng.integers(0, 256, (B, S)),
                 positions=np.tile(np.arange(S), (B, 1)), segment_ids=(np.arange(S) >= 40)[None].repeat(B, 0),
                 weights=np.ones((B, S), np.float32))
    batch = {k: v.astype(np.float32 if k == "weights" else np.int32) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        model = hybrid.model_class(cfg)(cfg, mesh=mesh, dtype=jnp.float32, fsdp=True, remat=remat,
                                        fsdp_axes=("dp", "cp_colossal", "cp_ulysses"), scan_layers=scan_layers,
                                        rngs=nnx.Rngs(0))
        graph, state = nnx.split(model)

        def loss(state):
            return llama.next_token_loss(nnx.merge(graph, state), batch)[0]

        step = jax.jit(jax.value_and_grad(loss))
        text = step.lower(state).as_text()
        return step(state), text


@needs_devices(8)
@pytest.mark.parametrize("name,layers,axis_types,remat", [("tiny", 2, AxisType.Auto, True),
                                                          ("hybrid-tiny", 4, AxisType.Explicit, False)])
def test_scanned_blocks_equal_the_loop(name, layers, axis_types, remat):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=axis_types)
    (loss, grads), looped = _loss_and_grads(name, layers, mesh, False, remat)
    (loss_s, grads_s), scanned = _loss_and_grads(name, layers, mesh, True, remat)
    tol = TOL[jnp.dtype(jnp.float32)]
    np.testing.assert_allclose(float(loss_s), float(loss), **tol)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads), strict=True):
        assert a.shape == b.shape  # the gradient tree keeps one entry per layer
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)
    # two groups of blocks (tiny: 2 of one block; the hybrid: 2 of a DeltaNet and an attention): the scan's
    # program holds one group's layers, and so fewer CP all-to-alls than the loop's (tiny: half)
    assert 0 < scanned.count("all_to_all") < looped.count("all_to_all")


def test_layer_period_is_the_shortest_repeating_pattern():
    a, b = "attention", "sliding"
    assert llama.layer_period([a, a, a, a]) == 1
    assert llama.layer_period([b, b, a, b, b, a]) == 3  # Gemma 3's 5:1 is the same with 6
    assert llama.layer_period([b, a, b, b]) == 4  # no shorter pattern divides the layers: one group
