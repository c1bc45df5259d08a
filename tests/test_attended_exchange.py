"""``exchanges.Attended``: K/V blocks sent only where queries may see them, on a dispatch plan's order.

Exact against the single-device reference (forward and gradients) on every mesh shape, with
windows and grouped kv heads, for both transports (one ragged all-to-all; a ``ppermute`` per
ring distance), both when the plan's buffers suffice (the all-gather branch is poisoned, so the
answer must come from the blocks sent) and when they overflow. Bytes are counted from the sizes
the ragged all-to-all is given on the devices (or the static sizes) against the remote keys each
rank's queries see, counted here from the reordered positions and segment ids, not by the library.
Letters: B batch, S sequence, H query heads, K kv heads, c colossal ranks.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

import jax_cp
from jax_cp import exchanges, load_balance, reference
from jax_cp.exchanges import attended
from test_dispatch import packed
from util import assert_matches, random_qkv


def _plan(mesh, seed, B=2, S=256, mean=10.0, window=None):
    seg, pos = packed(np.random.default_rng(seed), "lognormal", mean, B, S, pad=True)
    return load_balance.plan(seg, mesh, positions=pos, local_window_size=window), seg, pos


def _check(mesh, d, seg, pos, exchange, K, window, seed, kernel="auto"):
    q, k, v, ct = random_qkv(seg.shape[0], seg.shape[1], 8, K, 8, seed=seed)

    def f(q, k, v):
        (q, k, v, seg_r), positions = d.reorder((q, k, v, jnp.asarray(seg)))
        o = jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=positions, segment_ids=seg_r,
                                         local_window_size=window, kv_exchange=exchange, kernel=kernel)
        return d.restore(o)

    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, positions=jnp.asarray(pos),
                                                          segment_ids=jnp.asarray(seg), local_window_size=window)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{exchange} {K=} {window=} {kernel=}")


# (cp_colossal, cp_ulysses, tp), kv heads, window: colossal only, hybrid, tp; GQA and windows.
CASES = [((4, 2, 1), 2, None), ((8, 1, 1), 2, (16, 0)), ((2, 2, 2), 2, 24), ((4, 1, 2), 8, None)]


@pytest.mark.parametrize("transport", ["ragged", "ppermute"])
@pytest.mark.parametrize("cut,K,window", CASES)
def test_the_plan_s_exchange_matches_the_reference(cut, K, window, transport, monkeypatch):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    d, seg, pos = _plan(mesh, seed=c + 10 * u + t, window=window)
    ex = d.kv_exchange_for(local_window_size=window, transport=transport)
    assert isinstance(ex, exchanges.Attended)
    assert (ex.capacity is not None, len(ex.sizes)) == ((True, 0) if transport == "ragged" else (False, c - 1))
    assert ex == d.kv_exchange or transport == "ppermute"  # ragged: the plan's own
    # The plan's buffers hold every needed block: the answer comes from them, not from the all-gather.
    monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
    _check(mesh, d, seg, pos, ex, K, window, seed=c * u)


@pytest.mark.parametrize("kernel", ["pallas_gpu", "xla"])
def test_own_and_received_keys_merge_exactly_on_every_kernel(kernel, monkeypatch):
    """The own and the received keys attended apart and merged by their log-sum-exp, on the kernels
    the default (blockwise) and splash tests do not cover: pallas_gpu (interpret mode off GPU) and
    "xla", with a window; the all-gather branch poisoned."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    d, seg, pos = _plan(mesh, seed=21, S=128, window=(16, 0))
    ex = d.kv_exchange
    assert 0 < ex.received_tokens() < 2 * 128 * 3 // 4, ex  # some keys arrive, not all
    monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
    _check(mesh, d, seg, pos, ex, 2, (16, 0), seed=7, kernel=kernel)


