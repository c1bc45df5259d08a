"""The mask as a port from another codebase meets it: window bounds, span ids under masks they cannot
change, NumPy window sizes, a traced scale, padding by jax.nn's lengths, and ``jax_cp.visibility``,
the dense mask attention applies, each against jax.nn or the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import reference
from util import assert_close, assert_matches, random_qkv

B, S, H, K, d = 2, 64, 4, 1, 16


def _mesh(layout=(2, 2, 2)):
    c, u, t = layout
    if c * u * t == 1:
        return jax_cp.make_mesh(dp=1, devices=jax.devices()[:1])
    return jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)


def _span():
    span = np.zeros((B, S), np.int32)
    span[:, 10:20] = 1
    span[1, 40:52] = 2
    return span


def _gemma_positions(lengths):
    """Gemma's positions for right-padded rows: the pads repeat the row's last real position."""
    real = jnp.arange(S)[None] < jnp.asarray(lengths)[:, None]
    count = jnp.cumsum(real, -1)
    return count - (count >= 1)


def test_the_window_is_inclusive_and_gemma_s_w_is_w_minus_one():
    """``(left, right)`` bounds are inclusive (jax.nn's rule); a window ``W`` meaning
    ``|p_q - p_k| < W`` (Gemma, Hugging Face, Mistral) is ``(W - 1, W - 1)``, ``(W - 1, 0)`` causal:
    jax_cp's output and gradients equal jax.nn's with that dense mask."""
    mesh, W = _mesh(), 8
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=1)
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None]
    for window, is_causal, dense in (((W - 1, W - 1), False, jnp.abs(i - j) < W),
                                     ((W - 1, 0), True, (0 <= i - j) & (i - j < W))):
        assert bool((jax_cp.visibility(B, S, is_causal=is_causal, local_window_size=window) == dense[None]).all())
        f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=is_causal,
                                                         local_window_size=window)
        ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense[None, None], implementation="xla")
        assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"window {window} causal={is_causal}")


def test_span_ids_under_a_mask_they_cannot_change_are_refused():
    """A span only opens later keys of the span: under a causal window with right edge 0, or without
    is_causal, span ids change nothing (the masks are equal), so passing them is a ValueError that
    says why, on the function, the module and a prefill; with a window reaching right they count."""
    mesh, span = _mesh(), _span()
    q, k, v, _ = random_qkv(B, S, H, K, d, seed=2)
    for kw in (dict(is_causal=True, local_window_size=(7, 0)), dict(is_causal=False),
               dict(is_causal=False, local_window_size=(7, 7))):
        assert bool((jax_cp.visibility(B, S, span_ids=span, **kw) == jax_cp.visibility(B, S, **kw)).all()), kw
    assert not bool((jax_cp.visibility(B, S, span_ids=span, is_causal=True, local_window_size=(7, 7))
                     == jax_cp.visibility(B, S, is_causal=True, local_window_size=(7, 7))).all())
    right_edge = r"span_ids cannot change this mask: local_window_size=\(7, 0\) \(right edge 0\) hides every later key"
    with pytest.raises(ValueError, match=right_edge + r".*use local_window_size=\(7, 7\) with is_causal=True"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, local_window_size=(7, 0), span_ids=span)
    with pytest.raises(ValueError, match=r"span_ids cannot change this mask: without is_causal=True every key .* "
                                         r"Drop span_ids, or use is_causal=True"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, span_ids=span)
    attn = jax_cp.CPAttention(4, 32, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (B, S, 32))
    with pytest.raises(ValueError, match=right_edge):
        attn(x, local_window_size=(7, 0), span_ids=span)
    lin = jax_cp.linen.CPAttention(num_heads=4, in_features=32, mesh=mesh, is_causal=True)
    with pytest.raises(ValueError, match=right_edge):
        lin.init(jax.random.key(0), x, local_window_size=(7, 0), span_ids=span)
    attn.init_cache((B, S))
    with pytest.raises(ValueError, match=right_edge):
        attn(x, prefill=True, local_window_size=(7, 0), span_ids=span)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, local_window_size=(7, 7),
                                                     span_ids=span)
    assert_close(f(q, k, v), reference.dot_product_attention(q, k, v, is_causal=True, local_window_size=(7, 7),
                                                             span_ids=span), jnp.float32, "spans in (7, 7)")


def test_numpy_integer_windows_are_taken_and_bools_and_floats_refused():
    """``np.int64`` sizes (what jax.nn takes) give the output of Python ints, on the function, the
    reference, the spec and the module; a bool or a float is refused with the rule."""
    mesh = _mesh()
    q, k, v, _ = random_qkv(B, S, H, K, d, seed=4)
    want = reference.dot_product_attention(q, k, v, is_causal=True, local_window_size=(7, 7))
    for window in ((np.int64(7), np.int64(7)), np.int32(7), [np.int16(7), 7]):
        got = jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, local_window_size=window)
        assert_close(got, want, jnp.float32, f"{window!r}")
        assert_close(reference.dot_product_attention(q, k, v, is_causal=True, local_window_size=window), want,
                     jnp.float32, f"reference {window!r}")
        spec = jax_cp.AttentionSpec(num_heads=4, head_dim=8, local_window_size=window)
        assert spec.local_window_size == (7, 7) and all(type(w) is int for w in spec.local_window_size)
    x = jax.random.normal(jax.random.key(5), (B, S, 32))
    attn = jax_cp.CPAttention(4, 32, mesh=mesh, is_causal=True, rngs=nnx.Rngs(0))
    ref = reference.Attention(4, 32, is_causal=True, rngs=nnx.Rngs(0))
    assert_close(attn(x, local_window_size=(np.int64(5), np.int64(0))), ref(x, local_window_size=(5, 0)),
                 jnp.float32, "module")
    for bad in ((True, 7), (7.0, 7), np.float32(7)):
        with pytest.raises(ValueError, match=r"local_window_size=.* must (hold ints|be None, an int)"):
            jax_cp.dot_product_attention(q, k, v, mesh=mesh, local_window_size=bad)


@pytest.mark.parametrize("kernel", ["auto", "xla"])
def test_a_traced_scale_matches_jax_nn(kernel):
    """A scale traced by ``jit`` and ``grad`` (multiplied into the query): output and the gradients of
    q, k, v and the scale itself equal jax.nn's with the same traced scale (and the reference's with
    a soft cap, which the scale feeds)."""
    mesh, scale = _mesh(), jnp.float32(0.3)
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=6)
    f = lambda q, k, v, s: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, scale=s, kernel=kernel)
    ref = lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=s, implementation="xla")
    assert_matches(f, ref, (q, k, v, scale), ct, jnp.float32, kernel)
    f = lambda q, k, v, s: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, scale=s, kernel=kernel,
                                                        logits_soft_cap=4.0)
    ref = lambda q, k, v, s: reference.dot_product_attention(q, k, v, is_causal=True, scale=s, logits_soft_cap=4.0)
    assert_matches(f, ref, (q, k, v, scale), ct, jnp.float32, f"soft cap, {kernel}")


def test_a_scale_the_spec_cannot_fix_is_refused():
    """A layer's scale is fixed when built: traced, a bool or an array is a ValueError with the fix;
    NumPy and concrete JAX scalars become floats."""
    assert jax_cp.AttentionSpec(num_heads=4, head_dim=8, scale=np.float32(0.5)).scale == 0.5
    assert jax_cp.AttentionSpec(num_heads=4, head_dim=8, scale=jnp.float32(0.5)).scale == 0.5
    with pytest.raises(ValueError, match=r"scale=.* is traced, but this path needs its value .* pass a Python number"):
        jax.jit(lambda s: jax_cp.AttentionSpec(num_heads=4, head_dim=8, scale=s).num_heads)(jnp.float32(0.5))
    for bad in (True, jnp.ones(2), 1j):
        with pytest.raises(ValueError, match=r"scale=.* must be a real number \(e.g. 0.125\), or None"):
            jax_cp.AttentionSpec(num_heads=4, head_dim=8, scale=bad)


def test_the_dense_mask_error_names_every_mask_argument():
    mesh = _mesh()
    q, k, v, _ = random_qkv(B, S, H, K, d)
    with pytest.raises(ValueError, match=r"mask= is not supported: .* positions=, span_ids= \(bidirectional blocks.*"
                                         r"key_value_seq_lengths= or kv_segment_ids= \(keys that are padding, "
                                         r"self-attention included\)\. jax_cp\.visibility"):
        jax_cp.dot_product_attention(q, k, v, mask=jnp.ones((B, H, S, S), bool), mesh=mesh)
    with pytest.raises(ValueError, match=r"bias= is not supported: .* local_window_size=, span_ids="):
        jax_cp.dot_product_attention(q, k, v, jnp.zeros((B, H, S, S)), mesh=mesh)


def test_key_only_padding_in_self_attention_matches_jax_nn():
    """Padding only the keys of self-attention, by ``key_value_seq_lengths`` or by
    ``kv_segment_ids`` (queries all in segment 0): jax.nn's output and gradients."""
    mesh, lengths = _mesh(), jnp.array([64, 41])
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=7)
    pad = jnp.where(jnp.arange(S)[None] < lengths[:, None], 0, -1)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    for kw in (dict(key_value_seq_lengths=lengths), dict(segment_ids=jnp.zeros((B, S), jnp.int32), kv_segment_ids=pad)):
        f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw)
        assert_matches(f, ref, (q, k, v), ct, jnp.float32, str(sorted(kw)))


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 1, 1)])
def test_lengths_count_indices_as_jax_nn_with_gemma_positions(layout):
    """Gemma's positions repeat the last real position over the pads: the lengths still count keys
    (and queries) by index, so the last real query of a padded row sees no pad, as in jax.nn."""
    mesh, lengths = _mesh(layout), jnp.array([64, 50])
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=8)
    pos = _gemma_positions(lengths)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos,
                                                     key_value_seq_lengths=lengths)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                                       implementation="xla")
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{layout} key lengths")
    real = (jnp.arange(S)[None] < lengths[:, None])[:, :, None, None]
    both = dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, positions=pos, **both)
    ref = lambda q, k, v: jnp.where(real, jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                                                       **both), 0.0)
    assert_matches(f, ref, (q, k, v), jnp.where(real, ct, 0.0), jnp.float32, f"{layout} both lengths")


