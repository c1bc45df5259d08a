"""Bidirectional spans (``span_ids``): a causal mask also lets a token see the later tokens of its
own span (prefix-LM prompts, image tokens, block-causal video frames).

Every exchange, mesh shape and kernel that takes spans is checked against a dense reference written
here from the rule itself (not ``jax_cp._masks``), forward and gradients, on random spans: prompt
prefixes, several spans per row, spans crossing CP chunk boundaries and ring steps, spans inside
packed documents, on the natural, the load-balanced and the dispatched orders.
Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import exchanges, kernels, load_balance, reference
from test_dispatch import packed
from util import assert_close, assert_matches, random_qkv

B, S, H, d = 2, 64, 8, 8


def random_spans(rng, seg_BS, n_max=3):
    """``[B, S]`` span ids: per row a prompt prefix (maybe) and up to ``n_max`` more spans at random
    places and lengths (across documents and chunk boundaries too); 0 elsewhere."""
    span = np.zeros(seg_BS.shape, np.int32)
    for b in range(seg_BS.shape[0]):
        if rng.random() < 0.5:
            span[b, :rng.integers(2, seg_BS.shape[1] // 3)] = 1
        for i in range(rng.integers(1, n_max + 1)):
            start = rng.integers(0, seg_BS.shape[1] - 2)
            span[b, start:start + rng.integers(2, seg_BS.shape[1] // 2)] = i + 2
    return span


def mask_np(pos, seg, span, *, is_causal=True, window=None):
    """``[B, S, S]``: the rule, written from the issue's words. q sees k iff same segment (ids >= 0),
    inside the window, and (not causal, or pos_k <= pos_q, or span_q == span_k != 0)."""
    qp, kp = pos[:, :, None], pos[:, None, :]
    m = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0) & (seg[:, :, None] >= 0)
    if window is not None:
        m &= (kp >= qp - window[0]) & (kp <= qp + window[1])
    if is_causal:
        m &= (kp <= qp) | ((span[:, :, None] == span[:, None, :]) & (span[:, :, None] != 0))
    return m


def dense_reference(q, k, v, mask_BSS, scale=None):
    """Softmax attention over the given ``[B, S, S]`` mask; rows that see nothing output zeros."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    m = jnp.asarray(mask_BSS)[:, None]
    s = jnp.where(m, s, -1e30)
    shift = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.exp(s - jnp.where(shift < -1e29, 0.0, shift)) * m
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _packed_rows(seed):
    rng = np.random.default_rng(seed)
    seg, pos = packed(rng, "lognormal", 24.0, B, S, pad=True)
    return seg, pos, random_spans(rng, seg)


# (cp_colossal, cp_ulysses, tp) x exchange x kv heads x window: Ulysses, Colossal, hybrid, tp; GQA.
CASES = [((1, 4, 2), "all_gather", 8, None), ((8, 1, 1), "all_gather", 2, None), ((4, 1, 2), "all_to_all", 2, None),
         ((4, 2, 1), "ring", 2, None), ((2, 2, 2), "ring", 4, (12, 3)), ((2, 4, 1), "all_to_all", 8, (9, 9)),
         ((8, 1, 1), "ring", 1, (20, 4))]


@pytest.mark.parametrize("cut,exchange,K,window", CASES)
def test_spans_on_every_exchange_match_the_rule(cut, exchange, K, window):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    seg, pos, span = _packed_rows(seed=c * 10 + u + t)
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=c + u)
    m = mask_np(pos, seg, span, window=window)
    assert (m & ~mask_np(pos, seg, np.zeros_like(span), window=window)).any(), "the spans must change the mask"
    f = lambda q, k, v: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, is_causal=True, positions=pos, segment_ids=seg, span_ids=span,
        local_window_size=window, kv_exchange=exchange)
    assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32,
                   f"{cut} {exchange} {K=} {window=}")


@pytest.mark.parametrize("order", ["balanced", "dispatch"])
def test_spans_travel_with_the_tokens_on_a_reordered_sequence(order):
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    seg, pos, span = _packed_rows(seed=7)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=3)
    m = mask_np(pos, seg, span)

    def f(q, k, v):
        def attend(tree, positions):  # the tree's own per-document positions, reordered with it
            q, k, v, seg, span, doc_pos = tree
            return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=doc_pos,
                                                segment_ids=seg, span_ids=span, kv_exchange="ring")
        d_or_mesh = load_balance.plan(seg, mesh, positions=pos) if order == "dispatch" else mesh
        return load_balance.balanced(attend, d_or_mesh)((q, k, v, jnp.asarray(seg), jnp.asarray(span),
                                                         jnp.asarray(pos)))

    assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32, order)


