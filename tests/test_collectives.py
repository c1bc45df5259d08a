"""Each collective as a tiny per-shard function inside ``jax.shard_map``, against the plain global result.

One test per pattern (jax's ``tests/shard_map_test.py`` is the model): the Ulysses
exchange and its inverse, each K/V exchange's collective, and each K/V exchange's
attend step against ``jax_cp.reference``; every ``custom_vjp`` passes
``jax.test_util.check_grads`` (its stated backward against numerical derivatives).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P
from jax.test_util import check_grads

import jax_cp
from jax_cp import exchanges, reference
from jax_cp._ulysses import heads_to_seq, seq_to_heads
from jax_cp.exchanges.all_gather import gather_seq
from jax_cp.exchanges.all_to_all import spread_kv
from util import assert_close

F32 = jnp.float32

COL, ULY, DP = jax_cp.COLOSSAL, jax_cp.ULYSSES, jax_cp.DP
GRAD = dict(order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


def _x(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _mesh(**degrees):
    return jax_cp.make_mesh(**degrees, axis_types=AxisType.Auto)  # plain global arrays in, as in jax's tests


def _smap(mesh, in_specs, out_specs):
    """``fn -> jit(shard_map(fn))`` on ``mesh`` (jitted: check_grads calls it many times)."""
    return lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def test_ulysses_exchange_moves_tokens_to_head_groups():
    """seq_to_heads: [B, S/u, H_i, d] -> [B, S, H_i/u, d] for two parts in one all-to-all; inverse round-trips."""
    mesh = _mesh(cp_ulysses=4)  # dp=2
    a, b = _x(2, 8, 4, 3), _x(2, 8, 8, 3, seed=1)
    fwd = _smap(mesh, (P(DP, ULY), P(DP, ULY)), (P(DP, None, ULY), P(DP, None, ULY)))(
        lambda a, b: seq_to_heads((a, b), ULY))
    ya, yb = fwd(a, b)  # globally the same arrays, now sharded by heads
    np.testing.assert_array_equal(ya, a)
    np.testing.assert_array_equal(yb, b)
    inv = _smap(mesh, P(DP, None, ULY), P(DP, ULY))(lambda o: heads_to_seq(o, ULY))
    np.testing.assert_array_equal(inv(b), b)
    check_grads(lambda a, b: sum(jnp.sum(y * y) for y in fwd(a, b)), (a, b), **GRAD)
    check_grads(lambda o: jnp.sum(jnp.sin(inv(o))), (b,), **GRAD)


def test_ulysses_exchange_keeps_each_parts_dtype():
    """Parts of different dtypes (bfloat16 q/k/v beside float32 gates) share one all-to-all in the
    promoted dtype; each output and each gradient comes back in its part's own dtype."""
    mesh = _mesh(cp_ulysses=4)
    a, b = _x(2, 8, 4, 3).astype(jnp.bfloat16), _x(2, 8, 8, 3, seed=1)
    fwd = _smap(mesh, (P(DP, ULY), P(DP, ULY)), (P(DP, None, ULY), P(DP, None, ULY)))(
        lambda a, b: seq_to_heads((a, b), ULY))
    ya, yb = fwd(a, b)
    assert (ya.dtype, yb.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(ya, a)
    np.testing.assert_array_equal(yb, b)
    ga, gb = jax.grad(lambda a, b: sum(jnp.sum(y.astype(F32) * 2) for y in fwd(a, b)), argnums=(0, 1))(a, b)
    assert (ga.dtype, gb.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(ga, jnp.full_like(a, 2))
    np.testing.assert_array_equal(gb, jnp.full_like(b, 2))


def test_gather_seq_gives_every_device_the_whole_sequence():
    mesh = _mesh(cp_colossal=4)  # dp=2
    x = _x(2, 8, 2, 3)
    # Each device's result stacked along the sequence: c copies of the global array.
    f = _smap(mesh, P(DP, COL), P(DP, COL))(lambda x: gather_seq(x, COL))
    np.testing.assert_array_equal(f(x), jnp.concatenate([x] * 4, axis=1))
    check_grads(lambda x: jnp.sum(jnp.sin(f(x)) * f(x)), (x,), **GRAD)


@pytest.mark.parametrize("ulysses", [None, ULY])
def test_spread_kv_is_gather_plus_ulysses_in_one_all_to_all(ulysses):
    """[B, S/(c*u), P, H, d] -> [B, S, P, H/u, d]: every token, this device's head group."""
    mesh = _mesh(cp_colossal=2, cp_ulysses=2)  # dp=2
    x = _x(2, 8, 2, 4, 3)
    if ulysses is None:  # heads already split: per device [B, S/c, P, H, d] -> [B, S, P, H, d]
        f = _smap(mesh, P(DP, COL), P(DP, COL))(lambda x: spread_kv(x, COL))
        np.testing.assert_array_equal(f(x), jnp.concatenate([x] * 2, axis=1))
    else:
        f = _smap(mesh, P(DP, (COL, ULY)), P(DP, COL, None, ULY))(lambda x: spread_kv(x, COL, ULY))
        np.testing.assert_array_equal(f(x), jnp.concatenate([x] * 2, axis=1))
    check_grads(lambda x: jnp.sum(jnp.sin(f(x)) * f(x)), (x,), **GRAD)


@pytest.mark.parametrize("exchange", ["gather_seq", "spread_kv"])
def test_gathered_kv_gradients_travel_in_their_dtype_and_sum_in_float32(exchange):
    """The backward of the gathering exchanges sends a bfloat16 cotangent as bfloat16 (its values are
    exact there: float32 would double the bytes) and sums the copies in float32: the gradient equals the
    float32 sum of the bfloat16 cotangents, rounded once."""
    mesh = _mesh(cp_colossal=4, cp_ulysses=2)  # dp=1
    x = _x(1, 16, 2, 2, 8).astype(jnp.bfloat16)
    if exchange == "gather_seq":
        f = _smap(mesh, P(None, COL), P(None, COL))(lambda x: gather_seq(x, COL))
    else:
        f = _smap(mesh, P(None, (COL, ULY)), P(None, COL, None, ULY))(lambda x: spread_kv(x, COL, ULY))
    w = _x(*f(x).shape, seed=1).astype(jnp.bfloat16)
    loss = lambda x: jnp.sum(f(x).astype(F32) * w.astype(F32))
    text = jax.jit(jax.grad(loss)).lower(x).as_text()  # the program as written (XLA:CPU widens bf16 collectives)
    sent = re.findall(r"stablehlo\.all_to_all.*: \(tensor<[\dx]*x(\w+)>\)", text)
    assert sent == ["bf16"], sent  # the backward's all-to-all (the loss is linear: no forward one left)
    # the global output is c copies of x's tokens along the sequence, each weighted by its own block of w
    copies = w.astype(F32).reshape(1, 4, 16, *w.shape[2:]).sum(1)
    g = jax.grad(loss)(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(copies.astype(jnp.bfloat16).astype(F32)))


@pytest.mark.parametrize("exchange", exchanges.EXCHANGES, ids=exchanges.NAMES)
def test_exchange_attend_step_equals_reference(exchange):
    """Per device: local queries (the colossal chunk) against every key through the exchange."""
    mesh = _mesh(cp_colossal=4)  # dp=2
    B, S, H, K, d = 2, 16, 2, 1, 4
    q, k, v = _x(B, S, H, d), _x(B, S, K, d, seed=1), _x(B, S, K, d, seed=2)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    spec = jax_cp.AttentionSpec(num_heads=H, num_kv_heads=K, head_dim=d, is_causal=True,
                                kernel="blockwise", kv_exchange=exchange)
    f = _smap(mesh, (P(DP, COL),) * 3 + (P(DP),), P(DP, COL))(
        lambda q, k, v, pos: exchange.attend(q, k, v, exchanges.Meta(pos), spec))
    want = reference.attend(q, k, v, q_positions=pos, kv_positions=pos, is_causal=True)
    assert_close(f(q, k, v, pos), want, F32, exchange.name)
    meta = exchanges.Meta(pos)
    assert_close(exchange.reference(q, k, v, meta, meta, spec), want, F32, "plain reference")
    check_grads(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, pos))), (q, k, v), **GRAD)


