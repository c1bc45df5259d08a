"""The dispatch plan of packed rows: balanced, exact on one document, invertible, correct end to end.

Visible pairs are counted here from the reordered positions and segment ids (a formula per token,
checked against a blockwise boolean mask), not by the library.
Letters: B batch, S sequence, H query heads, K kv heads, d head dim, c colossal ranks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from jax_cp import _dispatch, load_balance, reference
from util import assert_matches, random_qkv


def abstract_mesh(c: int, *, u: int = 1, dp: int = 1, t: int = 1) -> AbstractMesh:
    """A device-free mesh: planning needs only the axis sizes (c = 16 is more than the 8 devices)."""
    return AbstractMesh((dp, c, u, t), jax_cp.AXES)


def packed(rng, kind: str, mean: float, rows: int, S: int, pad: bool = False):
    """``(segment_ids, positions)`` ``[B, S]``: rows packed with documents of random length (the last
    cut to fit; with ``pad``, every other row ends in up to S/8 padding tokens)."""
    seg_BS, pos_BS = np.full((rows, S), -1, np.int32), np.zeros((rows, S), np.int32)
    for b in range(rows):
        end = S - (int(rng.integers(1, S // 8)) if pad and b % 2 else 0)
        n, doc = 0, 0
        while n < end:
            if kind == "lognormal":  # sigma = 1, mean `mean`
                L = rng.lognormal(np.log(mean) - 0.5, 1.0)
            else:  # Pareto (Lomax + 1), tail index 1.3: a few documents fill most of a row
                L = (rng.pareto(1.3) + 1) * mean * 0.3 / 1.3
            L = min(max(int(L), 1), end - n)
            seg_BS[b, n:n + L], pos_BS[b, n:n + L] = doc, np.arange(L)
            n, doc = n + L, doc + 1
    return seg_BS, pos_BS


def pairs_per_token(seg_BS, pos_BS, *, is_causal=True, left=None):
    """Keys each token sees, for documents at positions 0, 1, ... (as ``packed`` makes them):
    ``p + 1`` causal, ``min(p, left) + 1`` in a causal window, the document's length otherwise."""
    if not is_causal:
        counts = np.zeros_like(seg_BS, np.int64)
        for b in range(seg_BS.shape[0]):
            _, inverse, sizes = np.unique(seg_BS[b], return_inverse=True, return_counts=True)
            counts[b] = sizes[inverse]
    else:
        counts = pos_BS.astype(np.int64) + 1 if left is None else np.minimum(pos_BS, left).astype(np.int64) + 1
    return np.where(seg_BS >= 0, counts, 0)