def test_fewer_blocks_than_a_rank_holds_are_sent(monkeypatch):
    """Short documents on c = 4: every rank receives a fraction of the others' keys, and is exact."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    d, seg, pos = _plan(mesh, seed=3, S=512, mean=6.0)
    monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
    for ex, rows in ((d.kv_exchange, 2), (d.kv_exchange_for(transport="ppermute"), 1)):  # per device / per row
        assert 0 < ex.received_tokens() < rows * 512 * 3 // 4, ex  # less than an all-gather brings
        _check(mesh, d, seg, pos, ex, 2, None, seed=1)


@pytest.mark.parametrize("cut,window", [((4, 2, 1), None), ((2, 2, 2), (8, 0))])
def test_too_small_buffers_fall_back_and_stay_exact(cut, window):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    d, seg, pos = _plan(mesh, seed=5, mean=30.0, window=window)
    block = d.kv_exchange.block
    counts = attended.needed_blocks(d.positions, np.take_along_axis(seg, d.perm, axis=1), c, block,
                                    is_causal=True, local_window_size=window, query_block=d.kv_exchange.query_block)
    assert counts.max() > 1  # some rank needs more than one block from some other: the overflow branch runs
    for small in (exchanges.Attended(block=block, sizes=(1,) * (c - 1)), exchanges.Attended(block=block, capacity=1)):
        _check(mesh, d, seg, pos, small, 2, window, seed=2)


def test_at_most_four_exchanges_over_a_hundred_batches():
    """One batch shape, 100 random packed batches: a handful of distinct values (compiled programs)."""
    mesh = AbstractMesh((2, 4, 2, 1), jax_cp.AXES)
    rng = np.random.default_rng(0)
    seen, seen_ppermute = set(), set()
    for _ in range(100):
        seg, pos = packed(rng, "lognormal", 256, 2, 4096)
        d = load_balance.plan(seg, mesh, positions=pos)
        seen.add(d.kv_exchange)
        seen_ppermute.add(d.kv_exchange_for(transport="ppermute"))
    assert len(seen) <= 4 and len(seen_ppermute) <= 4, (seen, seen_ppermute)
    assert min(x.received_tokens() for x in seen) < 4096 * 3 // 4, seen  # less than an all-gather brings


def needed_remote_keys(seg_S, pos_S, c: int, left=None) -> np.ndarray:
    """``[c]``: keys on other ranks that each rank's queries see (causal, same document, at most
    ``left`` positions back): a key is seen iff the first query of its document at or after it
    (in document order) is within reach."""
    T, span = seg_S.shape[0] // c, int(pos_S.max()) + 2
    key = seg_S.astype(np.int64) * span + pos_S
    out = np.zeros(c, np.int64)
    for r in range(c):
        q, k = np.sort(key[r * T:(r + 1) * T]), np.concatenate([key[:r * T], key[(r + 1) * T:]])
        i = np.minimum(np.searchsorted(q, k), T - 1)
        seen = (q[i] >= k) & (q[i] // span == k // span) & (k // span >= 0)
        out[r] = (seen & (q[i] - k <= (left if left is not None else span))).sum()
    return out


def test_needed_remote_keys_counts_the_mask():
    seg, pos = packed(np.random.default_rng(1), "lognormal", 20, 1, 256)
    for left in (None, 7):
        for r, n in enumerate(needed_remote_keys(seg[0], pos[0], 4, left)):
            q = slice(64 * r, 64 * (r + 1))
            m = (seg[0, q, None] == seg[0][None]) & (pos[0][None] <= pos[0, q, None])
            if left is not None:
                m &= pos[0][None] >= pos[0, q, None] - left
            m[:, q] = False
            assert m.any(axis=0).sum() == n


# distribution, mean document, c, window.
BYTES = [("lognormal", 16384, 4, None), ("lognormal", 16384, 8, None), ("lognormal", 256, 4, None),
         ("lognormal", 2048, 8, None), ("pareto", 2048, 8, None), ("lognormal", 16384, 4, 1024)]


@pytest.mark.parametrize("kind,mean,c,window", BYTES)
def test_received_bytes_follow_the_keys_attended(kind, mean, c, window):
    """Per row, the key tokens every rank receives (block times its blocks, the sizes the ragged
    all-to-all is given) over the remote keys its queries see (counted here): at most 1.5x; the static
    buffers hold less than twice the busiest device's (a power of two). A window layer moves about a
    window per chunk it holds, not the sequence."""
    S, B = 32768, 2
    seg, pos = packed(np.random.default_rng(c), kind, mean, B, S)
    mesh = AbstractMesh((B, c, 1, 1), jax_cp.AXES)  # one row per dp shard
    w = None if window is None else (window, 0)
    d = load_balance.plan(seg, mesh, positions=pos, local_window_size=w)
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    ex = d.kv_exchange
    assert (ex.block, ex.query_block) == (attended.KEY_BLOCK, attended.BLOCK)
    blocks = attended.needed_blocks(d.positions, seg_r, c, ex.block, is_causal=True, local_window_size=w,
                                    query_block=ex.query_block)
    for b in range(B):
        need = needed_remote_keys(seg_r[b], d.positions[b], c, window)
        received = blocks[b].sum(axis=1) * ex.block  # [receiver]
        assert (received <= 1.5 * need).all(), (b, received, need)  # every rank, also one needing little
        assert (received >= need).all()  # nothing seen is left behind
        if window is not None:  # a window of keys (plus a block either side) per chunk the rank holds
            assert received.max() <= d.chunks.shape[1] // c * (window + 2 * ex.block), received
    assert ex.received_tokens() < 2 * blocks.sum(axis=2).max() * ex.block  # the buffers: a power of two


@pytest.mark.parametrize("blocks", [None, (4, 16)])
def test_the_ragged_all_to_all_is_given_the_host_s_counts(blocks, monkeypatch):
    """The sizes each device hands the ragged all-to-all (read back through a callback) equal the
    host's count of blocks each rank needs from each other rank (summed over the device's rows): the
    plan's exchange, and key blocks of 4 tokens tested against query blocks of 16 (exact, too: the
    all-gather branch poisoned)."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    d, seg, pos = _plan(mesh, seed=8, S=256, mean=12.0)
    seg_r = np.take_along_axis(seg, d.perm, axis=1)
    ex = d.kv_exchange
    if blocks is not None:
        counts = attended.needed_blocks(d.positions, seg_r, 4, blocks[0], is_causal=True, query_block=blocks[1])
        ex = attended.ragged_exchange_for(counts, blocks[0], 64 // blocks[0], dp=1, query_block=blocks[1])
        assert ex.query_block == 16 and counts.sum() < attended.needed_blocks(
            d.positions, seg_r, 4, blocks[1], is_causal=True).sum() * blocks[1] // blocks[0]  # finer: fewer keys
        monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
        _check(mesh, d, seg, pos, ex, 2, None, seed=4)
    seen = {}
    original = attended.ragged_all_to_all

    def spy(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
        me = jax.lax.axis_index(axis_name)
        jax.debug.callback(lambda r, s: seen.setdefault(int(r), np.asarray(s)), me, recv_sizes)
        return original(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name)

    monkeypatch.setattr(attended, "ragged_all_to_all", spy)
    q = jnp.ones((2, 256, 8, 8), jnp.float32)
    (q_r,), positions = d.reorder((q,))
    jax_cp.dot_product_attention(q_r, q_r, q_r, mesh=mesh, is_causal=True, positions=positions,
                                 segment_ids=jnp.asarray(seg_r), kv_exchange=ex).block_until_ready()
    host = attended.needed_blocks(d.positions, seg_r, 4, ex.block, is_causal=True,
                                  query_block=ex.query_block).sum(axis=0)  # [receiver, sender]: both rows, each device
    assert sorted(seen) == [0, 1, 2, 3] and host.sum() > 0
    for r in range(4):
        np.testing.assert_array_equal(seen[r], host[r])


def test_the_ragged_transport_compiles_for_tpu():
    """Ahead of time for v5e:2x2 (libtpu): forward and backward each move K/V with an asynchronous ragged
    all-to-all, and the splash kernel on the device's own keys runs while the forward one is in flight
    (the own and the received keys are attended apart and merged); the backward's overlaps dq."""
    pytest.importorskip("libtpu", reason="libtpu is needed for TPU ahead-of-time compilation")
    from jax.experimental import topologies

    from jax_cp.plan._hlo import analyze_schedule

    mesh = jax_cp.make_mesh(cp_colossal=4, devices=topologies.get_topology_desc("v5e:2x2", "tpu").devices)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("cp_colossal", "cp_ulysses")))
    x = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16, sharding=spec)
    seg = jax.ShapeDtypeStruct((1, 2048), jnp.int32, sharding=spec)
    ex = exchanges.Attended(block=32, query_block=128, capacity=20)  # the plan's blocks; 640 keys, not a tile multiple
    loss = lambda q, k, v, seg: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, segment_ids=seg,
                                                            kv_exchange=ex).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, kv, kv, seg).compile().as_text()
    schedule = analyze_schedule(hlo, mesh_shape=tuple(mesh.shape.values()), axis_names=tuple(mesh.axis_names))
    ragged = {x.phase: x for x in schedule.collectives if x.kind == "ragged-all-to-all"}
    assert set(ragged) == {"fwd", "bwd"} and all(x.is_async and x.axes == ("cp_colossal",) for x in ragged.values())
    inside = {phase: " ".join(x.compute_inside) for phase, x in ragged.items()}
    assert "splash_mha_fwd" in inside["fwd"] and "splash_mha_dq" in inside["bwd"], inside


