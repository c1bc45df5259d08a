"""Eager gradients (``jax.grad`` outside ``jit``) through every order of the sequence, as under ``jit``.

Orders: natural, dual-chunk (``load_balance.balanced(fn, mesh)``), a dispatch plan
(``balanced(fn, plan)``) and the plan by hand (``Dispatch.reorder`` -> attention -> ``Dispatch.restore``).
Each runs a K/V exchange (all-gather, ring, all-to-all, or the order's attended exchange), with K/V
differentiated or closed over (only ``q`` differentiated), on Auto and Explicit meshes. The eager
gradients equal the single-device reference's and the jitted gradients.

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_cp
from jax_cp import load_balance, reference
from util import assert_close, random_qkv

B, S, H, K, d = 2, 128, 8, 2, 16
LENGTHS = [20] * 6 + [8]  # documents per row: packed, per-document positions
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
# order, (cp_colossal, cp_ulysses, tp), kv_exchange ("attended": the order's own, read from its Dispatch),
# mesh axis type, K/V closed over: every order with every exchange, each order on both mesh types and
# with K/V differentiated and closed over.
CASES = [
    ("natural", (8, 1, 1), "all_gather", AUTO, False), ("natural", (4, 2, 1), "ring", EXPLICIT, True),
    ("natural", (2, 2, 2), "all_to_all", AUTO, True), ("natural", (4, 2, 1), "attended", AUTO, False),
    ("dual_chunk", (8, 1, 1), "all_gather", AUTO, False), ("dual_chunk", (4, 2, 1), "ring", AUTO, True),
    ("dual_chunk", (2, 2, 2), "all_to_all", AUTO, True), ("dual_chunk", (4, 2, 1), "attended", EXPLICIT, False),
    ("plan", (8, 1, 1), "all_gather", AUTO, False), ("plan", (4, 2, 1), "ring", AUTO, True),
    ("plan", (2, 2, 2), "all_to_all", EXPLICIT, False), ("plan", (4, 2, 1), "attended", AUTO, True),
    ("by_hand", (8, 1, 1), "all_gather", EXPLICIT, True), ("by_hand", (4, 2, 1), "ring", AUTO, False),
    ("by_hand", (2, 2, 2), "all_to_all", AUTO, True), ("by_hand", (4, 2, 1), "attended", AUTO, False),
]


def _packed():
    """Segment ids and per-document positions ``[B, S]`` (int32), the rows shifted apart."""
    seg = np.repeat(np.arange(len(LENGTHS)), LENGTHS).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in LENGTHS]).astype(np.int32)
    return np.stack([np.roll(seg, 8 * b) for b in range(B)]), np.stack([np.roll(pos, 8 * b) for b in range(B)])


def _dispatch(order: str, seg, pos, mesh) -> load_balance.Dispatch:
    """The order as a ``Dispatch`` (what its attended exchange is read from)."""
    if order in ("plan", "by_hand"):
        return load_balance.plan(seg, mesh, positions=pos, is_causal=True)
    return load_balance.fixed(seg, mesh, balanced=order == "dual_chunk", positions=pos, is_causal=True)


def _cp(order: str, mesh, exchange, seg, pos):
    """``f(q, k, v)``: attention on ``order``, its output in natural order."""
    dispatch = _dispatch(order, seg, pos, mesh)
    if exchange == "attended":  # balanced(fn, plan) hands fn the plan's own for "auto"
        exchange = "auto" if order == "plan" else dispatch.kv_exchange

    def attn(t, positions, kv_exchange=exchange):
        del positions  # the natural positions of the reordered tokens: the tree's per-document ones are used
        return jax_cp.dot_product_attention(t["q"], t["k"], t["v"], mesh=mesh, is_causal=True, positions=t["pos"],
                                            segment_ids=t["seg"], kv_exchange=kv_exchange)

    def by_hand(tree):
        reordered, positions = dispatch.reorder(tree)
        return dispatch.restore(attn(reordered, positions))

    run = {"natural": lambda tree: attn(tree, None), "dual_chunk": load_balance.balanced(attn, mesh),
           "plan": load_balance.balanced(attn, dispatch), "by_hand": by_hand}[order]
    return lambda q, k, v: run({"q": q, "k": k, "v": v, "seg": jnp.asarray(seg), "pos": jnp.asarray(pos)})


@pytest.mark.parametrize("order,cut,exchange,axis_type,closed_kv", CASES,
                         ids=[f"{o}-{e}-{'explicit' if a == EXPLICIT else 'auto'}-{'dq' if k else 'dqkv'}"
                              for o, _, e, a, k in CASES])
def test_eager_grad_matches_the_reference_and_jit(order, cut, exchange, axis_type, closed_kv):
    """Forward, eager gradients and jitted gradients of ``sum(out ** 2)``: its cotangent ``2 * out`` is
    committed where the eager ops after the attention (restoring the order, squaring) put it."""
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, axis_types=axis_type)
    seg, pos = _packed()
    q, k, v, _ = random_qkv(B, S, H, K, d, seed=c * 10 + u)
    f = _cp(order, mesh, exchange, seg, pos)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, positions=jnp.asarray(pos),
                                                          segment_ids=jnp.asarray(seg))
    if closed_kv:  # only q differentiated, K/V closed over
        args, cp_loss, ref_loss = (q,), lambda q: jnp.sum(f(q, k, v) ** 2), lambda q: jnp.sum(ref(q, k, v) ** 2)
    else:
        args, cp_loss, ref_loss = (q, k, v), lambda *a: jnp.sum(f(*a) ** 2), lambda *a: jnp.sum(ref(*a) ** 2)
    argnums = tuple(range(len(args)))
    r_out, r_grads = jax.jit(ref)(q, k, v), jax.jit(jax.grad(ref_loss, argnums))(*args)
    with jax.set_mesh(mesh) if axis_type == EXPLICIT else contextlib.nullcontext():
        out = f(q, k, v)  # Explicit: eager calls under the mesh, as plain JAX asks (README)
        eager = jax.grad(cp_loss, argnums)(*args)
        jitted = jax.jit(jax.grad(cp_loss, argnums))(*args)
    what = f"{order=} mesh={cut} {exchange=} {axis_type=} {closed_kv=}"
    assert_close(out, r_out, jnp.float32, f"forward {what}")
    for name, g, gj, rg in zip("qkv", eager, jitted, r_grads):
        assert_close(g, rg, jnp.float32, f"eager d{name} {what}")
        assert_close(g, gj, jnp.float32, f"eager vs jit d{name} {what}")