def mask_pairs(seg_S, pos_S, c: int, *, is_causal=True, window=None, block=512):
    """Visible pairs of each of the ``c`` contiguous query slices of one reordered row, from the
    boolean mask of ``jax_cp._masks.visible``'s rule, a block of queries at a time."""
    T = seg_S.shape[0] // c
    out = np.zeros(c, np.int64)
    for start in range(0, seg_S.shape[0], block):
        sq, pq = seg_S[start:start + block, None], pos_S[start:start + block, None]
        m = (sq == seg_S[None]) & (seg_S[None] >= 0)
        if is_causal:
            m &= pos_S[None] <= pq
        if window is not None:
            m &= (pos_S[None] >= pq - window[0]) & (pos_S[None] <= pq + window[1])
        np.add.at(out, np.arange(start, start + sq.shape[0]) // T, m.sum(axis=1))
    return out


def slowest_over_mean(counts_BS, perm_BS, c: int, dp: int) -> np.ndarray:
    """Per dp shard: the slowest colossal rank's pairs over the mean, ``counts`` taken in ``perm``'s order."""
    B, S = counts_BS.shape
    per_rank = np.take_along_axis(counts_BS, perm_BS, axis=1).reshape(dp, B // dp, c, S // c).sum(axis=(1, 3))
    return per_rank.max(axis=1) / per_rank.mean(axis=1)


def dual_chunk_perm(S: int, c: int, B: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(load_balance.positions(S, abstract_mesh(c))), (B, S))


BALANCE = [(S, c, dist) for S in (32768, 131072) for c in (4, 8, 16)
           for dist in (("lognormal", 256), ("lognormal", 2048), ("pareto", 4096))]


@pytest.mark.parametrize("S,c,dist", BALANCE, ids=[f"S{S // 1024}K-c{c}-{k}{m}" for S, c, (k, m) in BALANCE])
def test_balance_of_packed_rows(S, c, dist):
    """Every row its own dp shard (the strictest case): slowest rank <= 1.05 x mean, where the
    dual-chunk order on the same rows leaves the slowest > 1.2 x mean."""
    B = 4 if S == 32768 else 2
    seg, pos = packed(np.random.default_rng([S, c, len(dist[0]), dist[1]]), *dist, B, S, pad=True)
    d = _dispatch.plan(seg, abstract_mesh(c, dp=B), positions=pos)
    assert d.perm.shape == (B, S) and d.perm.dtype == np.int32
    np.testing.assert_array_equal(d.positions, np.take_along_axis(pos, d.perm, axis=1))
    counts = pairs_per_token(seg, pos)
    planned = slowest_over_mean(counts, d.perm, c, B)
    dual = slowest_over_mean(counts, dual_chunk_perm(S, c, B), c, B)
    assert planned.max() <= 1.05, (planned, dual)
    assert dual.max() > 1.2 and np.all(dual >= planned), (planned, dual)
    np.testing.assert_allclose(d.imbalance(), planned.max(), rtol=1e-12)


def test_balance_summed_over_the_rows_of_each_dp_shard():
    """dp = 2 shards of 4 rows: ranks balance their shard's total, rows one by one need not."""
    c, B, S = 8, 8, 32768
    seg, pos = packed(np.random.default_rng(1), "lognormal", 1024, B, S)
    mesh = abstract_mesh(c, u=2, dp=2)
    d = _dispatch.plan(seg, mesh, positions=pos)
    counts = pairs_per_token(seg, pos)
    planned = slowest_over_mean(counts, d.perm, c, 2)
    assert planned.max() <= 1.05 and slowest_over_mean(counts, dual_chunk_perm(S, c, B), c, 2).max() > 1.2
    per_rank = np.take_along_axis(counts, d.perm, axis=1).reshape(2, B // 2, c, S // c).sum(axis=(1, 3))
    np.testing.assert_array_equal(d.work(), np.repeat(per_rank / 2, 2, axis=1))  # [dp, c*u], u = 2 share a chunk


@pytest.mark.parametrize("left", [None, 100])
def test_the_count_per_token_is_the_mask(left):
    """The per-token formula the balance tests use equals the boolean mask's count."""
    c, S = 4, 4096
    seg, pos = packed(np.random.default_rng(8), "lognormal", 300, 2, S, pad=True)
    d = _dispatch.plan(seg, abstract_mesh(c), positions=pos)
    counts = np.take_along_axis(pairs_per_token(seg, pos, left=left), d.perm, axis=1).reshape(2, c, -1).sum(axis=2)
    window = None if left is None else (left, 0)
    for b in range(2):
        np.testing.assert_array_equal(counts[b], mask_pairs(seg[b, d.perm[b]], d.positions[b], c, window=window))


MASKS = [dict(is_causal=True), dict(is_causal=True, local_window_size=(300, 0)), dict(is_causal=False),
         dict(is_causal=False, local_window_size=200)]


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "causal-window", "full", "window"])
def test_work_counts_the_mask(mask):
    """``work()`` equals the boolean mask's count on the reordered row, for every mask, with padding,
    positions that skip values and start anywhere, and a document whose tokens come back later in the row."""
    c, S = 4, 4096
    seg, pos = packed(np.random.default_rng(2), "lognormal", 300, 2, S, pad=True)
    pos = pos * 3 + 7 * seg  # gaps, and documents that do not start at 0
    seg[0, 100:200] = seg[0, 3000]  # tokens of a later document early in the row
    pos[0, 100:200] = pos[0, 3000] - 1000 + np.arange(100)
    d = _dispatch.plan(seg, abstract_mesh(c, dp=2), positions=pos, **mask)
    window = jax_cp._masks.normalize_window(mask.get("local_window_size"))
    for b in range(2):
        s, p = seg[b, d.perm[b]], d.positions[b]
        np.testing.assert_array_equal(d.work()[b], mask_pairs(s, p, c, is_causal=mask["is_causal"], window=window))
    if mask == dict(is_causal=False):
        counts = pairs_per_token(seg, pos, is_causal=False)
        assert slowest_over_mean(counts, d.perm, c, 2).max() <= 1.05


def test_balance_with_a_window():
    c, S, left = 8, 32768, 1024
    seg, pos = packed(np.random.default_rng(3), "lognormal", 4096, 2, S)
    d = _dispatch.plan(seg, abstract_mesh(c, dp=2), positions=pos, local_window_size=(left, 0))
    assert slowest_over_mean(pairs_per_token(seg, pos, left=left), d.perm, c, 2).max() <= 1.05


@pytest.mark.parametrize("c", [2, 4, 8, 16])
def test_one_document_is_the_dual_chunk_order(c):
    """A causal row of one document at natural positions gets exactly ``load_balance``'s order."""
    S, B = 256, 8
    mesh = jax_cp.make_mesh(cp_colossal=c) if c <= 8 else abstract_mesh(c)
    want = np.asarray(load_balance.reorder(jnp.arange(S)[None], mesh)[0])[0]
    for d in (_dispatch.plan(np.zeros((B, S), np.int32), mesh),
              _dispatch.plan(np.full((B, S), 5), mesh, positions=np.arange(S)[None].repeat(B, 0)),
              _dispatch.plan(None, mesh, positions=np.arange(S)[None].repeat(B, 0)),
              _dispatch.plan(np.zeros((B, S), np.int32), mesh, chunks_per_rank=2)):
        np.testing.assert_array_equal(d.perm, np.broadcast_to(want, (B, S)))
        np.testing.assert_array_equal(d.positions, d.perm)
        np.testing.assert_allclose(d.imbalance(), 1.0)


@pytest.mark.parametrize("balanced", [True, False])
def test_fixed_orders_count_what_load_balance_counts(balanced):
    """``load_balance.fixed``: the dual-chunk order (``reorder``'s) or the natural one as a Dispatch, its
    work per device equal to ``load_balance.work``'s count from masks, per dp shard, on packed rows
    with padding and per-document positions."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    S = 128
    seg, pos = packed(np.random.default_rng(11), "lognormal", 20, 4, S, pad=True)
    two_shards = jax_cp.MeshDims(dp=2, c=4, u=2, t=1)  # the mesh's CP axes, rows in two dp shards
    d = load_balance.fixed(seg, two_shards, balanced=balanced, positions=pos)
    want = np.asarray(load_balance.reorder(jnp.arange(S)[None], mesh)[0])[0] if balanced else np.arange(S)
    np.testing.assert_array_equal(d.perm, np.broadcast_to(want, (4, S)))
    for shard in range(2):
        rows = seg[2 * shard:2 * shard + 2]
        np.testing.assert_allclose(d.work()[shard], load_balance.work(mesh, S, is_causal=True, segment_ids=rows,
                                                                      balanced=balanced))
    shards = [load_balance.work(mesh, S, is_causal=True, segment_ids=seg[2 * i:2 * i + 2], balanced=balanced)
              for i in range(2)]
    assert d.imbalance() == pytest.approx(max(w.max() / w.mean() for w in shards), rel=1e-12)


def test_pure_ulysses_keeps_the_natural_order():
    """``cp_colossal = 1``: one rank holds the whole sequence after the all-to-all; nothing to balance."""
    seg, pos = packed(np.random.default_rng(9), "lognormal", 100, 2, 1000, pad=True)
    d = _dispatch.plan(seg, abstract_mesh(1, u=8, dp=2), positions=pos)
    np.testing.assert_array_equal(d.perm, np.broadcast_to(np.arange(1000), (2, 1000)))
    np.testing.assert_array_equal(d.positions, pos)
    np.testing.assert_array_equal(d.work(), np.repeat(pairs_per_token(seg, pos).sum(axis=1, keepdims=True) / 8, 8, 1))


def test_rows_in_one_shard_keep_their_own_orders():
    """A one-document row keeps the dual-chunk order beside a packed row that does not."""
    c, S = 4, 4096
    seg, pos = packed(np.random.default_rng(4), "lognormal", 256, 2, S)
    seg[1], pos[1] = 0, np.arange(S)
    d = _dispatch.plan(seg, abstract_mesh(c), positions=pos)
    np.testing.assert_array_equal(d.perm[1], dual_chunk_perm(S, c, 1)[0])
    assert not np.array_equal(d.perm[0], d.perm[1])
    assert np.array_equal(np.sort(d.perm, axis=1), np.broadcast_to(np.arange(S), (2, S)))


def test_deterministic():
    seg, pos = packed(np.random.default_rng(5), "pareto", 2048, 4, 32768)
    mesh = abstract_mesh(8, u=2, dp=2)
    a, b = (_dispatch.plan(seg, mesh, positions=pos) for _ in range(2))
    for name in ("perm", "inverse", "positions", "chunks", "pairs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.dims == b.dims


def _plan_small(mesh, seed=6, B=2, S=128, **kw):
    seg, pos = packed(np.random.default_rng(seed), "lognormal", 12, B, S, pad=True)
    return _dispatch.plan(seg, mesh, positions=pos, **kw), seg, pos


def test_round_trip_numpy_and_jax():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    d, seg, _ = _plan_small(mesh)
    x_BSHd = np.random.default_rng(0).normal(size=(2, 128, 3, 4)).astype(np.float32)
    x_BHSd = x_BSHd.transpose(0, 2, 1, 3)
    (xr, sr), positions = d.reorder((x_BSHd, seg), axis=1)
    assert isinstance(positions, np.ndarray) and isinstance(xr, np.ndarray)
    np.testing.assert_array_equal(d.reorder(x_BHSd, axis=2)[0], xr.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(d.reorder(x_BHSd, axis=-2)[0], xr.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(sr, np.take_along_axis(seg, d.perm, axis=1))
    np.testing.assert_array_equal(d.restore(xr), x_BSHd)
    np.testing.assert_array_equal(d.restore(d.reorder(x_BHSd, axis=2)[0], axis=2), x_BHSd)
    (xj,), pj = d.reorder((jnp.asarray(x_BSHd),))
    assert isinstance(xj, jax.Array) and isinstance(pj, jax.Array)
    np.testing.assert_array_equal(xj, xr)
    np.testing.assert_array_equal(d.restore(xj), x_BSHd)
    np.testing.assert_array_equal(pj, d.positions)


def test_round_trip_inside_jit_with_the_plan_as_an_argument():
    """The plan is a pytree: one compile serves every plan of the batch shape."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    traces = []

    @jax.jit
    def f(dispatch, x):
        traces.append(1)
        y, positions = dispatch.reorder(x)
        return dispatch.restore(y * 2), y, positions

    x = jnp.arange(2 * 128 * 3, dtype=jnp.float32).reshape(2, 128, 3)
    for seed in (6, 7):
        d = _plan_small(mesh, seed)[0]
        back, y, positions = f(d, x)
        np.testing.assert_array_equal(back, 2 * x)
        np.testing.assert_array_equal(y, d.reorder(np.asarray(x))[0])
        np.testing.assert_array_equal(positions, d.positions)
    assert len(traces) == 1
    closed = jax.jit(lambda x: d.restore(d.reorder(x)[0]))
    np.testing.assert_array_equal(closed(x), x)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_reorder_keeps_the_sharding(axis_type):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, dp=2, axis_types=axis_type)
    d = _plan_small(mesh)[0]
    sharding = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    x = jax.device_put(jnp.arange(2 * 128 * 3, dtype=jnp.float32).reshape(2, 128, 3), sharding)
    eager, jitted = d.reorder(x)[0], jax.jit(lambda x: d.reorder(x)[0])(x)
    # Inside jit an Auto mesh's arrays carry no sharding in their type: the compiler chooses one.
    for y in (eager, jitted) if axis_type == AxisType.Explicit else (eager,):
        assert y.sharding.is_equivalent_to(sharding, 3), y.sharding
    for y in (eager, jitted):
        np.testing.assert_array_equal(y, d.reorder(np.asarray(x))[0])
    np.testing.assert_array_equal(d.restore(d.reorder(x)[0]), x)


