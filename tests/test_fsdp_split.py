"""Weights gathered inside the shard_map that uses them (``jax_cp.unshard``: FSDP gradients as one
reduce-scatter), and ``CPAttention(..., split_over_tp=True)`` (the input and output split over tp along
the features): values and gradients equal the plain layouts', the collectives are the ones promised,
and bad input is a ValueError."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from util import assert_close, has_primitive as _has, sub_jaxprs as _sub_jaxprs

B, S, D, H = 4, 32, 32, 8


def _collectives(hlo: str) -> list[tuple[str, int]]:
    """``(kind, elements)`` of every all-reduce / reduce-scatter / all-gather in a compiled CPU program."""
    out = []
    for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\][^ ]* (all-reduce|reduce-scatter|all-gather)\(", hlo):
        out.append((m.group(2), int(np.prod([int(v) for v in m.group(1).split(",") if v]))))
    return out


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_unshard_gradient_is_one_reduce_scatter(axis_type):
    """A weight stored over every axis its users vary over: the gradient (this device's partial sum) is
    reduce-scattered and never all-reduced; stored over dp only, the sum over cp_colossal is an
    all-reduce first. Both equal the single-device gradient."""
    mesh = jax.make_mesh((2, 2, 1, 2), jax_cp.AXES, axis_types=(axis_type,) * 4)
    x = jax.random.normal(jax.random.key(0), (4, 16, 8))
    w = jax.random.normal(jax.random.key(1), (8, 12))
    ref = jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w)
    for stored, kinds in ((P(("dp", "cp_colossal"), "tp"), {"reduce-scatter", "all-gather"}),
                          (P("dp", "tp"), {"reduce-scatter", "all-gather", "all-reduce"})):
        def loss(w, x):
            body = lambda x, w: x @ jax_cp.unshard(w, stored, P(None, "tp"), jnp.float32)  # noqa: E731
            y = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "cp_colossal", None), stored),
                              out_specs=P("dp", "cp_colossal", "tp"))(
                jax_cp.place(x, mesh, P("dp", "cp_colossal", None)), jax_cp.place(w, mesh, stored))
            return jnp.sum(jnp.sin(y))

        with jax.set_mesh(mesh):
            g = jax.jit(jax.grad(loss))(w, x)
            hlo = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
        assert_close(g, ref, jnp.float32, f"dW stored {stored}")
        found = _collectives(hlo)
        assert {k for k, _ in found} == kinds, (stored, found)
        assert g.sharding.spec == stored


def test_unshard_refuses_a_layout_it_cannot_gather():
    mesh = jax_cp.make_mesh(dp=4, tp=2, axis_types=AxisType.Auto)
    w = jax_cp.place(jnp.ones((8, 4)), mesh, P("tp", None))
    with pytest.raises(ValueError, match=r"stored=(P|PartitionSpec)\('tp', None\) is not "
                                         r"spec=(P|PartitionSpec)\(None, 'tp'\) plus storage axes"):
        jax.shard_map(lambda w: jax_cp.unshard(w, P("tp", None), P(None, "tp")), mesh=mesh, in_specs=P("tp", None),
                      out_specs=P(None, "tp"))(w)


def _attention(mesh, **kw):
    with jax.set_mesh(mesh):
        return nnx.jit(lambda: jax_cp.CPAttention(H, D, num_kv_heads=4, mesh=mesh, is_causal=True, use_bias=True,
                                                   rngs=nnx.Rngs(0), **kw))()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_split_over_tp_equals_the_whole_input(axis_type):
    """The input split over tp along the features (gathered inside the layer) and the output split the same
    way give the whole-input layer's output and gradients (float32), with FSDP storage over dp and cp
    (weights gathered inside); the layer's tp collectives are then all-gathers and reduce-scatters."""
    mesh = jax_cp.make_mesh(dp=1, cp_colossal=2, cp_ulysses=2, tp=2, axis_types=axis_type)
    store = lambda spec: P(*[("cp_colossal", "cp_ulysses") if i == 0 else a for i, a in enumerate(spec)])  # noqa: E731
    compute = jax_cp.param_specs(jax_cp.CPAttention(H, D, num_kv_heads=4, mesh=mesh, is_causal=True, use_bias=True,
                                                    rngs=nnx.Rngs(0)).spec, mesh)
    sharding = jax_cp.AttentionSharding(**{k: store(getattr(compute, k)) for k in ("q_kernel", "k_kernel",
                                                                                     "v_kernel", "o_kernel")})
    plain, split = _attention(mesh), _attention(mesh, sharding=sharding)
    x = jax.random.normal(jax.random.key(3), (B, S, D))
    ct = jax.random.normal(jax.random.key(4), (B, S, D))

    def run(model, split_over_tp):
        spec = P("dp", ("cp_colossal", "cp_ulysses"), "tp" if split_over_tp else None)

        def f(m, x):
            y = m(jax_cp.place(x, mesh, spec), split_over_tp=split_over_tp)
            assert axis_type == AxisType.Auto or jax.typeof(y).sharding.spec == spec
            return jnp.sum(y * ct), y

        with jax.set_mesh(mesh):
            fn = nnx.jit(nnx.value_and_grad(f, argnums=(0, 1), has_aux=True))
            (_, y), (g, gx) = fn(model, x)
            hlo = fn.lower(model, x).compile().as_text() if split_over_tp else ""
        return y, nnx.to_pure_dict(nnx.state(g, nnx.Param)), gx, hlo

    y0, g0, gx0, _ = run(plain, False)
    y1, g1, gx1, hlo = run(split, True)
    assert_close(y1, y0, jnp.float32, "output")
    assert_close(gx1, gx0, jnp.float32, "dx")
    for name in g0:
        assert_close(g1[name], g0[name], jnp.float32, f"d{name}")
    kinds = {k for k, n in _collectives(hlo) if n >= B * S * D // 8}  # activation-sized or larger
    assert "reduce-scatter" in kinds and "all-gather" in kinds, _collectives(hlo)
    weight = D * H * (D // H) // 2  # a q/o kernel's tp block
    assert not [n for k, n in _collectives(hlo) if k == "all-reduce" and n >= weight], _collectives(hlo)


def test_split_over_tp_errors():
    mesh = jax_cp.make_mesh(dp=2, cp_colossal=2, tp=2, axis_types=AxisType.Auto)
    attn = _attention(mesh)
    x = jnp.zeros((B, S, D))
    with pytest.raises(ValueError, match=r"split_over_tp=True is for self-attention; cross attention"):
        attn(x, inputs_kv=x + 1.0, split_over_tp=True)
    with pytest.raises(ValueError, match=r"split_over_tp=True is for training calls; prefill=False, decode=True"):
        attn(x, decode=True, split_over_tp=True)
    odd = jax_cp.make_mesh(dp=1, cp_colossal=2, tp=4, axis_types=AxisType.Auto)
    with jax.set_mesh(odd):
        a6 = nnx.jit(lambda: jax_cp.CPAttention(4, 34, head_dim=8, num_kv_heads=4, mesh=odd, rngs=nnx.Rngs(0)))()
    with pytest.raises(ValueError, match=r"splits the features over tp=4, but in_features=34 is not a multiple"):
        a6(jnp.zeros((B, S, 34)), split_over_tp=True)


def _logits_loss(model, batch):
    """The cross entropy from the model's [B, S, V] float32 logits: what models.llama.next_token_loss fuses."""
    logits = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    picked = jnp.take_along_axis(logits, batch["labels"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum((jax.nn.logsumexp(logits, -1) - picked) * w) / jnp.maximum(jnp.sum(w), 1.0)


@pytest.mark.parametrize("tie,cap,fsdp,chunk_bytes,jit", [(True, None, False, None, True),
                                                         (False, 30.0, True, 4096, True),
                                                         (True, None, True, 2048, True),
                                                         (False, None, True, 4096, False)])
def test_fused_loss_equals_the_logits_loss(tie, cap, fsdp, chunk_bytes, jit, monkeypatch):
    """next_token_loss (the head and the cross entropy fused, chunks of tokens recomputed in the backward)
    gives the loss and gradients of the cross entropy of the whole logits: tied and untied heads, a final
    soft cap, FSDP, one chunk and 8, under jit and eagerly (float32, mesh dp 2 x cp 2 x tp 2)."""
    from models import llama
    from test_train import _batch

    if chunk_bytes is not None:  # the tiny model's [2, 16, 160] float32 logits a device: 8 chunks
        monkeypatch.setattr(llama, "LOSS_CHUNK_BYTES", chunk_bytes)
        assert llama._loss_chunks(2, 16, 160, chunk_bytes) == {4096: 8, 2048: 16}[chunk_bytes]
    mesh = jax_cp.make_mesh(dp=2, cp_colossal=2, tp=2, axis_types=AxisType.Auto)
    cfg = dataclasses.replace(llama.CONFIGS["tiny"], tie_embeddings=tie, final_logits_soft_cap=cap)
    with jax.set_mesh(mesh):
        model = nnx.jit(lambda: llama.Llama(cfg, mesh=mesh, dtype=jnp.float32, rngs=nnx.Rngs(0), fsdp=fsdp,
                                            fsdp_axes=llama.FSDP_AXES))()
        batch = _batch(mesh, B=4)
        wrap = nnx.jit if jit else (lambda f: f)  # eagerly: the custom VJP outside jit too
        (loss, _), grads = wrap(nnx.value_and_grad(llama.next_token_loss, has_aux=True))(model, batch)
        ref, ref_grads = nnx.jit(nnx.value_and_grad(_logits_loss))(model, batch)
    assert_close(loss, ref, jnp.float32, "loss")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        assert_close(g, r, jnp.float32, f"d{jax.tree_util.keystr(path)}")


def test_model_trains_on_explicit_and_auto_meshes_alike():
    """The Llama model (FSDP over dp and cp, the residual split over tp) on an Explicit mesh gives the
    Auto mesh's loss and gradients: every shard_map input is resharded to its in_specs first."""
    from models import llama
    from test_train import _batch

    out = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax_cp.make_mesh(dp=2, cp_colossal=2, tp=2, axis_types=axis_type)
        with jax.set_mesh(mesh):
            model = nnx.jit(lambda: llama.Llama(llama.CONFIGS["tiny"], mesh=mesh, dtype=jnp.float32,
                                                rngs=nnx.Rngs(0), fsdp=True, fsdp_axes=llama.FSDP_AXES))()
            (loss, _), grads = nnx.jit(nnx.value_and_grad(llama.next_token_loss, has_aux=True))(model, _batch(mesh, B=4))
        out[axis_type] = (loss, jax.tree.leaves(grads))
    assert_close(out[AxisType.Explicit][0], out[AxisType.Auto][0], jnp.float32, "loss")
    for g, r in zip(out[AxisType.Explicit][1], out[AxisType.Auto][1]):
        assert_close(g, r, jnp.float32, "gradient")


def test_linen_split_over_tp_equals_the_whole_input():
    """jax_cp.linen.CPAttention takes split_over_tp too: the same output, split over tp (float32)."""
    import flax.linen as nn

    mesh = jax_cp.make_mesh(dp=1, cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    model = jax_cp.linen.CPAttention(H, D, num_kv_heads=4, mesh=mesh, is_causal=True)
    x = jax.random.normal(jax.random.key(5), (B, S, D))
    params = nn.unbox(model.init(jax.random.key(0), x))["params"]
    whole = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, x)
    split_in = jax_cp.place(x, mesh, P("dp", ("cp_colossal", "cp_ulysses"), "tp"))
    split = jax.jit(lambda p, x: model.apply({"params": p}, x, split_over_tp=True))(params, split_in)
    assert split.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses"), "tp")), 3)
    assert_close(split, whole, jnp.float32, "linen output")


@pytest.mark.parametrize("x64", [False, True])
def test_split_fsdp_layer_equals_the_reference_eagerly(x64):
    """CPAttention stored FSDP over dp and cp and called with split_over_tp, run eagerly (jax.vjp outside
    jit) against the single-device reference with the same parameters: output and every gradient, in
    float32 and (x64) in float64 at 1e-12, so no float32 step sits on the float64 path."""
    from jax_cp import reference

    with jax.enable_x64(x64):
        dt = jnp.float64 if x64 else jnp.float32
        mesh = jax_cp.make_mesh(dp=2, cp_colossal=2, tp=2, axis_types=AxisType.Auto)
        kw = dict(num_kv_heads=4, is_causal=True, use_bias=True, use_qk_norm=True, rope_theta=1e4)
        compute = jax_cp.param_specs(jax_cp.CPAttention(H, D, mesh=mesh, rngs=nnx.Rngs(0), **kw).spec, mesh)
        fsdp = jax_cp.AttentionSharding(**{k: P(*[("dp", "cp_colossal") if i == 0 else a
                                                  for i, a in enumerate(getattr(compute, k))])
                                          for k in ("q_kernel", "k_kernel", "v_kernel", "o_kernel")})
        model = jax_cp.CPAttention(H, D, mesh=mesh, sharding=fsdp, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0), **kw)
        ref = reference.Attention(H, D, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(0), **kw)
        gd, state = nnx.split(model)
        rgd, rstate = nnx.split(ref)
        nnx.replace_by_pure_dict(rstate, jax.tree.map(np.asarray, nnx.to_pure_dict(state)))
        x = jax.random.normal(jax.random.key(3), (B, S, D), dt)
        ct = jax.random.normal(jax.random.key(4), (B, S, D), dt)
        split = P("dp", ("cp_colossal", "cp_ulysses"), "tp")
        out, vjp = jax.vjp(lambda s, x: nnx.merge(gd, s)(jax_cp.place(x, mesh, split), split_over_tp=True),
                           state, x)
        g, gx = vjp(ct)
        r_out, r_vjp = jax.vjp(lambda s, x: nnx.merge(rgd, s)(x), rstate, x)
        rg, rgx = r_vjp(ct)
        assert out.dtype == dt
        pairs = [("output", out, r_out), ("dx", gx, rgx)] + [
            (f"d{k}", v, nnx.to_pure_dict(rg)[k]) for k, v in nnx.to_pure_dict(g).items()]
        for what, a, b in pairs:
            if x64:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12, err_msg=what)
            else:
                assert_close(a, b, jnp.float32, what)


def test_unshard_gradient_eagerly():
    """jax.grad of a shard_map using unshard, outside jit, equals the single-device gradient."""
    mesh = jax.make_mesh((2, 2, 1, 2), jax_cp.AXES, axis_types=(AxisType.Auto,) * 4)
    x = jax.random.normal(jax.random.key(0), (4, 16, 8))
    w = jax.random.normal(jax.random.key(1), (8, 12))
    stored = P(("dp", "cp_colossal"), "tp")

    def loss(w):
        body = lambda x, w: x @ jax_cp.unshard(w, stored, P(None, "tp"))  # noqa: E731
        y = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "cp_colossal", None), stored),
                          out_specs=P("dp", "cp_colossal", "tp"))(
            jax_cp.place(x, mesh, P("dp", "cp_colossal", None)), jax_cp.place(w, mesh, stored))
        return jnp.sum(jnp.sin(y))

    assert_close(jax.grad(loss)(w), jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w), jnp.float32, "dW eagerly")