def test_the_kernels_that_take_spans_skip_blocks_exactly():
    """Small blocks on the kernels that take spans: a span above the diagonal keeps its block."""
    rng = np.random.default_rng(5)
    seg, pos, span = _packed_rows(seed=11)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=9)
    m = mask_np(pos, seg, span)
    for kernel, blocks in ((kernels.BLOCKWISE, dict(block_q=8, block_kv=8)), (kernels.DENSE, {}),
                           (kernels.PALLAS_GPU, dict(block_q=16, block_kv=16)),  # Pallas interpret mode off GPU
                           (kernels.SPLASH, {})):  # a second call per row: the keys after a query in its span
        f = lambda q, k, v: kernels.local_attention(
            q, k, v, kernel=kernel, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
            is_causal=True, q_span_ids=span, kv_span_ids=span, **blocks)
        assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32, str(kernel))
    assert rng is not None


def _broken_spans():
    """One packed row whose spans are not contiguous: span 2 holds two runs with other tokens (span 0,
    and span 3) between them, and span 4 runs across a document boundary."""
    seg = np.repeat(np.array([[0, 1, 2]], np.int32), [40, 16, 8], axis=1)
    pos = np.concatenate([np.arange(40), np.arange(16), np.arange(8)]).astype(np.int32)[None]
    span = np.zeros((1, S), np.int32)
    span[0, 4:10] = span[0, 16:22] = 2
    span[0, 12:14] = 3
    span[0, 36:46] = 4
    return seg, pos, span


@pytest.mark.parametrize("K,window,sinks", [(2, None, False), (1, (9, 3), True)])
def test_splash_takes_spans_that_are_not_contiguous(K, window, sinks):
    """Splash's second call covers the run from each query to the last key of its span; the span ids
    as its segment ids hide the other tokens inside that run (MQA form with ``K = 1``, windows and
    sinks too; sinks are checked against the blockwise kernel, itself checked against the rule)."""
    seg, pos, span = _broken_spans()
    q, k, v, ct = random_qkv(1, S, H, K, d, seed=K)
    sink = jnp.linspace(-1.0, 1.0, H) if sinks else None
    run = lambda kernel: lambda q, k, v: kernels.local_attention(
        q, k, v, kernel=kernel, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
        is_causal=True, q_span_ids=span, kv_span_ids=span, local_window_size=window, sinks=sink)
    m = mask_np(pos, seg, span, window=window)
    if not sinks:  # the dense reference has no sinks
        assert_matches(run(kernels.BLOCKWISE), lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct,
                       jnp.float32, "blockwise")
    assert_matches(run(kernels.SPLASH), run(kernels.BLOCKWISE), (q, k, v), ct, jnp.float32, f"splash {K=} {window=}")


def test_span_support_per_kernel_and_auto():
    """cuDNN refuses spans; splash takes them (causal: over at most ``MAX_WINDOW_KEYS`` keys a call),
    so ``auto`` runs splash on TPU, pallas_gpu on GPU, and says why when it cannot."""
    from jax_cp.kernels._splash import MAX_WINDOW_KEYS

    with pytest.raises(ValueError, match=r"span ids \(span_ids\) are not among the cuDNN kernel's mask inputs"):
        kernels.select_kernel(kernels.CUDNN, platform="gpu", is_causal=True, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=128, spans=True)
    long = MAX_WINDOW_KEYS + 128
    with pytest.raises(ValueError, match=f"span ids over {long} keys in one kernel call.*at most {MAX_WINDOW_KEYS}"):
        kernels.select_kernel(kernels.SPLASH, platform="tpu", is_causal=True, window=None, has_segments=False,
                              dtype=jnp.bfloat16, head_dim=128, spans=True, kv_len=long)
    for platform, chosen in (("tpu", "splash"), ("gpu", "pallas_gpu"), ("cpu", "blockwise")):
        described = jax_cp.describe_kernel(platform=platform, is_causal=True, spans=True, kv_len=4096)
        assert described.startswith(f"{chosen} (auto on"), described
    assert "span ids" in jax_cp.describe_kernel(platform="gpu", is_causal=True, spans=True)  # why not cuDNN
    described = jax_cp.describe_kernel(platform="tpu", is_causal=True, spans=True, kv_len=long)
    assert described.startswith("blockwise (auto on tpu: span ids over"), described
    assert jax_cp.describe_kernel(platform="tpu", is_causal=False, spans=True, kv_len=long).startswith("splash")


