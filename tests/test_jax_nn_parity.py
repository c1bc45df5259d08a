"""``jax_cp.dot_product_attention`` (and ``CPAttention``) where they are the counterparts of
``jax.nn.dot_product_attention`` (and flax's ``MultiHeadAttention``): the same
call (rank-4 or unbatched rank-3, GQA, causal, scale, sliding window, ``implementation=``) gives
jax.nn's output and gradients on a CP mesh; what CP cannot take (dense ``bias``/``mask``) is refused
with the data-driven alternative. ``return_residual`` gives jax.nn's log-sum-exp (in jax.nn's dtype),
differentiable. float64 inputs (``jax_enable_x64``) are computed in float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from util import assert_close, assert_matches, fwd_and_vjp, random_qkv

B, S, H, d = 2, 32, 8, 8
# float64 computed in float64: a few roundings of 1.1e-16 per sum over S keys (float32 math is ~1e-7 off).
F64_TOL = dict(atol=1e-12, rtol=1e-12)


def _assert_close_f64(actual, expected, what=""):
    """``util.assert_close`` at ``F64_TOL``, in float64 (``atol`` relative to the expected tensor's scale)."""
    expected = np.asarray(expected, np.float64)
    atol = F64_TOL["atol"] * max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=F64_TOL["rtol"], atol=atol, err_msg=what)


@pytest.mark.parametrize("case", ["gqa-causal-scale", "unbatched", "window", "implementation-xla"])
def test_matches_jax_nn(case):
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=11)
    kw = dict(is_causal=True)
    if case == "gqa-causal-scale":
        kw["scale"] = 0.25
    if case == "unbatched":  # [T, N, H]: one sequence, no batch axis
        q, k, v, ct = q[0], k[0], v[0], ct[0]
    if case == "window":
        kw["local_window_size"] = (5, 0)
    ours = dict(implementation="xla") if case == "implementation-xla" else {}
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, **kw, **ours)
    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, case)
    if case == "unbatched":
        assert f(q, k, v).shape == q.shape


@pytest.mark.parametrize("layout, kv_exchange, shape", [
    ((2, 2, 2), "all_gather", "BSHD"),   # hybrid x tp: the residual comes back by the inverse all-to-all
    ((4, 2, 1), "ring", "BNSD"),         # the ring's merged log-sum-exp, BNSD layout
    ((1, 8, 1), "all_to_all", "unbatched"),
])
def test_residual_is_jax_nn_s_with_its_gradient(layout, kv_exchange, shape):
    """``return_residual=True``: jax.nn's output and log-sum-exp of each row's logits ``[B, T, N]``;
    the gradient through the residual (d lse / d scores = p) against ``jax_cp.reference``'s plain
    ``logsumexp`` (jax.nn drops the residual's cotangent: no reference for that part there)."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=12)
    ct_res = jax.random.normal(jax.random.key(13), (B, S, H))
    if shape == "unbatched":
        q, k, v, ct, ct_res = q[0], k[0], v[0], ct[0], ct_res[0]
    nn_out, nn_res = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla", return_residual=True)
    lay = dict(layout="BNSD") if shape == "BNSD" else {}
    if shape == "BNSD":  # same data, heads before the sequence
        q, k, v, ct, nn_out = (jnp.swapaxes(a, 1, 2) for a in (q, k, v, ct, nn_out))
        ct_res, nn_res = jnp.swapaxes(ct_res, 1, 2), jnp.swapaxes(nn_res, 1, 2)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, kv_exchange=kv_exchange,
                                                     return_residual=True, **lay)
    ref = lambda q, k, v: jax_cp.reference.dot_product_attention(
        *(a if a.ndim == 4 else a[None] for a in (q, k, v)), is_causal=True, return_residual=True, **lay)
    (out, res), grads = fwd_and_vjp(f, (q, k, v), (ct, ct_res))
    what = f"{layout} {kv_exchange} {shape}"
    assert res.shape == nn_res.shape == ct_res.shape, what
    assert_close(out, nn_out, jnp.float32, f"output {what}")
    assert_close(res, nn_res, jnp.float32, f"residual {what}")
    batched = (lambda a: a[None]) if shape == "unbatched" else (lambda a: a)
    _, r_grads = fwd_and_vjp(ref, (q, k, v), (batched(ct), batched(ct_res)))
    for name, g, rg in zip("qkv", grads, r_grads):
        assert_close(g, rg.reshape(g.shape), jnp.float32, f"d{name} {what}")
    _, (dq_without, *_) = fwd_and_vjp(f, (q, k, v), (ct, jnp.zeros_like(ct_res)))
    assert float(jnp.abs(grads[0] - dq_without).max()) > 1e-3  # the residual's cotangent reaches dq


@pytest.mark.parametrize("layout, kv_exchange, kernel", [
    ((2, 2, 2), "all_gather", "auto"),     # hybrid x tp, blockwise
    ((4, 2, 1), "ring", "auto"),           # the ring carries the keys' padding with the chunk
    ((2, 2, 1), "ring", "splash"),         # the splash ring (interpret mode) sorts padded keys last
])
def test_query_and_key_lengths_pad_like_jax_nn(layout, kv_exchange, kernel):
    """``query_seq_lengths`` and ``key_value_seq_lengths`` stated separately (a query may see fewer
    keys than it is long, and the reverse): jax.nn's output and gradients on every unpadded query;
    padded queries get zeros (where jax.nn averages every value)."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, 2, d, seed=14)
    lengths = dict(query_seq_lengths=jnp.array([20, 32]), key_value_seq_lengths=jnp.array([27, 12]))
    real = (jnp.arange(S)[None] < lengths["query_seq_lengths"][:, None])[:, :, None, None]
    ct = jnp.where(real, ct, 0.0)  # what padded queries return is not compared
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=True, kv_exchange=kv_exchange,
                                                     kernel=kernel, **lengths)
    ref = lambda q, k, v: jnp.where(real, jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                                                       **lengths), 0.0)
    assert_matches(f, ref, (q, k, v), ct, jnp.float32, f"{layout} {kv_exchange} {kernel}")