@pytest.mark.parametrize("u", [1, 2])
def test_fsdp_layer_gathers_kv_weights_first_without_ulysses(u):
    """Without Ulysses the layer's FSDP weight gathers run in two stages: the K and V kernels', then the
    others' once those have arrived, so XLA cannot combine all four into one collective that the first
    projection waits for whole (on a TPU7x pod: one 80 MiB gather a layer, docs/guides/maxtext.md). With
    Ulysses (Q's all-to-all leaves first) they stay independent. Read from the traced program's dataflow."""
    mesh = jax_cp.make_mesh(dp=2, cp_colossal=2 // u, cp_ulysses=u, tp=2, axis_types=AxisType.Auto)
    kw = dict(num_kv_heads=4, is_causal=True)
    compute = jax_cp.param_specs(jax_cp.CPAttention(H, D, mesh=mesh, rngs=nnx.Rngs(0), **kw).spec, mesh)
    names = ("q_kernel", "k_kernel", "v_kernel", "o_kernel")
    d_dim = {"q_kernel": 0, "k_kernel": 0, "v_kernel": 0, "o_kernel": 2}  # D, where FSDP stores them split
    fsdp = jax_cp.AttentionSharding(**{k: P(*[("dp", "cp_colossal", "cp_ulysses") if i == d_dim[k] else a
                                              for i, a in enumerate(getattr(compute, k))]) for k in names})
    model = jax_cp.CPAttention(H, D, mesh=mesh, sharding=fsdp, rngs=nnx.Rngs(0), **kw)
    shapes = {k: tuple(np.shape(v)) for k, v in nnx.to_pure_dict(nnx.state(model)).items()}
    tp = 2  # each device's compute block: the whole kernel but its tp-split dimension (heads, or O's rows)
    local = {k: tuple(n // tp if i == (0 if k == "o_kernel" else 1) else n for i, n in enumerate(shapes[k]))
             for k in names}
    x = jax.random.normal(jax.random.key(0), (B, S, D))
    jaxpr = jax.make_jaxpr(lambda x: model(x))(x).jaxpr
    body = next(j for e in jaxpr.eqns if _has(e, "shard_map") for j in _sub_jaxprs(e)
                if any(_has(q, "all_gather") for q in j.eqns))
    while not any(e.primitive.name == "custom_vjp_call" or "custom_vjp" in e.primitive.name for e in body.eqns):
        body = next(j for e in body.eqns for j in _sub_jaxprs(e) if any(_has(q, "all_gather") for q in j.eqns))
    deps, gathers = {}, {}  # var -> the weight gathers it derives from; weight name -> its gather's deps
    for e in body.eqns:
        src = set().union(*(deps.get(v, set()) for v in e.invars if not hasattr(v, "val")))
        out_shape = tuple(e.outvars[0].aval.shape) if e.outvars else ()
        weight = next((k for k in names if _has(e, "all_gather") and out_shape == local[k] and k not in gathers
                       and "custom_vjp" in e.primitive.name), None)
        if weight is not None:
            gathers.setdefault(weight, set()).update(src)
            src = src | {weight}
        for v in e.outvars:
            deps[v] = src
    assert set(gathers) == set(names), gathers
    first = {"k_kernel", "v_kernel"} if u == 1 else set()
    assert all(gathers[k] == set() for k in first), gathers
    assert all(gathers[k] == first for k in names if k not in first), gathers