def test_a_window_needs_no_more_than_the_whole_mask():
    mesh = AbstractMesh((1, 4, 1, 1), jax_cp.AXES)
    seg, pos = packed(np.random.default_rng(2), "lognormal", 2048, 1, 8192)
    d = load_balance.plan(seg, mesh, positions=pos)
    assert d.kv_exchange_for(local_window_size=(64, 0)).received_tokens() <= d.kv_exchange.received_tokens()
    assert d.kv_exchange_for(is_causal=False).received_tokens() >= d.kv_exchange.received_tokens()


def test_the_value_is_static_and_accepted_where_names_are():
    ex = exchanges.Attended(block=8, sizes=[2, 2, 2])
    assert ex == exchanges.Attended(block=8, sizes=(2, 2, 2)) and hash(ex) == hash(exchanges.Attended(8, (2, 2, 2)))
    assert exchanges.resolve(ex) is ex and ex.received_tokens() == 48
    assert exchanges.Attended(block=8, sizes=(2, 2, 2), query_block=8) == ex  # query_block = block: the default
    assert jax_cp.AttentionSpec(num_heads=4, head_dim=8, kv_exchange=ex).kv_exchange == ex
    assert "attended" not in exchanges.NAMES  # its sizes are a batch's: no public string


ERRORS = [(dict(block=0), r"Attended\(block=0\) must be a positive int"),
          (dict(block=8, sizes=(1,), capacity=2), r"capacity must be an int >= 0 and then sizes empty"),
          (dict(block=8, capacity=-1), r"Attended\(capacity=-1, sizes=\(\)\)"),
          (dict(block=8, sizes=(1, -2)), r"Attended\(sizes=\(1, -2\)\) must be a tuple of ints >= 0"),
          (dict(block=8, sizes=3), r"Attended\(sizes=3\) must be a tuple of ints >= 0.*load_balance.plan"),
          (dict(block=8, query_block=0), r"Attended\(query_block=0\) must be a positive int")]