def test_what_cp_cannot_take_is_refused_with_the_alternative():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    with pytest.raises(ValueError, match=r"bias= is not supported: a dense \[B, N, T, S\] bias is quadratic .* "
                                         r"positions=, segment_ids=, is_causal=, local_window_size="):
        jax_cp.dot_product_attention(q, k, v, jnp.zeros((B, H, S, S)), mesh=mesh)
    with pytest.raises(ValueError, match=r"mask= is not supported: .* segment_ids= \(documents; a negative id pads"):
        jax_cp.dot_product_attention(q, k, v, mask=jnp.ones((B, H, S, S), bool), mesh=mesh)
    with pytest.raises(ValueError, match=r"implementation='cudnn' and kernel='blockwise' both choose the kernel"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, implementation="cudnn", kernel="blockwise")
    with pytest.raises(ValueError, match=r"implementation='flash' must be one of \(None, 'xla', 'cudnn'\)"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, implementation="flash")
    with pytest.raises(ValueError, match=r"kernel='cudnn' needs a CUDA GPU"):  # cudnn maps to cudnn
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, implementation="cudnn")
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: return_residual's log-sum-exp"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="splash", return_residual=True)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths \(shape=\(3,\), dtype=int32\) must be an integer "
                                         r"array of shape \(batch,\)=\(2,\)"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, key_value_seq_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"query.shape=\(32, 8, 8\) must have rank 4 \(BSHD\), or rank 3 \(SHD: one"):
        jax_cp.dot_product_attention(q[0], k, v, mesh=mesh)


