"""The chunked gated delta rule, Mamba-2 SSD and causal convolution on one device equal the recurrence
token by token (forward and every gradient, float32), with documents that start inside chunks, an
initial state and the final state; the recurrence itself equals the layers' definitions written
in NumPy (float64); tokens in any order give the same result; bad input is a ValueError.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp import linear
from linear_data import conv_args, cotangent, gdn_args, packed, ssd_args
from util import assert_close, fwd_and_vjp

F32 = jnp.float32
POS, SEG = packed(rows=((5, 20, 19), (17, 27)), pad=(0, 0))  # documents start at 5, 25 and 17: inside chunks
B, S = POS.shape


def _compare(fast, ref, args, what):
    out = ref(*args)
    ct = cotangent(out)
    got, grads = fwd_and_vjp(fast, args, ct)
    want, r_grads = fwd_and_vjp(ref, args, ct)
    for name, a, b in zip(("output", "state"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, F32, f"{name} {what}")
    for i, (a, b) in enumerate(zip(grads, r_grads)):
        assert float(jnp.abs(b).max()) > 0, f"input {i} does not reach the output ({what})"
        assert_close(a, b, F32, f"grad {i} {what}")


@pytest.mark.parametrize("per_channel,chunk_size", [(False, 8), (False, 64), (True, 16)],
                         ids=["scalar-gate-C8", "scalar-gate-C64", "channel-gate-C16"])
def test_gated_delta_chunked_equals_the_recurrence(per_channel, chunk_size):
    args = gdn_args(B, S, 2, 8, 6, per_channel=per_channel)
    kw = dict(positions=POS, segment_ids=SEG, return_state=True)

    def fast(q, k, v, g, beta, x0):
        return linear.gated_delta_rule(q, k, v, g, beta, initial_state=x0, chunk_size=chunk_size, **kw)

    def ref(q, k, v, g, beta, x0):
        return linear.reference.gated_delta_rule(q, k, v, g, beta, initial_state=x0, **kw)

    _compare(fast, ref, args, f"C={chunk_size}")


def test_mamba2_chunked_equals_the_recurrence():
    x, dt, A, b, c, D, x0 = ssd_args(B, S, 4, 6, 8, 2)
    kw = dict(positions=POS, segment_ids=SEG, return_state=True)

    def fast(x, dt, A, b, c, D, x0):
        return linear.mamba2_ssd(x, dt, A, b, c, D_H=D, initial_state=x0, chunk_size=16, **kw)

    def ref(x, dt, A, b, c, D, x0):
        return linear.reference.mamba2_ssd(x, dt, A, b, c, D_H=D, initial_state=x0, **kw)

    _compare(fast, ref, (x, dt, A, b, c, D, x0), "ssd")


@pytest.mark.parametrize("layer", ["gdn", "ssd"])
def test_eager_gradients_without_an_initial_state_equal_the_recurrence(layer):
    """``jax.grad`` outside any jit, no ``initial_state`` (the documents starting inside chunks start from
    zero, whose product the layers skip), several chunks a row (the one-device state scan's own VJP):
    the loss and every gradient equal the recurrence's."""
    kw = dict(positions=POS, segment_ids=SEG)
    if layer == "gdn":
        args = gdn_args(B, S, 2, 8, 6)[:5]
        fast = lambda *a: linear.gated_delta_rule(*a, chunk_size=8, **kw)  # noqa: E731
        ref = lambda *a: linear.reference.gated_delta_rule(*a, **kw)  # noqa: E731
    else:
        x, dt, A, b, c, D, _ = ssd_args(B, S, 4, 6, 8, 2)
        args = (x, dt, A, b, c)
        fast = lambda *a: linear.mamba2_ssd(*a, D_H=D, chunk_size=8, **kw)  # noqa: E731
        ref = lambda *a: linear.reference.mamba2_ssd(*a, D_H=D, **kw)  # noqa: E731
    ct = cotangent(ref(*args))
    argnums = tuple(range(len(args)))
    got = jax.value_and_grad(lambda *a: jnp.sum(fast(*a) * ct), argnums)(*args)
    want = jax.value_and_grad(lambda *a: jnp.sum(ref(*a) * ct), argnums)(*args)
    assert_close(got[0], want[0], F32, f"loss {layer}")
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        assert float(jnp.abs(b).max()) > 0, f"input {i} does not reach the output ({layer})"
        assert_close(a, b, F32, f"grad {i} {layer}")


@pytest.mark.parametrize("width", [1, 4])
def test_conv_equals_the_recurrence(width):
    x, w, bias, x0 = conv_args(B, S, 6, width)
    kw = dict(positions=POS, segment_ids=SEG, return_state=True)
    def fast(x, w, bias, x0=None):
        return linear.causal_conv1d(x, w, bias_C=bias, initial_state=x0, **kw)

    def ref(x, w, bias, x0=None):
        return linear.reference.causal_conv1d(x, w, bias_C=bias, initial_state=x0, **kw)

    _compare(fast, ref, (x, w, bias, x0) if width > 1 else (x, w, bias), f"W={width}")


def _numpy_gdn(q, k, v, g, beta, scale):
    """One document, float64: ``S = S diag(exp g)``; ``S += beta (v - S k) k^T``; ``o = S q scale``."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    state, out = np.zeros((q.shape[1], v.shape[-1], q.shape[-1])), []
    for t in range(q.shape[0]):
        a = np.exp(g[t])
        state = state * (a[:, None, :] if a.ndim == 2 else a[:, None, None])
        state = state + np.einsum("hv,hk->hvk", (v[t] - np.einsum("hvk,hk->hv", state, k[t])) * beta[t][:, None], k[t])
        out.append(np.einsum("hvk,hk->hv", state, q[t]) * scale)
    return np.stack(out)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar-gate", "channel-gate"])
def test_the_recurrence_is_the_gated_delta_rule(per_channel):
    q, k, v, g, beta, _ = gdn_args(1, 12, 2, 4, 3, per_channel=per_channel)
    want = _numpy_gdn(q[0], k[0], v[0], g[0], beta[0], 0.5)
    assert_close(linear.reference.gated_delta_rule(q, k, v, g, beta, scale=0.5)[0], want, F32, "reference")
    assert_close(linear.gated_delta_rule(q, k, v, g, beta, scale=0.5, chunk_size=4)[0], want, F32, "chunked")


def test_the_recurrence_is_mamba2_and_conv1d():
    x, dt, A, b, c, D, _ = ssd_args(1, 10, 4, 3, 5, 2)
    xs, dts, bs, cs = (np.asarray(a[0], np.float64) for a in (x, dt, b, c))
    bh, ch = np.repeat(bs, 2, axis=1), np.repeat(cs, 2, axis=1)
    h, want = np.zeros((4, 3, 5)), []
    for t in range(10):
        h = h * np.exp(dts[t] * np.asarray(A))[:, None, None] + np.einsum("hp,hn->hpn", xs[t] * dts[t][:, None], bh[t])
        want.append(np.einsum("hpn,hn->hp", h, ch[t]) + xs[t] * np.asarray(D)[:, None])
    assert_close(linear.reference.mamba2_ssd(x, dt, A, b, c, D_H=D)[0], np.stack(want), F32, "ssd")
    xc, w, bias, _ = conv_args(1, 9, 3, 4)
    pad = np.concatenate([np.zeros((3, 3)), np.asarray(xc[0], np.float64)])
    y = sum(np.asarray(w[i], np.float64) * pad[i:i + 9] for i in range(4)) + np.asarray(bias)
    assert_close(linear.reference.causal_conv1d(xc, w, bias_C=bias)[0], y / (1 + np.exp(-y)), F32, "conv")


def test_tokens_in_any_order_give_the_same_result():
    """A random permutation of every row (positions and segment ids travel with the tokens): runs whose
    predecessor sits anywhere in the row are linked by (segment, position) on one device too."""
    q, k, v, g, beta, x0 = gdn_args(B, S, 2, 8, 4)
    perm = np.stack([np.random.RandomState(b).permutation(S) for b in range(B)])
    take = lambda a: jnp.take_along_axis(a, perm.reshape(perm.shape + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
    o, last = linear.gated_delta_rule(*map(take, (q, k, v, g, beta)), positions=take(POS), segment_ids=take(SEG),
                                      initial_state=x0, return_state=True, chunk_size=8, max_pieces=S)
    r, r_last = linear.reference.gated_delta_rule(q, k, v, g, beta, positions=POS, segment_ids=SEG,
                                                  initial_state=x0, return_state=True)
    assert_close(o, take(r), F32, "output")
    assert_close(last, r_last, F32, "final state")
    xc, w, bias, c0 = conv_args(B, S, 4, 4)
    y = linear.causal_conv1d(take(xc), w, positions=take(POS), segment_ids=take(SEG), initial_state=c0, max_pieces=S)
    assert_close(y, take(linear.reference.causal_conv1d(xc, w, positions=POS, segment_ids=SEG, initial_state=c0)),
                 F32, "conv")


def test_too_few_slots_give_an_error_or_nan_not_a_wrong_answer():
    """Known metadata: a ValueError naming the slots needed (the host's count is the device's rule: that
    many suffice). Traced metadata (under jit): the row's outputs are NaN, never a wrong number."""
    q, k, v, g, beta, _ = gdn_args(B, S, 2, 4, 4)
    rev = lambda a: a[:, ::-1]  # noqa: E731  every token's predecessor is the token after it
    args = [rev(a) for a in (q, k, v, g, beta)]
    need = linear._cp.needed_pieces(np.asarray(rev(POS)), np.asarray(rev(SEG)), 1)
    with pytest.raises(ValueError, match=rf"max_pieces=2 is too few .* pass max_pieces={need} or more"):
        linear.gated_delta_rule(*args, positions=rev(POS), segment_ids=rev(SEG), chunk_size=8, max_pieces=2)
    traced = jax.jit(lambda p, s: linear.gated_delta_rule(*args, positions=p, segment_ids=s, chunk_size=8,
                                                          max_pieces=2))
    assert bool(jnp.isnan(traced(rev(POS), rev(SEG))).all())
    exact = linear.gated_delta_rule(*args, positions=rev(POS), segment_ids=rev(SEG), chunk_size=8, max_pieces=need)
    ref = linear.reference.gated_delta_rule(*args, positions=rev(POS), segment_ids=rev(SEG))
    assert_close(exact, ref, F32, "with the slots counted")


def test_padding_is_a_document_of_its_own_and_the_state_is_the_last_real_documents():
    pos, seg = packed(rows=((10, 12), (30,)), pad=(10, 2))
    q, k, v, g, beta, _ = gdn_args(2, 32, 2, 4, 4)
    o, last = linear.gated_delta_rule(q, k, v, g, beta, positions=pos, segment_ids=seg, return_state=True, chunk_size=8)
    r, r_last = linear.reference.gated_delta_rule(q, k, v, g, beta, positions=pos, segment_ids=seg, return_state=True)
    assert_close(o, r, F32, "output")
    assert_close(last, r_last, F32, "state")
    alone = linear.reference.gated_delta_rule(q[:1, 10:22], k[:1, 10:22], v[:1, 10:22], g[:1, 10:22],
                                              beta[:1, 10:22], return_state=True)[1]
    assert_close(last[:1], alone, F32, "row 0's state is its second document's alone")


def test_steps_continue_the_chunked_pass():
    """Prefill 24 tokens chunked, then decode 8 one at a time: the outputs of one pass over all 32."""
    q, k, v, g, beta, _ = gdn_args(1, 32, 2, 4, 4, per_channel=True)
    full = linear.gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    _, state = linear.gated_delta_rule(q[:, :24], k[:, :24], v[:, :24], g[:, :24], beta[:, :24], chunk_size=8,
                                       return_state=True)
    for t in range(24, 32):
        o, state = linear.gated_delta_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        assert_close(o, full[:, t], F32, f"gdn token {t}")
    x, dt, A, b, c, D, _ = ssd_args(1, 32, 4, 3, 4, 2)
    full = linear.mamba2_ssd(x, dt, A, b, c, D_H=D, chunk_size=8)
    _, h = linear.mamba2_ssd(x[:, :24], dt[:, :24], A, b[:, :24], c[:, :24], D_H=D, return_state=True, chunk_size=8)
    xc, w, bias, _ = conv_args(1, 32, 3, 4)
    yc = linear.causal_conv1d(xc, w, bias_C=bias)
    _, cs = linear.causal_conv1d(xc[:, :24], w, bias_C=bias, return_state=True)
    for t in range(24, 32):
        y, h = linear.mamba2_step(h, x[:, t], dt[:, t], A, b[:, t], c[:, t], D_H=D)
        assert_close(y, full[:, t], F32, f"ssd token {t}")
        y, cs = linear.conv_step(cs, xc[:, t], w, bias_C=bias)
        assert_close(y, yc[:, t], F32, f"conv token {t}")


def _bad_calls():
    q, k, v, g, beta, x0 = gdn_args(1, 16, 2, 4, 4)
    x, dt, A, b, c, D, _ = ssd_args(1, 16, 4, 3, 4, 2)
    xc, w, _, _ = conv_args(1, 16, 4, 4)
    gdn = linear.gated_delta_rule
    return [
        (lambda: gdn(q, k, v, g[..., :1], beta), r"g.shape=\(1, 16, 1\) must be \[B, S, H\] = \(1, 16, 2\)"),
        (lambda: gdn(q, k, v, g, beta[..., None]), r"beta.shape=\(1, 16, 2, 1\) must be \(1, 16, 2\)"),
        (lambda: gdn(q, k[..., :3], v, g, beta), r"k.shape=\(1, 16, 2, 3\) must be \(1, 16, 2, 4\)"),
        (lambda: gdn(q, k, v[:, :8], g, beta), r"v.shape=\(1, 8, 2, 4\) must be \[B, S, H, dv\]"),
        (lambda: gdn(q, k, v, g, beta, chunk_size=0), r"chunk_size=0 must be a positive integer"),
        (lambda: gdn(q, k, v, g, beta, max_pieces=0), r"max_pieces=0 must be a positive integer"),
        (lambda: gdn(q, k, v, g, beta, initial_state=x0[:, :1]), r"initial_state.shape=\(1, 1, 4, 4\) must be"),
        (lambda: gdn(q, k, v, g, beta, span_ids=jnp.ones((1, 16), jnp.int32)), r"span_ids= cannot be honoured"),
        (lambda: gdn(q, k, v, g, beta, positions=jnp.zeros((16,), F32)), r"positions.dtype=float32 must be an integer"),
        (lambda: gdn(q, k, v, g, beta, segment_ids=jnp.zeros((3, 16), jnp.int32)),
         r"segment_ids.shape=\(3, 16\) must be"),
        (lambda: gdn(q.astype(jnp.int32), k, v, g, beta), r"q.dtype=int32 must be a real floating dtype"),
        (lambda: linear.mamba2_ssd(x, dt, A, b[:, :, :1].repeat(3, 2), c, D_H=D), r"B.shape=\(1, 16, 3, 4\) must be"),
        (lambda: linear.mamba2_ssd(x, dt, A[:2], b, c), r"A.shape=\(2,\) must be \(4,\)"),
        (lambda: linear.mamba2_ssd(x, dt, A, b, c, span_ids=jnp.ones((16,), jnp.int32)), r"span_ids= cannot"),
        (lambda: linear.causal_conv1d(xc, w[:, :2]), r"w.shape=\(4, 2\) must be \[W, C\]"),
        (lambda: linear.causal_conv1d(xc, w, activation="gelu"), r"activation='gelu' must be one of"),
        (lambda: linear.causal_conv1d(xc, w, span_ids=jnp.ones((16,), jnp.int32)), r"span_ids= cannot"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_input_is_a_value_error(i):
    call, match = _bad_calls()[i]
    with pytest.raises(ValueError, match=match):
        call()


def test_float64_inputs_are_refused_not_rounded():
    """The state is float32: float64 inputs under x64 are a ValueError, not a silent float32 result."""
    with jax.enable_x64(True):
        q, k, v, g, beta, _ = gdn_args(1, 16, 2, 4, 4)
        with pytest.raises(ValueError, match=r"q.dtype=float64: the linear layers carry their state in float32"):
            linear.gated_delta_rule(q.astype(jnp.float64), k, v, g, beta, chunk_size=8)
        x, dt, A, b, c, D, _ = ssd_args(1, 16, 2, 4, 4, 1)
        with pytest.raises(ValueError, match=r"x.*dtype=float64: the linear layers carry their state in float32"):
            linear.mamba2_ssd(x.astype(jnp.float64), dt, A, b, c, chunk_size=8)


@pytest.mark.parametrize("C", [16, 12])
def test_the_chunk_inverse_and_its_gradient_equal_a_dense_inverse(C):
    """The chunk's unit lower triangular inverse (blocked, with its own VJP ``-m^-T g m^-T``) equals a
    dense inverse, and so does its gradient on the strictly lower entries (the only ones it reads)."""
    from jax_cp.linear._chunk import unit_lower_inverse
    k1, k2 = jax.random.split(jax.random.key(3))
    low = 0.3 * jnp.tril(jax.random.normal(k1, (3, 2, C, C), F32), -1)
    ct = jax.random.normal(k2, low.shape, F32)
    eye = jnp.eye(C, dtype=F32)[None, None]
    mine, vjp = jax.vjp(lambda l: unit_lower_inverse(eye + l), low)
    dense, dense_vjp = jax.vjp(lambda l: jnp.linalg.inv(eye + jnp.tril(l, -1)), low)
    assert_close(mine, dense, F32, "inverse")
    (g,), (want,) = vjp(ct), dense_vjp(ct)
    assert float(jnp.abs(want).max()) > 0
    assert_close(g, want, F32, "gradient")
    assert float(jnp.abs(jnp.triu(g)).max()) == 0.0, "the diagonal and upper entries are not read"


@pytest.mark.parametrize("s_shape", [(4, 6), (4, 6, 1), (4, 6, 5), (5,)], ids=["vector", "column", "elementwise", "channel"])
def test_scaled_products_equal_the_broadcast_product_and_its_gradients(s_shape):
    """``scaled`` (a contraction on CPU) and ``channel_scaled`` (its own VJP) are ``x * s`` broadcast over the
    last axis, or over the leading ones for a weight per channel, values and gradients."""
    from jax_cp.linear._products import channel_scaled, scaled
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    x, s = jax.random.normal(k1, (4, 6, 5), F32), jax.random.normal(k2, s_shape, F32)
    ct = jax.random.normal(k3, x.shape, F32)
    fn = channel_scaled if s.ndim == 1 else scaled
    plain = lambda x, s: x * (s[None, None] if s.ndim == 1 else s[..., None] if s.ndim < x.ndim else s)  # noqa: E731
    got, vjp = jax.vjp(fn, x, s)
    want, want_vjp = jax.vjp(plain, x, s)
    assert_close(got, want, F32, "product")
    for a, b in zip(vjp(ct), want_vjp(ct)):
        assert a.shape == b.shape
        assert_close(a, b, F32, "gradient")