# (cp_colossal, cp_ulysses, tp), kv_exchange, kv heads, window, kernel: every exchange on both meshes,
# GQA, windows ("attended": the plan's own exchange); splash (ring steps, after Attended) and pallas_gpu
# run in Pallas interpret mode off their platforms.
E2E = [((4, 2, 1), "all_gather", 2, None, "auto"), ((4, 2, 1), "ring", 2, None, "auto"),
       ((4, 2, 1), "all_to_all", 8, None, "auto"), ((2, 2, 2), "all_gather", 2, (16, 0), "auto"),
       ((2, 2, 2), "ring", 2, None, "auto"), ((2, 2, 2), "all_to_all", 2, None, "auto"),
       ((8, 1, 1), "ring", 2, 24, "auto"), ((4, 2, 1), "ring", 2, None, "splash"),
       ((4, 2, 1), "all_gather", 2, None, "pallas_gpu"), ((4, 2, 1), "attended", 2, None, "splash"),
       ((4, 2, 1), "attended", 2, None, "pallas_gpu")]


@pytest.mark.parametrize("cut,kv_exchange,K,window,kernel", E2E)
def test_attention_on_the_dispatched_order_matches_the_reference(cut, kv_exchange, K, window, kernel):
    """reorder -> dot_product_attention -> restore equals the reference on the natural order,
    forward and gradients (through the reorder and the restore)."""
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    d, seg, pos = _plan_small(mesh, seed=c + 10 * u + (kernel != "auto"), local_window_size=window)
    ex = d.kv_exchange if kv_exchange == "attended" else kv_exchange
    q, k, v, ct = random_qkv(2, 128, 8, K, 8, seed=c * u)

    def f(q, k, v):
        (q, k, v, seg_r), positions = d.reorder((q, k, v, jnp.asarray(seg)))
        o = jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=positions,
                                         segment_ids=seg_r, local_window_size=window, kv_exchange=ex, kernel=kernel)
        return d.restore(o)

    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, positions=jnp.asarray(pos),
                                                          segment_ids=jnp.asarray(seg), local_window_size=window)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{cut=} {kv_exchange=} {K=} {window=} {kernel=}")