def test_a_ring_of_splash_steps_takes_spans_on_a_tpu_topology():
    """Ahead of time for v5e:2x2 (libtpu): with span ids, ``auto`` runs splash in every ring step, two
    calls a step (the keys at or before each query, then those after it in its span) in the forward
    ring's loop and in the backward's."""
    pytest.importorskip("libtpu", reason="libtpu is needed for TPU ahead-of-time compilation")
    from jax.experimental import topologies

    from test_ring import _loop_bodies

    c = 4
    mesh = jax_cp.make_mesh(cp_colossal=c, devices=topologies.get_topology_desc("v5e:2x2", "tpu").devices)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("cp_colossal", "cp_ulysses")))
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype, sharding=spec)
    loss = lambda q, k, v, span: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, kv_exchange="ring", is_causal=True, span_ids=span).astype(jnp.float32).sum()
    args = shape(1, 512 * c, 8, 128), shape(1, 512 * c, 2, 128), shape(1, 512 * c, 2, 128)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args, shape(1, 512 * c, dtype=jnp.int32)).compile().as_text()
    calls = sorted(sorted(re.findall(r"%(splash_mha_(?:fwd|dq|dkv))[\w.]* = ", body))
                   for body in _loop_bodies(hlo) if "collective-permute-start(" in body)
    assert calls == [["splash_mha_dkv"] * 2 + ["splash_mha_dq"] * 2, ["splash_mha_fwd"] * 2], calls


@pytest.mark.parametrize("cut,K,window", [((4, 2, 1), 2, None), ((2, 2, 2), 4, (12, 3))])
def test_a_ring_of_splash_steps_takes_spans(cut, K, window):
    """Each ring step as splash (interpret mode off TPU), spans crossing chunks and ring steps; with
    ``K = 4`` over ``u t = 4`` each device holds one kv head (splash's MQA form)."""
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    seg, pos, span = _packed_rows(seed=31 + c)
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=c)
    m = mask_np(pos, seg, span, window=window)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos,
                                                     segment_ids=seg, span_ids=span, kv_exchange="ring",
                                                     kernel="splash", local_window_size=window)
    assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32, f"splash ring {cut}")


def test_bad_span_arguments_are_value_errors():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    with pytest.raises(ValueError, match=r"span_ids.shape=\(3,\) must be"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, span_ids=np.ones(3, np.int32))
    with pytest.raises(ValueError, match="span_ids.dtype=float32 must be an integer dtype"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, span_ids=np.ones((B, S), np.float32))
    with pytest.raises(ValueError, match="kv_span_ids is given but span_ids is not"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, kv_span_ids=np.ones((B, S), np.int32))
    k2, v2 = k[:, :32], v[:, :32]
    with pytest.raises(ValueError, match=r"pass kv_span_ids= of shape \(batch, 32\) too"):
        jax_cp.dot_product_attention(q, k2, v2, mesh=mesh, is_causal=True, span_ids=np.ones((B, S), np.int32))


def test_cross_attention_takes_the_keys_spans():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, _, _, ct = random_qkv(B, S, H, 2, d, seed=1)
    _, k, v, _ = random_qkv(B, 32, H, 2, d, seed=2)
    rng = np.random.default_rng(0)
    span, kv_span = rng.integers(0, 3, (B, S)).astype(np.int32), rng.integers(0, 3, (B, 32)).astype(np.int32)
    kv_pos = np.broadcast_to(np.arange(0, 64, 2, dtype=np.int32), (B, 32))
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, span_ids=span,
                                                     kv_span_ids=kv_span, kv_positions=kv_pos)
    r = lambda q, k, v: reference.dot_product_attention(q, k, v, is_causal=True, span_ids=span, kv_span_ids=kv_span,
                                                        kv_positions=kv_pos)
    assert_matches(f, r, (q, k, v), ct, jnp.float32, "cross attention with spans")
    qp, kp = np.arange(S)[None, :, None], kv_pos[:, None, :]
    m = (kp <= qp) | ((span[:, :, None] == kv_span[:, None, :]) & (span[:, :, None] != 0))
    assert_close(r(q, k, v), dense_reference(q, k, v, m), jnp.float32, "the reference follows the rule")