def test_visibility_is_the_mask_attention_applies():
    """``jax_cp.visibility`` on packed documents with padding, spans, a window, jax.nn's lengths and
    cross attention: jax.nn given it as a dense mask equals jax_cp given the metadata, on every
    query that sees a key (the rest: zeros from jax_cp)."""
    mesh = _mesh()
    q, k, v, ct = random_qkv(B, S, H, K, d, seed=9)
    seg = jnp.asarray(np.repeat([0, 1, 2, -1], [20, 24, 14, 6]))[None].repeat(B, 0)
    pos = jnp.asarray(np.r_[np.arange(20), np.arange(24), np.arange(14), np.zeros(6, int)])[None].repeat(B, 0)
    self_kw = dict(is_causal=True, positions=pos, segment_ids=seg, span_ids=_span(), local_window_size=(9, 3),
                   key_value_seq_lengths=jnp.array([64, 37]))
    cross_kw = dict(is_causal=True, positions=pos, kv_positions=jnp.arange(32) + 10,
                    segment_ids=jnp.zeros((B, S), jnp.int32), kv_segment_ids=jnp.zeros((B, 32), jnp.int32),
                    query_seq_lengths=jnp.array([64, 30]), local_window_size=(12, 0))
    for kw, (k_, v_) in ((self_kw, (k, v)), (cross_kw, (k[:, :32], v[:, :32]))):
        mask = jax_cp.visibility(B, S, k_.shape[1], **kw)
        assert mask.shape == (B, S, k_.shape[1]) and mask.dtype == jnp.bool_
        sees = mask.any(-1)[:, :, None, None]
        assert bool(sees.any()) and not bool(sees.all())
        f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw)
        ref = lambda q, k, v: jnp.where(sees, jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                                                           implementation="xla"), 0.0)
        assert_matches(f, ref, (q, k_, v_), jnp.where(sees, ct, 0.0), jnp.float32, str(sorted(kw)))
    with pytest.raises(ValueError, match=r"q_len=0 must be a positive integer"):
        jax_cp.visibility(B, 0)
    with pytest.raises(ValueError, match=r"positions.shape=\(3,\) must be \(seq_len,\)=\(64,\)"):
        jax_cp.visibility(B, S, positions=jnp.arange(3))