@pytest.mark.parametrize("kw,match", ERRORS)
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        exchanges.Attended(**kw)


def test_sizes_and_block_must_fit_the_mesh():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q = jnp.ones((2, 64, 4, 8), jnp.float32)
    for ex, match in ((exchanges.Attended(block=8, sizes=(1, 1)), r"has 2 sizes, cp_colossal=4 needs 3"),
                      (exchanges.Attended(block=5, sizes=(1, 1, 1)), r"block=5 does not divide the 16 keys")):
        with pytest.raises(ValueError, match=match):
            jax_cp.dot_product_attention(q, q, q, mesh=mesh, is_causal=True, kv_exchange=ex)


def test_the_plan_s_exchange_is_read_on_the_host():
    d = _plan(AbstractMesh((1, 2, 1, 1), jax_cp.AXES), seed=0, B=1, S=64)[0]
    with pytest.raises(ValueError, match=r"Dispatch.kv_exchange is read on the host"):
        jax.jit(lambda d: d.kv_exchange.block)(d)
    with pytest.raises(ValueError, match=r"is_causal=1 must be True or False"):
        d.kv_exchange_for(is_causal=1)
    with pytest.raises(ValueError, match=r"transport='ring' must be 'ragged' or 'ppermute'"):
        d.kv_exchange_for(transport="ring")


