"""``jax_cp._vma.unchecked``: a Pallas call that ``jax.shard_map(check_vma=True)`` refuses, on both
of its paths (every mesh axis manual: the ``jax_cp_unchecked`` primitive; some axis automatic: a
nested ``shard_map``), under ``jit``, ``vmap``, ``grad`` and ``jax.checkpoint`` of a loop (whose
partial evaluation traces the loop's body again, as the ring's is under ``models.train --remat``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import AxisType

from conftest import needs_devices
from jax_cp._vma import unchecked, vary_as


def _double(x):
    """A Pallas kernel (interpret mode) whose output is declared without a manual-axis type, which
    ``shard_map(check_vma=True)`` refuses; its interpreted loops run on ``x`` retyped by an op
    traced unchecked (as splash's wrapper code retypes its inputs)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = 2.0 * x_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(1.0 * x)


@jax.custom_vjp
def _twice(x):
    return vary_as(unchecked(_double, x), x)


def _twice_fwd(x):
    return _twice(x), None


def _twice_bwd(_, g):
    return (vary_as(unchecked(_double, g), g),)


_twice.defvjp(_twice_fwd, _twice_bwd)


def _body(twice):
    def body(x):  # [rows, 8] per device
        def step(carry, _):
            return jnp.sin(twice(carry)) * x, None

        y, _ = lax.scan(step, x, None, length=2)
        return y + jax.vmap(twice)(x)  # rows batched through the kernel

    return body


@needs_devices(8)
@pytest.mark.parametrize("axis_names", [{"a", "b"}, {"a"}], ids=["all_manual", "b_automatic"])
def test_unchecked_kernel_under_jit_vmap_grad_and_remat(axis_names):
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto, AxisType.Auto))
    spec = jax.P(tuple(sorted(axis_names)))

    def loss(twice):
        mapped = jax.shard_map(_body(twice), mesh=mesh, in_specs=spec, out_specs=spec, axis_names=axis_names)
        return jax.checkpoint(lambda x: jnp.sum(mapped(x) ** 2))

    x = jax.random.normal(jax.random.key(0), (16, 8), jnp.float32)
    got_value, got_grad = jax.jit(jax.value_and_grad(loss(_twice)))(x)
    want_value, want_grad = jax.jit(jax.value_and_grad(loss(lambda x: 2.0 * x)))(x)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got_grad).sum()) > 0


@needs_devices(8)
def test_unchecked_call_closing_over_values_of_the_enclosing_trace():
    """A kernel call that reads a value computed in the enclosing ``shard_map`` body (here each
    device's index along ``b``) without taking it as an argument: the value becomes an input of the
    ``jax_cp_unchecked`` primitive, also when the call is batched by ``vmap``."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto, AxisType.Auto))

    def body(x):  # [2, 8] per device
        i = lax.axis_index("b").astype(x.dtype)
        one = vary_as(unchecked(lambda v: _double(v) + i, x), x)
        rows = jax.vmap(lambda r: vary_as(unchecked(lambda v: _double(v) - i, r), r))(x)
        return one + 10.0 * rows

    spec = jax.P(("a", "b"))
    x = jax.random.normal(jax.random.key(1), (16, 8), jnp.float32)
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)
    b = np.tile(np.repeat(np.arange(4, dtype=np.float32), 2), 2)[:, None]  # device (a, b) holds rows 2 (4 a + b)
    np.testing.assert_allclose(got, (2 * x + b) + 10.0 * (2 * x - b), rtol=1e-6, atol=1e-6)