ERRORS = [
    (dict(segment_ids=np.zeros(128, np.int32)), r"segment_ids.shape=\(128,\) must be \[batch, seq_len\]"),
    (dict(segment_ids=np.zeros((2, 128), np.float32)), r"segment_ids.dtype=float32 must be an integer dtype"),
    (dict(positions=np.zeros((2, 64), np.int32)),
     r"positions.shape=\(2, 64\) differs from segment_ids.shape=\(2, 128\)"),
    (dict(segment_ids=None), r"segment_ids=None and positions=None give no shape"),
    (dict(segment_ids=np.zeros((3, 128), np.int32)), r"batch=3 is not divisible by dp=2"),
    (dict(segment_ids=np.zeros((2, 102), np.int32)),
     r"seq_len=102 is not divisible by 2\*cp_colossal=4.*multiple of 8"),
    (dict(mesh=abstract_mesh(2, u=3, dp=2)), r"seq_len=128 is not divisible by cp_colossal\*cp_ulysses=6"),
    (dict(chunks_per_rank=3), r"chunks_per_rank=3 must be an even integer >= 2"),
    (dict(local_window_size=-1), r"local_window_size=-1 is negative"),
    (dict(positions=np.full((2, 128), 2**40)), r"positions range over \[1099511627776, 1099511627776\], beyond int32"),
    (dict(mesh=jax.sharding.AbstractMesh((2, 4), ("data", "seq"))), r"mesh.axis_names=\('data', 'seq'\) lacks"),
]