def _rule_counts(q, k, c: int, causal: bool, window):
    """``sees`` on every (query block, key block) pair, as ``[B, receiver, sender]`` block counts."""
    m = attended.sees(np, q, k, causal, window)
    B, Nq, Nk = m.shape
    counts = m.reshape(B, c, Nq // c, c, Nk // c).any(axis=2).sum(axis=-1)
    counts[:, np.arange(c), np.arange(c)] = 0
    return counts


@pytest.mark.parametrize("window", [None, (40, 0), (16, 16)])
def test_the_host_count_equals_the_block_rule_on_every_pair(window):
    """``needed_from_summary`` tests only the block pairs whose ranges meet; every pair through
    ``sees`` gives the same counts (causal and not)."""
    rng = np.random.default_rng(3)
    seg, pos = packed(rng, "lognormal", 30.0, 2, 512, pad=True)
    span = np.where(rng.random((2, 512)) < 0.3, seg + 1, 0)  # some tokens in a span of their document
    for spans in (None, span):
        summary, queries = (attended.block_summary(np, pos, seg, u, spans) for u in (8, 32))
        for causal in (True, False):
            for q in (summary, queries):
                fast = attended.needed_from_summary(summary, 4, is_causal=causal, local_window_size=window,
                                                    query_summary=None if q is summary else q)
                np.testing.assert_array_equal(fast, _rule_counts(q, summary, 4, causal, window))
                assert fast.sum() > 0


def test_the_host_count_holds_for_negative_span_ids_and_extreme_positions():
    """Any span id but 0 is a span (negative ones too), and positions may sit anywhere in int32: on the
    int32 summaries a ``Dispatch`` stores, the host's count equals the block rule on every pair
    evaluated on int64 copies (where no difference overflows)."""
    rng = np.random.default_rng(5)
    seg, pos = packed(rng, "lognormal", 12.0, 2, 256, pad=True)
    i32 = np.iinfo(np.int32)
    pos = pos + np.where(seg % 2 == 0, i32.max - 300, i32.min + 300)  # documents at both ends of int32
    span = np.where(rng.random((2, 256)) < 0.4, -1 - seg, 0)
    keys, queries = (attended.block_summary(np, pos.astype(np.int32), seg.astype(np.int32), u, span.astype(np.int32))
                     for u in (4, 16))
    wide = lambda s: attended.block_summary_of(np.stack([np.asarray(a, np.int64) for a in s], axis=-2))
    for window in (None, (16, 0), (8, 8)):
        for causal in (True, False):
            fast = attended.needed_from_summary(keys, 4, is_causal=causal, local_window_size=window,
                                                query_summary=queries)
            np.testing.assert_array_equal(fast, _rule_counts(wide(queries), wide(keys), 4, causal, window),
                                          err_msg=f"{window=} {causal=}")
            assert fast.sum() > 0


def test_balanced_hands_fn_the_plan_s_exchange_for_auto(monkeypatch):
    """``load_balance.balanced(fn, plan)``: an ``fn`` with a ``kv_exchange`` parameter gets the plan's
    exchange for ``"auto"`` (or none passed), keeps an explicit one, and a traced plan hands none; the
    answer equals the reference (the all-gather branch poisoned: the plan's blocks suffice)."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    d, seg, pos = _plan(mesh, seed=12)
    got = []

    def attend(tree, positions, kv_exchange="auto"):
        got.append(kv_exchange)
        q, k, v, seg_r = tree
        return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=positions,
                                            segment_ids=seg_r, kv_exchange=kv_exchange)

    q, k, v, ct = random_qkv(2, 256, 8, 2, 8, seed=3)
    ref = reference.dot_product_attention(q, k, v, is_causal=True, positions=jnp.asarray(pos),
                                          segment_ids=jnp.asarray(seg))
    monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
    g = load_balance.balanced(attend, d)
    np.testing.assert_allclose(g((q, k, v, jnp.asarray(seg))), ref, atol=2e-5, rtol=2e-5)
    g((q, k, v, jnp.asarray(seg)), kv_exchange="auto")
    monkeypatch.undo()
    g((q, k, v, jnp.asarray(seg)), kv_exchange="all_gather")
    assert got == [d.kv_exchange, d.kv_exchange, "all_gather"], got
    jax.jit(lambda d, tree: load_balance.balanced(attend, d)(tree))(d, (q, k, v, jnp.asarray(seg)))
    assert got[-1] == "auto"  # a traced plan: its sizes are not known, fn's own default runs
    no_param = load_balance.balanced(lambda tree, positions: tree[0], d)
    np.testing.assert_array_equal(no_param((q, k, v, jnp.asarray(seg))), q)  # fn without kv_exchange: untouched