@pytest.mark.parametrize("face", ["nnx", "linen"])
def test_the_modules_take_spans(face):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    x = jax.random.normal(jax.random.key(1), (B, 32, 32))
    seg, pos, span = _packed_rows(seed=2)
    seg, pos, span = seg[:, :32], pos[:, :32], span[:, :32]
    ref = reference.Attention(4, 32, num_kv_heads=2, is_causal=True, rope_theta=1e4, rngs=nnx.Rngs(0))
    want = ref(x, positions=pos, segment_ids=seg, span_ids=span)
    if face == "nnx":
        layer = jax_cp.CPAttention(4, 32, num_kv_heads=2, mesh=mesh, is_causal=True, rope_theta=1e4, rngs=nnx.Rngs(0))
        got = layer(x, positions=pos, segment_ids=seg, span_ids=span)
    else:
        layer = jax_cp.linen.CPAttention(num_heads=4, in_features=32, num_kv_heads=2, mesh=mesh, is_causal=True,
                                         rope_theta=1e4)
        variables = layer.init(jax.random.key(0), x)
        variables = jax.tree.map(lambda a: a, variables)
        params = {n: getattr(ref, n)[...] for n in jax_cp.param_shapes(ref.spec)}
        variables = {"params": {**variables["params"], **params}}
        got = layer.apply(variables, x, positions=pos, segment_ids=seg, span_ids=span)
    assert_close(got, want, jnp.float32, face)
    assert not np.allclose(np.asarray(want), np.asarray(ref(x, positions=pos, segment_ids=seg)), atol=1e-3)


def test_prefill_with_spans_then_decode_equals_the_full_forward():
    """A prompt with a bidirectional prefix and an image span; decode continues causally (span 0)."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    Bp, L, P, D = 2, 32, 24, 32
    x = jax.random.normal(jax.random.key(1), (Bp, L, D))
    span = np.zeros((Bp, L), np.int32)
    span[:, :6] = 1  # prefix-LM prompt
    span[0, 10:18] = 2  # an image inside the prompt
    span[1, 12:24] = 3  # an image that ends with the prompt
    attn = jax_cp.CPAttention(4, D, mesh=mesh, is_causal=True, rope_theta=1e4, rngs=nnx.Rngs(0))
    ref = reference.Attention(4, D, is_causal=True, rope_theta=1e4, rngs=nnx.Rngs(0))
    full = ref(x, span_ids=span)
    attn.init_cache((Bp, L))
    assert_close(attn(x[:, :P], prefill=True, span_ids=span[:, :P]), full[:, :P], jnp.float32, "prefill")
    for t in range(P, L):
        assert_close(attn(x[:, t:t + 1], decode=True)[:, 0], full[:, t], jnp.float32, f"decode {t}")
    with pytest.raises(ValueError, match="pass span_ids to the prefill call"):
        attn(x[:, :1], decode=True, span_ids=span[:, :1])


@pytest.mark.parametrize("window", [None, (30, 7)])
def test_the_dispatch_plan_balances_the_area_spans_add(window):
    """The plan counts the pairs spans add: its per-rank work equals the pairs counted here from the
    reordered rows and the rule, and the slowest rank stays within 1.05 of the mean."""
    from jax.sharding import AbstractMesh

    rng = np.random.default_rng(0)
    seg, pos = packed(rng, "lognormal", 60.0, 2, 512, pad=True)
    span = random_spans(rng, seg)
    d = load_balance.plan(seg, AbstractMesh((1, 4, 1, 1), jax_cp.AXES), positions=pos, span_ids=span,
                          local_window_size=window)
    seg_r, pos_r, span_r = (np.take_along_axis(a, d.perm, axis=1) for a in (seg, pos, span))
    work = mask_np(pos_r, seg_r, span_r, window=window).sum(-1).reshape(2, 4, -1).sum(-1).sum(0)
    np.testing.assert_array_equal(np.asarray(d.work())[0], work)
    assert work.max() / work.mean() <= 1.05, work
    with pytest.raises(ValueError, match=r"span_ids \(shape=\(3,\), dtype=int64\) must be integers of shape"):
        load_balance.plan(seg, AbstractMesh((1, 4, 1, 1), jax_cp.AXES), positions=pos, span_ids=np.ones(3, np.int64))
    with pytest.raises(ValueError, match=r"span_ids \(shape=\(3,\), dtype=int64\) must be integers of shape"):
        load_balance.plan(seg, AbstractMesh((1, 4, 1, 1), jax_cp.AXES), positions=pos, span_ids=np.ones(3, np.int64),
                          is_causal=False)


@pytest.mark.parametrize("transport,window", [("ragged", None), ("ppermute", None), ("ragged", (12, 3))])
def test_the_plan_s_attended_exchange_takes_spans(transport, window, monkeypatch):
    """``Attended`` on a plan made with the spans: a block above the diagonal sharing a span id is
    sent, so its answer (the all-gather branch poisoned) equals the dense reference."""
    from jax_cp.exchanges import attended

    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    rng = np.random.default_rng(4)
    seg, pos = packed(rng, "lognormal", 40.0, B, 256, pad=True)
    span = random_spans(rng, seg)
    plan = load_balance.plan(seg, mesh, positions=pos, span_ids=span, local_window_size=window)
    ex = plan.kv_exchange_for(local_window_size=window, transport=transport)
    unaware = load_balance.plan(seg, mesh, positions=pos, local_window_size=window)
    assert ex.received_tokens() >= unaware.kv_exchange_for(local_window_size=window,
                                                           transport=transport).received_tokens()
    monkeypatch.setattr(attended, "_all_gathered", lambda q, *_: q * jnp.nan)
    q, k, v, ct = random_qkv(B, 256, H, 2, d, seed=6)
    m = mask_np(pos, seg, span, window=window)

    def f(q, k, v):
        (q, k, v, seg_r, span_r), positions = plan.reorder((q, k, v, jnp.asarray(seg), jnp.asarray(span)))
        o = jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=positions, segment_ids=seg_r,
                                         span_ids=span_r, local_window_size=window, kv_exchange=ex)
        return plan.restore(o)

    assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32, str(ex))


def test_a_ring_of_pallas_gpu_steps_takes_spans():
    """Each ring step as the fused Pallas GPU kernel (interpret mode off GPU), spans crossing chunks."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    seg, pos, span = _packed_rows(seed=21)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=4)
    m = mask_np(pos, seg, span)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos,
                                                     segment_ids=seg, span_ids=span, kv_exchange="ring",
                                                     kernel="pallas_gpu", block_q=16, block_kv=16)
    assert_matches(f, lambda q, k, v: dense_reference(q, k, v, m), (q, k, v), ct, jnp.float32, "pallas_gpu ring")