@pytest.mark.parametrize("kw,match", ERRORS)
def test_plan_errors(kw, match):
    args = dict(segment_ids=np.zeros((2, 128), np.int32), mesh=abstract_mesh(2, u=2, dp=2)) | kw
    with pytest.raises(ValueError, match=match):
        _dispatch.plan(args.pop("segment_ids"), args.pop("mesh"), **args)


def test_traced_segment_ids_are_refused():
    with pytest.raises(ValueError, match=r"segment_ids is a traced value: plan runs on the host"):
        jax.jit(lambda s: _dispatch.plan(s, abstract_mesh(2)).perm)(jnp.zeros((1, 16), jnp.int32))


def test_reorder_errors():
    d = _plan_small(abstract_mesh(4))[0]
    with pytest.raises(ValueError, match=r"reorder: an array of shape \(2, 64, 3\) has \(batch, seq_len\)=\(2, 64\)"):
        d.reorder(np.zeros((2, 64, 3)))
    with pytest.raises(ValueError, match=r"restore: an array of shape \(128,\) has no sequence axis=1"):
        d.restore(np.zeros(128))
    with pytest.raises(ValueError, match=r"reorder: an array of shape \(2, 128\) has no sequence axis=0"):
        d.reorder(np.zeros((2, 128)), axis=0)