def test_module_with_out_features_matches_flax_multi_head_attention():
    """``CPAttention(out_features=...)`` (``!= in_features``) against flax's own
    ``nnx.MultiHeadAttention`` holding the same weights (no bias, full attention): output and
    gradients, on a 2x2x2 mesh."""
    from flax import nnx

    D, E = 32, 24
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(H, D, out_features=E, mesh=mesh, rngs=nnx.Rngs(0))
    assert attn.o_kernel[...].shape == (H, D // H, E)
    flax_mha = nnx.MultiHeadAttention(H, D, out_features=E, use_bias=False, decode=False, rngs=nnx.Rngs(1))
    for ours, theirs in (("q_kernel", "query"), ("k_kernel", "key"), ("v_kernel", "value"), ("o_kernel", "out")):
        getattr(flax_mha, theirs).kernel[...] = jax.device_get(getattr(attn, ours)[...])
    x = jax.random.normal(jax.random.key(2), (B, S, D))
    ct = jax.random.normal(jax.random.key(3), (B, S, E))
    out, (gx,) = fwd_and_vjp(lambda x: attn(x), (x,), ct)
    want, (want_gx,) = fwd_and_vjp(lambda x: flax_mha(x), (x,), ct)
    assert out.shape == (B, S, E)
    assert_close(out, want, jnp.float32, "output")
    assert_close(gx, want_gx, jnp.float32, "dx")


def _fwd_and_vjps(f, args, cts):
    """``(f(*args), [grads of <f(*args), ct> for ct in cts])``: one compile, one forward."""

    @jax.jit
    def run(args, cts):
        out, vjp = jax.vjp(f, *args)
        return out, [vjp(ct) for ct in cts]

    return run(args, cts)


@pytest.mark.parametrize("layout, kv_exchange", [((2, 2, 2), "all_gather"), ((4, 2, 1), "ring")])
def test_bfloat16_residual_has_jax_nn_s_dtype_and_takes_its_cotangent(layout, kv_exchange):
    """bfloat16 inputs: the residual is bfloat16 as jax.nn's (its values at bfloat16 tolerance), and a
    bfloat16 cotangent for it is taken (it was float32, and such a cotangent a ``ValueError``).
    Gradients: jax.nn's where the residual's cotangent is zero (jax.nn stops its gradient),
    ``jax_cp.reference``'s (a differentiable ``logsumexp``) with it."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    bf16 = jnp.bfloat16
    q, k, v, ct = random_qkv(B, S, H, 2, d, dtype=bf16, seed=15)
    ct_res = jax.random.normal(jax.random.key(16), (B, S, H)).astype(bf16)
    kw = dict(is_causal=True, return_residual=True)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=kv_exchange, **kw)
    nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    ref = lambda q, k, v: jax_cp.reference.dot_product_attention(q, k, v, **kw)
    (out, res), (grads, grads_out_only) = _fwd_and_vjps(f, (q, k, v), [(ct, ct_res), (ct, jnp.zeros_like(ct_res))])
    (nn_out, nn_res), (nn_grads,) = _fwd_and_vjps(nn, (q, k, v), [(ct, ct_res)])
    _, (r_grads,) = _fwd_and_vjps(ref, (q, k, v), [(ct, ct_res)])
    what = f"{layout} {kv_exchange}"
    assert (out.dtype, res.dtype) == (nn_out.dtype, nn_res.dtype) == (bf16, bf16), what
    assert_close(out, nn_out, bf16, f"output {what}")
    assert_close(res, nn_res, bf16, f"residual {what}")
    for name, g, nn_g in zip("qkv", grads_out_only, nn_grads):
        assert g.dtype == bf16, what
        assert_close(g, nn_g, bf16, f"d{name} (no residual cotangent) against jax.nn {what}")
    for name, g, rg in zip("qkv", grads, r_grads):
        assert_close(g, rg, bf16, f"d{name} against the reference {what}")
    assert float(jnp.abs(grads[0].astype(jnp.float32) - grads_out_only[0].astype(jnp.float32)).max()) > 1e-2


@pytest.mark.parametrize("layout, kv_exchange", [((2, 2, 2), "all_gather"), ((4, 2, 1), "ring")])
def test_float64_is_computed_in_float64(layout, kv_exchange):
    """Under ``jax_enable_x64`` float64 inputs give float64 results computed in float64: forward,
    residual and gradients equal the float64 reference to 1e-12 (they were float32 math, ~1e-7 off).
    jax.nn itself rounds its softmax to float32 (``_dot_product_attention_core``: "always carried
    out in fp32"), so it is met at float32 tolerance. The kernels that compute in float32 are refused."""
    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    what = f"{layout} {kv_exchange}"
    with jax.enable_x64(True):
        q, k, v, ct = random_qkv(B, S, H, 2, d, dtype=jnp.float64, seed=17)
        ct_res = jax.random.normal(jax.random.key(18), (B, S, H), jnp.float64)
        kw = dict(is_causal=True, scale=0.3, return_residual=True)
        f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=kv_exchange, **kw)
        ref = lambda q, k, v: jax_cp.reference.dot_product_attention(q, k, v, **kw)
        nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
        cts = [(ct, ct_res), (ct, jnp.zeros_like(ct_res))]
        (out, res), (grads, grads_out_only) = _fwd_and_vjps(f, (q, k, v), cts)
        (r_out, r_res), (r_grads, _) = _fwd_and_vjps(ref, (q, k, v), cts)
        (nn_out, _), (nn_grads,) = _fwd_and_vjps(nn, (q, k, v), cts[1:])
        assert {a.dtype for a in (out, res, *grads)} == {jnp.dtype(jnp.float64)}, what
        for name, a, e in [("output", out, r_out), ("residual", res, r_res), *zip(("dq", "dk", "dv"), grads, r_grads)]:
            _assert_close_f64(a, e, f"{name} {what}")
        assert_close(out, nn_out, jnp.float32, f"output against jax.nn {what}")
        for name, g, nn_g in zip(("dq", "dk", "dv"), grads_out_only, nn_grads):
            assert_close(g, nn_g, jnp.float32, f"{name} against jax.nn {what}")
        for arg in ("kernel", "implementation"):  # the dense kernel's accumulators follow the inputs too
            dense = jax_cp.dot_product_attention(q, k, v, mesh=mesh, **{arg: "xla"}, **kw)  # all-gather (not ring)
            assert dense[0].dtype == jnp.float64, what
            _assert_close_f64(dense[0], r_out, f"xla output {what}")
        refused = r"='splash' computes in float32, so float64 inputs \(jax_enable_x64\) would lose precision"
        with pytest.raises(ValueError, match=rf"kernel{refused} silently; use kernel='blockwise', 'xla' or 'auto'"):
            jax_cp.dot_product_attention(q, k, v, mesh=mesh, kernel="splash")


@pytest.mark.parametrize("layout, kv_exchange", [((2, 2, 2), "all_gather"), ((4, 2, 1), "ring")])
def test_module_computes_float64_in_float64(layout, kv_exchange):
    """``CPAttention`` with float64 parameters and inputs (x64): projections, QK-norm, RoPE, attention
    and their gradients in float64, equal to the float64 single-device layer at 1e-12 (float32 math
    would be ~1e-7 off)."""
    from flax import nnx

    c, u, t = layout
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    with jax.enable_x64(True):
        kw = dict(num_kv_heads=2, head_dim=8, is_causal=True, use_qk_norm=True, rope_theta=1e4,
                  param_dtype=jnp.float64)
        cp = jax_cp.CPAttention(H, 16, mesh=mesh, kv_exchange=kv_exchange, rngs=nnx.Rngs(3), **kw)
        ref = jax_cp.reference.Attention(H, 16, rngs=nnx.Rngs(3), **kw)  # the same parameter values
        x = jax.random.normal(jax.random.key(4), (B, S, 16), jnp.float64)
        ct = jax.random.normal(jax.random.key(5), (B, S, 16), jnp.float64)

        def run(model):
            def loss(params, x):
                return jnp.sum(nnx.merge(graphdef, params)(x) * ct)

            graphdef, params = nnx.split(model)
            return model(x), jax.grad(loss, argnums=(0, 1))(params, x)

        (y, (dp, dx)), (r_y, (r_dp, r_dx)) = run(cp), run(ref)
        assert y.dtype == dx.dtype == jnp.float64
        _assert_close_f64(y, r_y, f"output {layout}")
        _assert_close_f64(dx, r_dx, f"dx {layout}")
        for (path, g), (_, r_g) in zip(nnx.to_flat_state(dp), nnx.to_flat_state(r_dp)):
            _assert_close_f64(g[...], r_g[...], f"d{'/'.join(map(str, path))} {layout}")
