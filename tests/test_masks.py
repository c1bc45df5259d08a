"""Positions, packed documents, windows and causal load balancing under every strategy."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import load_balance as lb
from jax_cp import reference
from util import assert_close, assert_matches, fwd_and_vjp, random_qkv

B, S, H, K, d = 2, 32, 8, 2, 8
STRATEGIES = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (4, 1, 2), (1, 4, 2)]


def packed_segments(seed, batch, seq_len, max_docs=4, pad=True):
    """Random document boundaries per row; a random tail of padding (segment -1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        n_pad = int(rng.integers(0, seq_len // 4)) if pad else 0
        cuts = np.sort(rng.choice(np.arange(1, seq_len - n_pad), size=rng.integers(0, max_docs), replace=False))
        seg = np.zeros(seq_len, np.int32)
        for c in cuts:
            seg[c:] += 1
        seg[seq_len - n_pad:] = -1
        rows.append(seg)
    return jnp.asarray(np.stack(rows))


def packed_positions(seg):
    """Positions restart at 0 in every document (as a packing pipeline gives them)."""
    seg = np.asarray(seg)
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
    return jnp.asarray(pos)


def _cases():
    combos = itertools.cycle(itertools.product(
        (True, False),  # causal
        (None, 3, (5, 0)),  # window
        (True, False),  # balanced order
    ))
    for i, cut in enumerate(STRATEGIES):
        for _ in range(2):
            causal, window, balanced = next(combos)
            yield cut, causal, window, balanced, jnp.bfloat16 if i == 3 else jnp.float32


@pytest.mark.parametrize("cut,causal,window,balanced,dtype", list(_cases()))
def test_packed_windows_balanced(cut, causal, window, balanced, dtype):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=c * 10 + u)
    seg = packed_segments(c + 7 * u, B, S)
    pos = packed_positions(seg)
    if balanced:
        (q, k, v, ct, seg, pos), _ = lb.reorder((q, k, v, ct, seg, pos), mesh)
    kw = dict(is_causal=causal, local_window_size=window, segment_ids=seg, positions=pos)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{cut=} {causal=} {window=} {balanced=}")


def test_reorder_hands_back_the_positions_it_needs():
    """The order never travels without its positions: attention on reordered inputs with the
    positions reorder returned equals the reference on the same (reordered) data; without them
    the answer would be wrong (error ~1 against the balanced reference), which the old
    ``reorder`` returning only the tree made easy to forget."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, K, d, seed=5)
    (qb, kb, vb), pos = lb.reorder((q, k, v), mesh)
    assert pos.dtype == jnp.int32 and pos.shape == (S,)
    np.testing.assert_array_equal(pos, lb.positions(S, mesh))
    out = jax.jit(lambda q, k, v, p: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True,
                                                                  positions=p))(qb, kb, vb, pos)
    ref = reference.dot_product_attention(qb, kb, vb, is_causal=True, positions=pos)
    assert_close(out, ref, jnp.float32)
    forgot = reference.dot_product_attention(qb, kb, vb, is_causal=True)
    assert float(jnp.abs(forgot - ref).max()) > 0.1  # what passing no positions would compute
    assert_close(lb.restore(out, mesh), reference.dot_product_attention(q, k, v, is_causal=True), jnp.float32)
    _, natural = lb.reorder(q, jax_cp.make_mesh(cp_ulysses=8))  # no-op order: natural positions
    np.testing.assert_array_equal(natural, np.arange(S))
    with pytest.raises(ValueError, match=r"must share one sequence length on axis=1, got lengths \[16, 32\]"):
        lb.reorder((q, q[:, :16]), mesh)


@pytest.mark.parametrize("cut", [(4, 2, 1), (2, 2, 2), (8, 1, 1)])
def test_balanced_then_restored_equals_natural(cut):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, _ = random_qkv(B, S, H, K, d, seed=3)
    natural = jax.jit(lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True))(q, k, v)
    (qb, kb, vb), pos = lb.reorder((q, k, v), mesh)
    balanced = jax.jit(lambda q, k, v: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, is_causal=True, positions=pos))(qb, kb, vb)
    restored = lb.restore(balanced, mesh)
    assert restored.sharding.is_equivalent_to(balanced.sharding, 4)
    np.testing.assert_allclose(restored, natural, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(jax.jit(lambda b: lb.restore(b, mesh))(balanced), natural, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(pos, lb.reorder(jnp.arange(S), mesh, axis=0)[0])
    np.testing.assert_array_equal(pos, lb.positions(S, mesh))


@pytest.mark.parametrize("cut,planned", [((4, 2, 1), False), ((2, 2, 2), False), ((4, 2, 1), True),
                                         ((2, 2, 2), True)])
def test_balanced_runs_on_the_order_with_its_positions_and_restores(cut, planned):
    # lb.balanced: the function sees the balanced order and its positions, the caller natural order in
    # and out (per-document positions carried in the tree, reordered with it), forward and gradients.
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=5)
    seg = packed_segments(5, B, S)
    pos = packed_positions(seg)

    # the dual-chunk order (mesh) or a packed batch's dispatch plan, whose positions are per row
    order = lb.plan(np.asarray(seg), mesh, positions=np.asarray(pos)) if planned else mesh

    def attend(tree, positions):
        assert positions.shape == ((B, S) if planned else (S,))  # the positions of the reordered tokens
        o = jax_cp.dot_product_attention(tree["q"], tree["k"], tree["v"], mesh=mesh, is_causal=True,
                                         positions=tree["pos"], segment_ids=tree["seg"])
        return o, jnp.sum(o)  # a scalar passes as it is

    def f(q, k, v):
        return lb.balanced(attend, order)({"q": q, "k": k, "v": v, "seg": seg, "pos": pos})[0]

    def ref(q, k, v):
        return reference.dot_product_attention(q, k, v, is_causal=True, positions=pos, segment_ids=seg)

    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"balanced {cut}")

    def attend_natural(tree):
        return tree

    with pytest.raises(ValueError, match=r"fn='attend_natural' takes no positions= keyword.*positions=positions"):
        lb.balanced(attend_natural, mesh)


def test_reorder_restore_identity_and_layout():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    np.testing.assert_array_equal(lb.reorder(jnp.arange(16), mesh, axis=0)[0],
                                  [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    tree = {"tokens": jnp.arange(2 * 32).reshape(2, 32), "x": jnp.arange(2 * 32 * 3.0).reshape(2, 32, 3)}
    back = lb.restore(lb.reorder(tree, mesh)[0], mesh)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    np.testing.assert_array_equal(lb.restore(lb.reorder(tree["x"], mesh, axis=-2)[0], mesh, axis=-2), tree["x"])
    uly = jax_cp.make_mesh(cp_ulysses=8)
    np.testing.assert_array_equal(lb.reorder(tree["tokens"], uly)[0], tree["tokens"])  # no-op for Ulysses
    # reshape/reverse/concatenate only: no gather in the compiled program.
    hlo = jax.jit(lambda t: lb.reorder(t, mesh)[0]).lower(tree["x"]).as_text()
    assert "gather" not in hlo


def test_work_balance():
    mesh = jax_cp.make_mesh(cp_colossal=8)
    on = lb.work(mesh, 4096, is_causal=True, balanced=True)
    off = lb.work(mesh, 4096, is_causal=True, balanced=False)
    assert on.shape == (8,) and on.max() / on.min() <= 1.05
    assert 14 < off.max() / off.min() < 16
    assert on.sum() == off.sum() == 4096 * 4097 / 2
    full = lb.work(mesh, 256, is_causal=False, balanced=False)
    np.testing.assert_array_equal(full, 256 * 256 / 8)
    hybrid = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=4)
    w = lb.work(hybrid, 512, is_causal=True, balanced=True, local_window_size=64,
                segment_ids=packed_segments(0, 1, 512, pad=False))
    assert w.shape == (8,) and np.all(w > 0)


def test_fully_padded_rows_zero_and_no_nan():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=5)
    seg = jnp.where(jnp.arange(S) >= S - 8, -1, 0)[None].repeat(B, 0)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, segment_ids=seg)
    out, dq, dk, dv = (np.asarray(a) for a in jax.tree.leaves(fwd_and_vjp(f, (q, k, v), ct)))
    for a in (out, dq, dk, dv):
        assert np.isfinite(a).all()
    np.testing.assert_array_equal(out[:, -8:], 0)
    np.testing.assert_array_equal(dq[:, -8:], 0)
    np.testing.assert_array_equal(dk[:, -8:], 0)
    assert np.abs(out[:, :-8]).min() > 0 and np.abs(dq[:, :-8]).max() > 0


@pytest.mark.parametrize("balanced", [False, True])
def test_causality_by_gradient(balanced):
    """d y[p] / d x[p'] is exactly zero for every p' after p (module, hybrid tp mesh)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(8, 16, num_kv_heads=2, mesh=mesh, is_causal=True, rope_theta=10_000.0,
                              rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, S, 16))
    pos = jnp.arange(S)
    if balanced:
        x, pos = lb.reorder(x, mesh)
    p_natural = 13
    p_row = int(np.flatnonzero(np.asarray(pos) == p_natural)[0])
    pick = jnp.zeros((1, S, 1)).at[0, p_row, 0].set(1.0)  # selects row p_row (no slicing of a sharded axis)
    g = jax.jit(jax.grad(lambda x: (attn(x, positions=pos) * pick).sum()))(x)
    later = np.asarray(pos) > p_natural
    np.testing.assert_array_equal(np.asarray(g)[:, later], 0.0)
    assert np.abs(np.asarray(g)[:, ~later]).sum() > 0


def test_module_packed_window_matches_reference():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    kw = dict(num_kv_heads=2, is_causal=True, rope_theta=10_000.0)
    cp = jax_cp.CPAttention(8, 16, mesh=mesh, overlap_chunks=2, rngs=nnx.Rngs(0), **kw)
    ref = reference.Attention(8, 16, rngs=nnx.Rngs(0), **kw)
    seg = packed_segments(11, 2, S)
    (x, seg, pos), _ = lb.reorder((jax.random.normal(jax.random.key(1), (2, S, 16)), seg, packed_positions(seg)), mesh)
    call = dict(positions=pos, segment_ids=seg, local_window_size=(6, 0))
    assert_close(jax.jit(lambda x: cp(x, **call))(x), ref(x, **call), jnp.float32)


def test_metadata_errors():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, _ = random_qkv(B, S, H, K, d)
    attn = lambda **kw: jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw)
    with pytest.raises(ValueError, match=r"positions.shape=\(2, 16\) must be \(seq_len,\)=\(32,\) or \(batch, seq_len\)"):
        attn(positions=jnp.zeros((2, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"positions.shape=\(2, 1, 32\) must be \(seq_len,\)"):
        attn(positions=jnp.zeros((2, 1, S), jnp.int32))
    # (1, S) broadcasts to (batch, seq_len), like (S,): the same result.
    pos = jnp.arange(S, dtype=jnp.int32)[::-1]
    np.testing.assert_array_equal(attn(positions=pos[None], is_causal=True), attn(positions=pos, is_causal=True))
    with pytest.raises(ValueError, match=r"positions.dtype=float32 must be an integer dtype"):
        attn(positions=jnp.zeros((S,), jnp.float32))
    with pytest.raises(ValueError, match=r"segment_ids.shape=\(3, 32\)"):
        attn(segment_ids=jnp.zeros((3, S), jnp.int32))
    with pytest.raises(ValueError, match=r"local_window_size=\(2, -1\) is negative"):
        attn(local_window_size=(2, -1))
    with pytest.raises(ValueError, match=r"local_window_size='wide' must be None, an int, or a \(left, right\)"):
        attn(local_window_size="wide")
    big = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    with pytest.raises(ValueError, match=r"seq_len=12 is not divisible by 2\*cp_colossal=8"):
        lb.positions(12, big)
    with pytest.raises(ValueError, match=r"array.shape\[1\]=12 is not divisible by 2\*cp_colossal=8"):
        lb.reorder(jnp.zeros((2, 12)), big)