def test_exchanges_are_values_with_their_constraints():
    assert exchanges.resolve("ring") == exchanges.resolve(exchanges.Ring()) == exchanges.Ring()
    assert [str(x) for x in exchanges.EXCHANGES] == list(exchanges.NAMES) == ["all_gather", "all_to_all", "ring"]
    assert exchanges.DEFAULT == exchanges.AllGather()
    assert not exchanges.AllToAll().fuses_qkv and exchanges.Ring().fuses_qkv
    assert not exchanges.Ring().ties_chunks and exchanges.AllGather().ties_chunks
    with pytest.raises(ValueError, match=r"kv_exchange='tree' must be one of \('all_gather', 'all_to_all', 'ring'\)"):
        exchanges.resolve("tree")
    # A value is accepted wherever a name is, and the spec stores the value.
    spec = jax_cp.AttentionSpec(num_heads=4, head_dim=8, kv_exchange="ring")
    assert spec.kv_exchange == exchanges.Ring()
    with pytest.raises(ValueError, match=r"kernel='xla' cannot run kv_exchange='ring'"):
        jax_cp.AttentionSpec(num_heads=4, head_dim=8, kv_exchange=exchanges.Ring(), kernel="xla")


def test_projection_custom_vjps_pass_check_grads():
    """The layer's own custom_vjps: project_parts (QK-norm, RoPE), heads_to_model (inverse all-to-all +
    output projection) and tie_cotangents, each against numerical derivatives."""
    from jax_cp._projection import heads_to_model, project_parts, tie_cotangents

    x, wq, wk, norm = _x(2, 8, 6), _x(6, 2, 4, seed=1), _x(6, 1, 4, seed=2), 1.0 + _x(4, seed=3) ** 2
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))

    def proj(x, wq, wk, norm):
        q, k = project_parts(x, (wq, wk), (None, None), (norm, None), pos, jnp.float32, 10_000.0, (True, True))
        return jnp.sum(jnp.sin(q)) + jnp.sum(k * k)

    check_grads(proj, (x, wq, wk, norm), **GRAD)
    mesh = _mesh(cp_ulysses=4)
    o, wo = _x(2, 8, 4, 3), _x(4, 3, 5, seed=4)
    out = _smap(mesh, (P(DP, None, ULY), P()), P(DP, ULY))(  # the weight marked varying, as the layer does
        lambda o, w: heads_to_model(o, lax.pcast(w, (DP, ULY), to="varying"), ULY))
    np.testing.assert_allclose(out(o, wo), jnp.einsum("bshe,hed->bsd", o, wo), rtol=1e-5, atol=1e-5)
    check_grads(lambda o, w: jnp.sum(jnp.sin(out(o, w))), (o, wo), **GRAD)
    check_grads(lambda a, b: sum(jnp.sum(jnp.sin(t)) for t in tie_cotangents(a, b)), (o, wo), **GRAD)
