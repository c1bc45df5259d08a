"""Local attention kernels equal the reference (forward and gradients); kernel choice and its errors."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers may each load libtpu for AOT compiles

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import kernels, reference
from jax_cp.kernels._blockwise import Meta, block_visible, blockwise_attention, make_spec
from util import assert_matches, fwd_and_vjp

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(B, T, S, H, K, d, dtype, *, order="arange", segments=None, seed=0):
    """q/k/v/cotangent and mask metadata for ``T`` queries among ``S`` keys.

    ``order="arange"``: keys at positions ``0..S-1``, queries are the last ``T``
    (a CP shard). ``"shuffled"``: each row's keys in a random order, queries a
    random subset of the key positions (load-balanced chunks look like this).
    ``segments``: document length (segment = position // length); ``"orphan"``
    also gives some queries a segment no key has and marks some tokens as
    padding (negative ids): rows that see nothing.
    """
    keys = jax.random.split(jax.random.key(seed), 3 + B)
    q = jax.random.normal(keys[0], (B, T, H, d), F32).astype(dtype)
    k, v = (jax.random.normal(kk, (B, S, K, d), F32).astype(dtype) for kk in jax.random.split(keys[1]))
    ct = jax.random.normal(keys[2], (B, T, H, d), F32).astype(dtype)
    if order == "arange":
        kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        q_pos = kv_pos[:, S - T:]
    else:
        kv_pos = jnp.stack([jax.random.permutation(kk, S).astype(jnp.int32) for kk in keys[3:]])
        q_pos = kv_pos[:, :T]
    meta = dict(q_positions=q_pos, kv_positions=kv_pos)
    if segments is not None:
        length = 7 if segments == "orphan" else segments
        q_seg, kv_seg = q_pos // length, kv_pos // length
        if segments == "orphan":  # plus padding: negative ids see nothing and are seen by nobody
            q_seg = jnp.where(jnp.arange(T) % 5 == 0, 1000, jnp.where(jnp.arange(T) % 7 == 3, -1, q_seg))
            kv_seg = jnp.where(jnp.arange(S) % 9 == 4, -2, kv_seg)
        meta.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    return (q, k, v), ct, meta


BLOCKWISE = [  # B, T, S, H, K, d, dtype, order, segments, mask, blocks
    (2, 32, 32, 4, 4, 8, F32, "arange", None, dict(is_causal=True), dict(block_q=8, block_kv=8)),
    (2, 24, 40, 4, 2, 8, BF16, "shuffled", 9, dict(is_causal=True, local_window_size=(6, 0)), dict(block_q=16, block_kv=16)),
    (1, 40, 56, 6, 1, 16, F32, "shuffled", "orphan", dict(local_window_size=(3, 5)), dict(block_q=12, block_kv=20)),
    (2, 16, 64, 4, 2, 8, BF16, "arange", 11, dict(scale=0.5), dict()),  # default blocks clamp to the sequence
]


@pytest.mark.parametrize("B,T,S,H,K,d,dtype,order,segments,mask,blocks", BLOCKWISE)
def test_blockwise_matches_reference(B, T, S, H, K, d, dtype, order, segments, mask, blocks):
    args, ct, meta = _inputs(B, T, S, H, K, d, dtype, order=order, segments=segments)
    f = lambda q, k, v: blockwise_attention(q, k, v, **meta, **mask, **blocks)
    ref = lambda q, k, v: reference.attend(q, k, v, **meta, **mask)
    assert_matches(f, ref, args, ct, dtype, f"{mask=} {blocks=}")


def test_auto_blocks_follow_the_platform_and_cap_the_tile():
    """CPU: 1024 x 512 (measured fastest at 1-8 local heads), halving the query block while the
    f32 score tile exceeds 16 MiB; elsewhere the 512 x 512 the TPU schedules were compiled with."""
    assert kernels.auto_blocks(1, 8, "cpu") == (1024, 512)  # 16 MiB exactly
    assert kernels.auto_blocks(2, 8, "cpu") == (512, 512)
    assert kernels.auto_blocks(4, 32, "cpu") == (128, 512)  # never below 128 rows
    assert kernels.auto_blocks(1, 8, "tpu") == kernels.auto_blocks(1, 8, "gpu") == (512, 512)
    assert kernels.auto_blocks(1, 1) == (1024, 512)  # this test runs on the CPU devices
    # masked: query blocks of at most half the chunk (the two runs of a load-balanced chunk apart)
    assert kernels.auto_blocks(1, 8, "cpu", q_len=1024, masked=True) == (512, 512)
    assert kernels.auto_blocks(1, 1, "cpu", q_len=8192, masked=True) == (1024, 512)
    assert kernels.auto_blocks(1, 1, "cpu", q_len=1024, masked=False) == (1024, 512)
    assert kernels.auto_blocks(1, 1, "cpu", q_len=64, masked=True) == (128, 512)  # never below 128 rows
    assert kernels.auto_blocks(1, 8, "tpu", q_len=256, masked=True) == (512, 512)  # the TPU tables' blocks


def _score_tiles(f, *args) -> set[str]:
    """The f32 score-tile shapes ``[..., Q, C]`` of the kernel's compiled loop bodies."""
    import re

    text = jax.jit(f).lower(*args).compile().as_text()
    return set(re.findall(r"f32\[(?:\d+,)*(\d+,\d+)\]\S* exponential", text))


@pytest.mark.parametrize("kv_exchange, layout", [("all_gather", (2, 2, 2)), ("ring", (4, 1, 2))])
def test_block_sizes_reach_the_kernel_through_the_entry_point(kv_exchange, layout):
    """``block_q``/``block_kv`` on ``dot_product_attention`` size every device's tiles (lengths they
    do not divide are padded and masked), the result matches the reference, and the default differs."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    (q, k, v), ct, _ = _inputs(2, 64, 64, 4, 2, 8, F32)
    seg = jnp.broadcast_to(jnp.arange(64) // 40, (2, 64))
    kw = dict(mesh=mesh, is_causal=True, segment_ids=seg, kv_exchange=kv_exchange)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, **kw, block_q=6, block_kv=12)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg)
    assert_matches(f, ref, (q, k, v), ct, F32, f"{kv_exchange} {layout}")
    local = 64 // c  # queries and keys per step: the colossal chunk (gathered keys: all 64)
    keys = 64 if kv_exchange == "all_gather" else local
    assert f"6,{min(12, keys)}" in _score_tiles(f, q, k, v)
    default = _score_tiles(lambda q, k, v: jax_cp.dot_product_attention(q, k, v, **kw), q, k, v)
    assert f"{local},{keys}" in default and f"6,{min(12, keys)}" not in default  # auto: clamped to the sequence


@pytest.mark.parametrize("name, value", [("block_q", 0), ("block_kv", -4), ("block_q", 2.5), ("block_kv", True)])
def test_block_size_errors_name_the_parameter(name, value):
    msg = rf"{name}={value!r} must be a positive int \(e\.g\. 512\) or None"
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    (q, k, v), _, _ = _inputs(2, 32, 32, 4, 2, 8, F32)
    with pytest.raises(ValueError, match=msg):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, **{name: value})
    with pytest.raises(ValueError, match=msg):
        jax_cp.CPAttention(4, 32, mesh=mesh, rngs=nnx.Rngs(0), **{name: value})
    with pytest.raises(ValueError, match=msg):
        jax_cp.AttentionSpec(num_heads=4, head_dim=8, **{name: value})


SPLASH = [  # interpret mode: the same Pallas kernel that runs on TPU, emulated
    (2, 40, 72, 4, 2, 8, BF16, "shuffled", 9, dict(is_causal=True)),
    (1, 24, 48, 6, 3, 8, F32, "shuffled", "orphan", dict(scale=0.7)),
    # windows: both bounds packed per query; one kv head runs splash's MQA form
    (2, 24, 40, 4, 2, 8, BF16, "shuffled", 9, dict(is_causal=True, local_window_size=(6, 0))),
    (1, 40, 56, 6, 1, 16, F32, "shuffled", "orphan", dict(local_window_size=(3, 5))),
]


@pytest.mark.parametrize("B,T,S,H,K,d,dtype,order,segments,mask", SPLASH)
def test_splash_interpret_matches_reference(B, T, S, H, K, d, dtype, order, segments, mask):
    args, ct, meta = _inputs(B, T, S, H, K, d, dtype, order=order, segments=segments, seed=1)
    f = lambda q, k, v: kernels.splash_attention(q, k, v, **meta, **mask, interpret=True)
    ref = lambda q, k, v: reference.attend(q, k, v, **meta, **mask)
    assert_matches(f, ref, args, ct, dtype, f"{mask=}")


@pytest.mark.parametrize("name", ["blockwise", "xla", "splash"])
def test_rows_that_see_nothing_are_zero(name):
    """Queries before every key (causal) or in an absent segment: zeros, zero gradients, no NaN."""
    (q, k, v), ct, meta = _inputs(1, 8, 16, 2, 1, 8, F32)
    meta.update(q_positions=jnp.arange(8, dtype=jnp.int32)[None] - 4, kv_positions=meta["kv_positions"],
                q_segment_ids=jnp.array([[0, 0, 0, 0, 0, 0, 7, 0]]), kv_segment_ids=jnp.zeros((1, 16), jnp.int32))
    fn = dict(blockwise=blockwise_attention, xla=kernels.dense_attention,
              splash=lambda *a, **kw: kernels.splash_attention(*a, **kw, interpret=True))[name]
    out, (dq, dk, dv) = fwd_and_vjp(lambda q, k, v: fn(q, k, v, **meta, is_causal=True), (q, k, v), ct)
    dead = np.array([True] * 4 + [False, False, True, False])  # positions -4..-1 see no key; row 6 is orphaned
    for a in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(a)).all()
    assert (np.asarray(out)[0, dead] == 0).all() and (np.asarray(dq)[0, dead] == 0).all()
    assert np.abs(np.asarray(out)[0, ~dead]).max() > 0


def test_causal_and_window_skip_blocks():
    """Scheduled block pairs: causal ~half, window a band, documents block-diagonal; any order of positions."""
    n, b = 64, 8
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    count = lambda qm, km, **mask: int(block_visible(qm, km, make_spec(8, **mask), b, b).sum())
    plain = Meta(pos, None, jnp.ones((1, n), bool))
    assert count(plain, plain) == 64
    assert count(plain, plain, is_causal=True) == 36  # 8*9/2
    assert count(plain, plain, is_causal=True, local_window_size=(8, 0)) == 15
    docs = Meta(pos, pos // 16, plain.valid)
    assert count(docs, docs) == 16  # four 2x2 diagonal blocks
    # Dual-chunk (load-balanced) order: rank 0 of 2 holds chunks 0 and 3 of 4.
    lb = jnp.concatenate([pos[:, :16], pos[:, 48:]], 1)
    q = Meta(lb, None, jnp.ones((1, 32), bool))
    assert count(q, plain, is_causal=True) == 1 + 2 + 7 + 8  # of 32: still about half


def test_future_tokens_get_exactly_zero_gradient():
    (q, k, v), ct, meta = _inputs(1, 32, 32, 2, 2, 8, F32)
    g = jax.grad(lambda k: blockwise_attention(q, k, v, **meta, is_causal=True, block_q=8, block_kv=8)[:, :10].sum())(k)
    assert (np.asarray(g)[:, 10:] == 0).all() and np.abs(np.asarray(g)[:, :10]).max() > 0


AUTO = [  # platform, mask, dtype, head_dim -> kernel
    ("tpu", dict(is_causal=True, window=None, has_segments=True), BF16, 128, "splash"),
    ("tpu", dict(is_causal=True, window=(128, 0), has_segments=False), BF16, 128, "splash"),
    ("tpu", dict(is_causal=True, window=(128, 0), has_segments=False, kv_len=8192), BF16, 128, "splash"),
    ("tpu", dict(is_causal=True, window=(128, 0), has_segments=False, kv_len=131072), BF16, 128, "blockwise"),
    ("tpu", dict(is_causal=True, window=None, has_segments=False, kv_len=131072), BF16, 128, "splash"),
    ("gpu", dict(is_causal=False, window=None, has_segments=False), BF16, 128, "cudnn"),
    ("gpu", dict(is_causal=True, window=None, has_segments=False), BF16, 128, "pallas_gpu"),
    ("gpu", dict(is_causal=False, window=None, has_segments=False), F32, 128, "pallas_gpu"),
    ("gpu", dict(is_causal=True, window=(64, 0), has_segments=True), BF16, 512, "blockwise"),
    ("cpu", dict(is_causal=False, window=None, has_segments=False), BF16, 64, "blockwise"),
]


@pytest.mark.parametrize("platform,mask,dtype,head_dim,want", AUTO)
def test_auto_selection(platform, mask, dtype, head_dim, want):
    assert kernels.select_kernel("auto", platform=platform, dtype=dtype, head_dim=head_dim, **mask) == want


ERRORS = [
    (dict(kernel="splash", platform="tpu", window=(4, 0), kv_len=65536),
     r"kernel='splash' cannot serve this call: local_window_size=\(4, 0\) over 65536 keys in one kernel call: "
     r"splash gets a window's two bounds per query in 16 bits each, so at most 65408 keys"),
    (dict(kernel="cudnn", platform="cpu"), r"kernel='cudnn' needs a CUDA GPU, but the target platform is 'cpu'"),
    (dict(kernel="cudnn", platform="gpu", is_causal=True), r"kernel='cudnn' cannot serve this call: is_causal=True"),
    (dict(kernel="cudnn", platform="gpu", has_segments=True), r"segment_ids are not expressible"),
    (dict(kernel="cudnn", platform="gpu", dtype=F32), r"dtype=float32 is not bfloat16/float16"),
    (dict(kernel="cudnn", platform="gpu", head_dim=12), r"head_dim=12 is not a multiple of 8"),
    (dict(kernel="flash", platform="gpu"), r"kernel='flash' is not one of"),
]


@pytest.mark.parametrize("spec,match", ERRORS, ids=[m[:30] for _, m in ERRORS])
def test_kernel_choice_errors(spec, match):
    kw = dict(is_causal=False, window=None, has_segments=False, dtype=BF16, head_dim=64) | spec
    with pytest.raises(ValueError, match=match):
        kernels.select_kernel(kw.pop("kernel"), **kw)


def test_errors_reach_the_caller():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    (q, k, v), _, _ = _inputs(2, 32, 32, 4, 2, 8, F32)
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: the max-logit statistic"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="splash", return_max_logits=True)
    with pytest.raises(ValueError, match=r"kernel='cudnn' needs a CUDA GPU"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="cudnn")
    with pytest.raises(ValueError, match=r"block_kv=0 must be a positive int"):
        blockwise_attention(q, k, v, q_positions=jnp.zeros((2, 32), jnp.int32),
                            kv_positions=jnp.zeros((2, 32), jnp.int32), block_kv=0)


# Splash runs here in Pallas interpret mode, whose backward inside shard_map fails a JAX type
# check on some meshes (seen with dp > 1); those are compiled for TPU below instead.
STRATEGIES = [  # kernel, (c, u, t), K, mask, dtype, primitive that proves the kernel ran
    ("blockwise", (2, 2, 2), 2, dict(is_causal=True, local_window_size=(5, 0)), F32, "while"),
    ("xla", (1, 8, 1), 8, dict(is_causal=True), BF16, None),
    ("splash", (2, 2, 2), 2, dict(is_causal=True, segments=True), F32, "pallas_call"),
    ("blockwise", (8, 1, 1), 1, dict(segments=True), BF16, "while"),
    ("splash", (1, 4, 2), 4, dict(), F32, "pallas_call"),
]


@pytest.mark.parametrize("kernel,cut,K,mask,dtype,prim", STRATEGIES)
def test_every_strategy_uses_the_selected_kernel(kernel, cut, K, mask, dtype, prim):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    B, S, H, d = 2, 64, 8, 8
    (q, k, v), ct, _ = _inputs(B, S, S, H, K, d, dtype, seed=2)
    mask = dict(mask)
    seg = (jnp.arange(S) // 24).astype(jnp.int32) if mask.pop("segments", False) else None
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel=kernel, segment_ids=seg, **mask)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, segment_ids=seg, **mask)
    jaxpr = str(jax.make_jaxpr(f)(q, k, v))
    for name in ("while", "pallas_call"):
        assert (name in jaxpr) == (name == prim), (kernel, name)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{kernel=} {cut=} {mask=}")


def test_splash_compiles_for_tpu():
    """``auto`` on TPU lowers splash through Mosaic (libtpu ahead-of-time), windows too (their packed
    bounds decoded in the kernel)."""
    pytest.importorskip("libtpu", reason="libtpu is needed for TPU ahead-of-time compilation")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, devices=topo.devices)
    B, S, H, K, d = 1, 1024, 4, 2, 128
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("cp_colossal", "cp_ulysses")))
    q = jax.ShapeDtypeStruct((B, S, H, d), BF16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((B, S, K, d), BF16, sharding=sharding)
    seg = jax.ShapeDtypeStruct((B, S), jnp.int32, sharding=sharding)

    def compiled(**mask):
        loss = lambda q, k, v, seg: jax_cp.dot_product_attention(
            q, k, v, mesh=mesh, segment_ids=seg, **mask).astype(F32).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()

    assert compiled(is_causal=True).count("tpu_custom_call") >= 3  # splash forward, dq, dkv
    assert compiled(is_causal=True, local_window_size=(128, 0)).count("tpu_custom_call") >= 3


def test_describe_says_what_auto_chose_and_why():
    assert jax_cp.describe_kernel(platform="tpu", kv_exchange="ring", is_causal=True) == "splash (auto on tpu)"
    assert jax_cp.describe_kernel(platform="tpu", is_causal=True, local_window_size=(128, 0)) == "splash (auto on tpu)"
    assert jax_cp.describe_kernel(platform="tpu", is_causal=True, local_window_size=(128, 0), kv_len=131072).startswith(
        "blockwise (auto on tpu: local_window_size=(128, 0) over 131072 keys in one kernel call")
    assert jax_cp.describe_kernel(platform="gpu", kv_exchange="ring") == (
        "pallas_gpu (auto on gpu with kv_exchange='ring': the ring's steps merge log-sum-exps, "
        "which cuDNN does not return)")
    assert jax_cp.describe_kernel(platform="gpu") == "cudnn (auto on gpu)"
    assert jax_cp.describe_kernel(platform="cpu") == "blockwise (auto on cpu: the portable kernel)"
    assert jax_cp.describe_kernel(kernel="splash", platform="tpu") == "splash (explicit)"
    with pytest.raises(ValueError, match=r"kernel='xla' cannot run kv_exchange='ring'"):
        jax_cp.describe_kernel(kernel="xla", kv_exchange="ring")
    assert jax_cp.describe_kernel(kernel="splash", platform="tpu", local_window_size=(4, 0)) == "splash (explicit)"
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: local_window_size=\(4, 0\) over"):
        jax_cp.describe_kernel(kernel="splash", platform="tpu", local_window_size=(4, 0), kv_len=10**5)


def test_splash_blocks_keep_the_mask_grid_within_smem():
    """Splash prefetches its block-grid masks into SMEM (1 MiB on v5p): 512 x 512 blocks of 512 (16M tokens
    on 64 chips, 262144 a device) overflowed it by 257 KiB in the TPU compiler. Blocks of 512 (or the
    largest of 256/128 dividing) up to ``MAX_BLOCKS`` of them a side; beyond, 1024 or 2048."""
    from jax_cp.kernels._splash import MAX_BLOCKS, _block

    assert [_block(n) for n in (128, 384, 4096, 65536, 196608)] == [128, 128, 512, 512, 512]
    for n in (229376, 262144, 393216, 786432):
        b = _block(n)
        assert b in (1024, 2048) and n % b == 0 and n // b <= MAX_BLOCKS, (n, b)
    assert 5 * MAX_BLOCKS**2 < 2**20  # an int32 and an int8 a pair of blocks


def test_splash_needs_its_private_entry_points(monkeypatch):
    """Splash runs on one private piece of JAX (the backward from given residuals); both JAX lines we
    test have it. On a release without it ``auto`` runs blockwise and says why, and an explicit
    ``kernel="splash"`` is a ValueError, never a crash deep in a trace."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as ska

    from jax_cp.kernels import _splash

    assert _splash.unavailable_reason() is None
    _splash.unavailable_reason.cache_clear()
    monkeypatch.delattr(ska, "_splash_attention_bwd")
    assert "has no _splash_attention_bwd(res, do, ...)" in _splash.unavailable_reason()
    _splash.unavailable_reason.cache_clear()
    monkeypatch.undo()
    why = "this JAX (9.9) has no _splash_attention_bwd(res, do, ...)"
    monkeypatch.setattr(_splash, "unavailable_reason", lambda: why)
    mask = dict(is_causal=True, window=None, has_segments=False, dtype=BF16, head_dim=128)
    assert kernels.select_kernel("auto", platform="tpu", **mask) == "blockwise"
    assert jax_cp.describe_kernel(platform="tpu", kv_exchange="ring") == f"blockwise (auto on tpu: {why})"
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: this JAX \(9\.9\)"):
        kernels.select_kernel("splash", platform="tpu", **mask)


@pytest.mark.parametrize("T, mask", [(256, dict(is_causal=True)), (200, dict(is_causal=True)),
                                     (384, dict(is_causal=True, local_window_size=(130, 0))),
                                     (300, dict(local_window_size=(40, 200))), (200, dict())])
def test_masks_known_when_traced_equal_the_sorted_ones(T, mask):
    """``_splash._natural_info`` (positions in order, built with NumPy when traced) gives the kernel the
    same block mask, block order, per-query bounds and rows-with-a-key as the run-time path (keys sorted,
    bounds counted) on arange positions, padding included (T = 200, 300: 56 and 84 padded lanes). The
    ring's other chunks: every key earlier (all visible) or later (none when causal). So does
    ``_natural_masks`` (what the kernels call: the per-query arrays computed in the program), jitted."""
    from jax_cp.kernels import _splash as sp
    from jax_cp._masks import normalize_window

    window = normalize_window(mask.get("local_window_size"))
    causal = mask.get("is_causal", False)
    Tp = sp._padded(T)

    def sorted_path(qpos, kpos):
        perm, keys = sp._sort_keys(kpos, None, T)
        zeros = jnp.zeros(Tp, jnp.int32)
        hi, lo = sp._bounds(qpos, is_causal=causal, window=window)
        q_lo = (zeros, zeros - 1, jnp.full(Tp, sp._IMAX, jnp.int32)) if lo is None else (zeros, zeros, lo)
        assert (np.asarray(perm)[:T] == np.arange(T)).all()  # in order already
        return sp._row_info(keys, (zeros, zeros, hi), q_lo, T=T, window=window is not None)

    def fields(info):
        infos, has_key = info
        return [np.asarray(x) for m in infos for x in (m.block_mask, m.data_next, m.q_sequence)] + [np.asarray(has_key)]

    pos = jnp.pad(jnp.arange(T, dtype=jnp.int32), (0, Tp - T))
    cases = [("same", pos)]
    if window is None:  # the ring's other chunks (windows never take this path)
        cases += [("earlier", pos + Tp), ("later", pos - Tp)]
    for keys, qpos in cases:
        want = fields(sorted_path(qpos, pos))
        traced = jax.jit(lambda: sp._natural_masks(Tp, Tp, T, T, causal, window, keys))()
        for name, got in [("numpy", fields(sp._natural_info(Tp, Tp, T, T, causal, window, keys))),
                          ("traced", fields(traced))]:
            assert len(got) == len(want) == 10
            for i, (w, g) in enumerate(zip(want, got)):
                np.testing.assert_array_equal(g, w, err_msg=f"{name} {keys} field {i} {T=} {mask=}")
    if causal and window is None:
        assert not fields(sp._natural_info(Tp, Tp, T, T, True, None, "later"))[-1].any()


def test_natural_positions_refuse_what_they_cannot_state():
    from jax_cp.kernels import _splash as sp

    q = jnp.zeros((1, 128, 2, 8), F32)
    pos = jnp.zeros((1, 128), jnp.int32)
    with pytest.raises(ValueError, match=r"natural_positions=True states positions arange\(S\) .* segment ids are given"):
        sp.splash_attention(q, q, q, q_positions=pos, kv_positions=pos, q_segment_ids=pos, kv_segment_ids=pos,
                            natural_positions=True, interpret=True)
    with pytest.raises(ValueError, match=r"128 queries meet 256 keys; pass natural_positions=False"):
        k = jnp.zeros((1, 256, 2, 8), F32)
        sp.splash_attention(q, k, k, q_positions=pos, kv_positions=jnp.zeros((1, 256), jnp.int32),
                            natural_positions=True, interpret=True)
    with pytest.raises(ValueError, match=r"natural=True states arange chunks .*\['window'\] given"):
        sp.ring_prepare(q, q, q, pos, None, scale=None, is_causal=True, interpret=True, window=(4, 0), natural=True)


def test_splash_counts_only_the_bounds_a_mask_has():
    """With positions passed (the sorted path), a causal call without segment ids or window sorts twice
    (the keys, then the queries' upper bounds among them): no lower bound exists, so none is counted.
    Segment ids add the count of keys in earlier documents."""
    from jax_cp.kernels import _splash as sp

    (q, k, v), _, meta = _inputs(1, 128, 128, 2, 2, 8, F32, order="shuffled")
    sorts = lambda **m: str(jax.make_jaxpr(lambda q: sp.splash_attention(q, k, v, is_causal=True, interpret=True,
                                                                         **meta, **m))(q)).count(" sort[")
    assert sorts() == 2 and sorts(q_segment_ids=meta["q_positions"] // 50, kv_segment_ids=meta["kv_positions"] // 50) == 3