def test_prefill_padding_joins_no_span():
    """A span over the whole prompt: the right padding after ``lengths`` stays unseen by real tokens."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(4, 32, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    lengths, span = np.array([16, 9], np.int32), np.ones((2, 16), np.int32)
    attn.init_cache((2, 32))
    y = attn(x, prefill=True, span_ids=span, lengths=lengths)
    attn.init_cache((2, 32))
    y2 = attn(x.at[1, 9:].set(7.0), prefill=True, span_ids=span, lengths=lengths)
    np.testing.assert_array_equal(np.asarray(y)[1, :9], np.asarray(y2)[1, :9])
    ref = reference.Attention(4, 32, is_causal=True, rngs=nnx.Rngs(0))
    assert_close(np.asarray(y)[1, :9], ref(x[1:, :9], span_ids=span[1:, :9])[0], jnp.float32, "real tokens")


def test_an_exchange_that_supplies_segment_ids_is_resolved_with_them(monkeypatch):
    """``Attended`` hands its kernel segment ids (-1 on unused buffer slots): on GPU the resolved kernel
    must take them (pallas_gpu), not cuDNN, though the call gave none."""
    from jax_cp import _spec

    monkeypatch.setattr(_spec, "chip_of", lambda device: ("gpu", None))
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    spec = jax_cp.AttentionSpec(num_heads=8, head_dim=64, kv_exchange=exchanges.Attended(block=8, sizes=(1,)),
                                overlap_chunks=1, fused_qkv_chunks=0)
    assert spec.resolve(mesh, batch=2, seq_len=64)[0].kernel == kernels.PALLAS_GPU
    plain = spec.replace(kv_exchange="all_gather").resolve(mesh, batch=2, seq_len=64)[0]
    assert plain.kernel == kernels.CUDNN  # the same call without that exchange: cuDNN serves it
