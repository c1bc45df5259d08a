"""Ring K/V exchange equals the reference (forward and gradients); its permutes overlap compute on TPU."""
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # xdist workers may each load libtpu for AOT compiles

import math
from functools import partial
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import reference
from jax_cp.kernels._blockwise import Meta, block_visible, make_spec
from util import assert_close, assert_matches, has_primitive, random_qkv, sub_jaxprs

lb_positions = jax_cp.load_balance.positions

B, S, H, d = 2, 64, 8, 8
F32, BF16 = jnp.float32, jnp.bfloat16

CASES = [  # (c, u, t), K, mask, dtype, load-balanced positions
    ((8, 1, 1), 8, dict(is_causal=True), F32, False),
    ((2, 4, 1), 2, dict(is_causal=True), BF16, True),
    ((4, 2, 1), 1, dict(local_window_size=(5, 3), segments=True), F32, False),
    ((2, 2, 2), 4, dict(is_causal=True, local_window_size=(7, 0), segments=True), BF16, True),
    ((2, 2, 1), 2, dict(is_causal=True, segments=True), F32, True),  # dp = 2
    ((1, 4, 2), 2, dict(is_causal=True), F32, False),  # c = 1: the ring is the local kernel
]


@pytest.mark.parametrize("cut,K,mask,dtype,balanced", CASES)
def test_ring_matches_reference(cut, K, mask, dtype, balanced):
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=c + 2 * u + 3 * t)
    mask = dict(mask)
    pos = jax_cp.load_balance.positions(S, mesh) if balanced else None
    seg = None
    if mask.pop("segments", False):
        natural = jnp.stack([jnp.arange(S) // 24, jnp.arange(S) // 40]).astype(jnp.int32)
        seg = jax_cp.load_balance.reorder(natural, mesh)[0] if balanced else natural
    kw = dict(positions=pos, segment_ids=seg, **mask)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring", **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{cut=} {K=} {mask=} {balanced=}")


SPLASH_CASES = [  # interpret mode: the TPU kernel emulated; (c, u, t), K, mask, dtype, load-balanced
    ((2, 4, 1), 2, dict(is_causal=True), F32, True),  # causal, load-balanced, GQA
    ((4, 2, 1), 1, dict(is_causal=True, segments=True), F32, False),  # packed documents, MQA
    ((2, 2, 2), 4, dict(segments=True), F32, True),  # hybrid x tp, full attention within documents
    ((2, 2, 1), 2, dict(is_causal=True, segments=True), BF16, True),  # dp = 2, bfloat16
    # windows (both bounds per query, packed): causal sliding window over load-balanced documents with
    # two kv heads per device (splash's MHA form, grouped); a two-sided window
    ((4, 2, 1), 4, dict(is_causal=True, local_window_size=(9, 0), segments=True), F32, True),
    ((2, 2, 2), 2, dict(local_window_size=(5, 3)), F32, False),
]


@pytest.mark.parametrize("cut,K,mask,dtype,balanced", SPLASH_CASES)
def test_ring_with_splash_matches_reference(cut, K, mask, dtype, balanced):
    """Every ring step runs the splash kernel (forward with its log-sum-exp, backward with the
    merged output and log-sum-exp) and the result equals the reference, forward and gradients."""
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=c + 2 * u + 3 * t)
    mask = dict(mask)
    natural = jnp.stack([jnp.arange(S) // 24, jnp.arange(S) // 40]).astype(jnp.int32)
    seg = natural if mask.pop("segments", False) else None
    pos = None
    if balanced:  # the sequence in load-balanced order, with its positions
        seg, pos = jax_cp.load_balance.reorder(seg, mesh) if seg is not None else (None, lb_positions(S, mesh))
    kw = dict(positions=pos, segment_ids=seg, **mask)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring", kernel="splash", **kw)
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **kw)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: f(q, k, v).astype(F32).sum()))(q))
    assert "pallas_call" in jaxpr and "ppermute" in jaxpr
    one_kv_head = math.lcm(K, u * t) == u * t  # per device after the Ulysses split: splash's MQA form
    assert ("splash_mqa_fwd" in jaxpr) == one_kv_head and ("splash_mha_fwd" in jaxpr) != one_kv_head
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{cut=} {K=} {mask=} {balanced=}")


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu", "blockwise"])
def test_ring_under_remat_matches_reference(kernel):
    """``jax.checkpoint`` around the ring (what ``models.train --remat`` does per block): its partial
    evaluation traces the ring's loop again. The Pallas kernels (splash, pallas_gpu; interpret mode
    here) are traced without manual-axis type checks; that switch is part of the program (one
    ``jax_cp_unchecked`` primitive where every mesh axis is manual, as here), so the second trace
    does not re-check the kernel's code (a tracing-time config switch alone did, and remat of the
    splash ring failed with 'dynamic_slice requires varying manual axes to match')."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, ct = random_qkv(B, S, H, 2, d, F32, seed=7)
    seg = jnp.stack([jnp.arange(S) // 24, jnp.arange(S) // 40]).astype(jnp.int32)
    kw = dict(is_causal=True, segment_ids=seg)
    f = jax.checkpoint(lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring",
                                                                    kernel=kernel, **kw))
    assert_matches(f, lambda q, k, v: reference.dot_product_attention(q, k, v, **kw), (q, k, v), ct, F32, kernel)


@pytest.mark.parametrize("kernel", ["auto", "splash"])
def test_module_passes_ring_through(kernel):
    """``CPAttention(kv_exchange="ring")``, with Q, K and V of the first of two chunks in one
    Ulysses all-to-all (``fused_qkv_chunks=1``), equals the all-gather module with the same weights
    (``"splash"``: the ring's steps on the masks of the default positions, built when traced)."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    x = jax.random.normal(jax.random.key(0), (2, 32, 16), F32)

    def run(kv_exchange, fused, kernel="auto"):
        model = jax_cp.CPAttention(4, 16, num_kv_heads=2, head_dim=8, mesh=mesh, is_causal=True, overlap_chunks=2,
                                   kv_exchange=kv_exchange, fused_qkv_chunks=fused, kernel=kernel, rngs=nnx.Rngs(0))
        loss = lambda m, x: (m(x) ** 2).sum()
        return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(model, x)

    (l_ring, (gm_ring, gx_ring)), (l_ag, (gm_ag, gx_ag)) = run("ring", 1, kernel), run("all_gather", 0)
    assert_close(l_ring, l_ag, F32)
    assert_close(gx_ring, gx_ag, F32)
    for a, b in zip(jax.tree.leaves(gm_ring), jax.tree.leaves(gm_ag)):
        assert_close(a, b, F32)


def test_ring_errors():
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d)
    with pytest.raises(ValueError, match=r"kernel='xla' cannot run kv_exchange='ring'.*use kernel='auto', "
                                         r"'blockwise', 'splash' or 'pallas_gpu'"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring", kernel="xla")
    with pytest.raises(ValueError, match=r"kernel='xla' cannot run kv_exchange='ring'"):  # at construction
        jax_cp.CPAttention(8, 16, mesh=mesh, kv_exchange="ring", kernel="xla", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"kernel='splash' cannot serve this call: the max-logit statistic"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="ring", kernel="splash",
                                     is_causal=True, return_max_logits=True)
    with pytest.raises(ValueError, match=r"kv_exchange='tree' must be one of \('all_gather', 'all_to_all', 'ring'\)"):
        jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange="tree")


def _step_work(pos_S, c, is_causal=True, block=8):
    """Visible block pairs ``[rank, step]``: rank r's queries against the chunk of rank (r - step) mod c."""
    chunks = pos_S.reshape(c, -1)
    meta = lambda p: Meta(p[None], None, jnp.ones((1, p.shape[0]), bool))
    spec = make_spec(8, is_causal=is_causal)
    return np.array([[int(block_visible(meta(chunks[r]), meta(chunks[(r - s) % c]), spec, block, block).sum())
                      for s in range(c)] for r in range(c)])


def test_ring_steps_skip_masked_chunks_and_balance():
    c, n = 4, 128
    natural = _step_work(jnp.arange(n, dtype=jnp.int32), c)
    assert (natural[0, 1:] == 0).all()  # rank 0 sees only itself: three steps without block work
    assert natural.sum(1).tolist() == [10, 26, 42, 58]  # 4*5/2 on the diagonal + 16 per earlier chunk
    mesh = jax_cp.make_mesh(cp_colossal=c, dp=2)
    balanced = _step_work(jax_cp.load_balance.positions(n, mesh), c)
    assert len(set(balanced.sum(1).tolist())) == 1  # the dual-chunk order evens out the work
    assert balanced.sum() == natural.sum()


def _permutes_enclosing_compute(hlo: str) -> dict[str, bool]:
    """Each async collective-permute of the scheduled HLO (any computation, loop bodies
    included): is compute (a loop, fusion, convolution or kernel call) scheduled between start and done?"""
    result = {}
    for comp in re.split(r"\n(?=\S[^\n]*\{\n)", hlo):
        ops = [m.groups() for m in re.finditer(r"\n\s*(?:ROOT )?%?([\w.-]+) = .*? ([\w-]+)\((.*)", comp)]
        start_at = {name: i for i, (name, kind, _) in enumerate(ops) if kind == "collective-permute-start"}
        for i, (name, kind, args) in enumerate(ops):
            if kind == "collective-permute-done":
                start = re.match(r"\s*%?([\w.-]+)", args).group(1)
                between = {k for _, k, _ in ops[start_at[start] + 1:i]}
                result[start] = bool(between & {"while", "fusion", "convolution", "custom-call"})
    return result


@pytest.mark.parametrize("kernel,topology,c", [("blockwise", "v5e:2x2", 4), ("auto", "v5e:2x4", 8)])
def test_ring_permutes_overlap_compute_on_tpu(kernel, topology, c):
    """Scheduled TPU HLO (libtpu ahead of time): K/V permutes run while a step's attention
    computes; with ``kernel="auto"`` that attention is the splash kernel, inside the ring's loops
    (``c = 8``, so that the backward ring stays a loop rather than being peeled)."""
    pytest.importorskip("libtpu", reason="libtpu is needed for TPU ahead-of-time compilation")
    from jax.experimental import topologies

    from jax_cp.plan._analyze import kernel_calls as plan_kernel_calls
    from jax_cp.plan._hlo import analyze_schedule

    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    mesh = jax_cp.make_mesh(cp_colossal=c, devices=topo.devices)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("cp_colossal", "cp_ulysses")))
    q = jax.ShapeDtypeStruct((1, 1024 * c, 8, 128), BF16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, 1024 * c, 2, 128), BF16, sharding=spec)
    loss = lambda q, k, v: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, kv_exchange="ring", is_causal=True, kernel=kernel).astype(F32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    pairs = _permutes_enclosing_compute(hlo)
    # Forward loop: K, V and the chunk's mask metadata; backward loop: those and the two dK/dV
    # accumulators; plus the peeled first/last steps. The backward attends the chunk at home
    # last, so no return of dK/dV follows the last compute: every pair encloses compute (the
    # return hop of the previous design was the one that did not).
    assert len(pairs) >= 3 + 5, pairs
    assert all(pairs.values()), pairs
    kernels = _splash_calls_in_ring_loops(hlo)
    calls = dict(plan_kernel_calls(hlo))  # what the planner's report names as the kernel that ran
    schedule = analyze_schedule(hlo, mesh_shape=tuple(mesh.shape.values()), axis_names=tuple(mesh.axis_names))
    runs = {(x.phase, x.iterations) for x in schedule.collectives if x.in_loop and x.kind == "collective-permute"}
    # The ring loops' trip counts, read from the HLO: c - 2 remote steps in each loop (the backward's
    # first remote step runs in its loop, with an empty accumulator).
    assert runs == {("fwd", c - 2), ("bwd", c - 2)}, runs
    if kernel == "auto":  # the forward kernel in the forward ring, dq and dkv in the backward ring
        assert sorted(kernels) == [["splash_mha_dkv", "splash_mha_dq"], ["splash_mha_fwd"]], kernels
        assert set(calls) == {"splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"}, calls
    else:
        assert kernels == [] and "tpu_custom_call" not in hlo and calls == {}, kernels


def _loop_bodies(hlo: str) -> list[str]:
    """The text of each while-loop body of the scheduled HLO."""
    comps, name = {}, None
    for line in hlo.split("\n"):
        head = re.match(r"(?:ENTRY )?%?([\w.-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif line == "}":
            name = None
        elif name:
            comps[name].append(line)
    return ["\n".join(comps[name]) for name in sorted(set(re.findall(r"body=%?([\w.-]+)", hlo)) & comps.keys())]


def _splash_calls_in_ring_loops(hlo: str) -> list[list[str]]:
    """For each while-loop body of the scheduled HLO that starts collective-permutes: the splash
    kernels it calls (sorted; bodies without one are left out)."""
    found = []
    for text in _loop_bodies(hlo):
        calls = sorted(set(re.findall(r"%(splash_m[hq]a_(?:fwd|dq|dkv))_[\w.]+ = ", text)))
        if "collective-permute-start(" in text and calls:
            found.append(calls)
    return found


NATURAL_CASES = [  # kv_exchange, (c, u, t), K, mask, dtype: default positions, splash in interpret mode
    ("ring", (2, 4, 1), 2, dict(is_causal=True), F32),  # 32 tokens per chunk: padded to 128 lanes
    ("ring", (4, 2, 1), 1, dict(), BF16),  # full attention, MQA
    ("all_gather", (1, 4, 2), 4, dict(is_causal=True, local_window_size=(9, 0)), F32),  # Ulysses, a window
]


@pytest.mark.parametrize("exchange,cut,K,mask,dtype", NATURAL_CASES)
def test_default_positions_build_splash_masks_when_traced(exchange, cut, K, mask, dtype):
    """No positions or segment ids given: the splash masks are constants built when traced (the ring's
    steps pick the same / earlier / later chunk's, and no positions travel), so nothing is sorted at run time (the sorts were
    the only work under some exchanges, which then counted as exposed; benchmarks/RESULTS.md), and
    the result equals the reference. The same call with the positions stated sorts them."""
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t)
    q, k, v, ct = random_qkv(B, S, H, K, d, dtype, seed=5 + c)

    def f(q, k, v, positions=None):
        return jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=exchange, kernel="splash",
                                            positions=positions, **mask)

    grad_jaxpr = lambda fn: str(jax.make_jaxpr(jax.grad(lambda q: fn(q, k, v).astype(F32).sum()))(q))
    jaxpr = grad_jaxpr(f)
    assert "pallas_call" in jaxpr and " sort[" not in jaxpr
    assert ("ppermute" in jaxpr) == (exchange == "ring") and not re.search(r"i32\[[\d,]*\][^=\n]* = ppermute", jaxpr)
    stated = grad_jaxpr(partial(f, positions=jnp.arange(S, dtype=jnp.int32)))
    assert " sort[" in stated
    assert (exchange == "ring") == bool(re.search(r"i32\[[\d,]*\][^=\n]* = ppermute", stated))  # positions travel
    ref = lambda q, k, v: reference.dot_product_attention(q, k, v, **mask)
    assert_matches(f, ref, (q, k, v), ct, dtype, f"{exchange=} {cut=} {mask=}")


@pytest.mark.parametrize("exchange,cut", [("all_gather", (1, 4, 1)), ("ring", (4, 1, 1))])
def test_masks_known_when_traced_under_an_explicit_mesh(exchange, cut):
    """Built with NumPy only: under ``jax.set_mesh`` of an Explicit mesh a ``shard_map`` body refuses
    eager JAX ops, which building the masks with ``jnp`` under ``ensure_compile_time_eval`` ran (and
    failed on, unless an Auto-mesh call had filled the cache first: cleared here)."""
    from jax_cp.kernels import _splash

    _splash._natural_info.cache_clear()
    c, u, t = cut
    mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, axis_types=jax.sharding.AxisType.Explicit)
    q, k, v, _ = random_qkv(B, S, H, 4, d, F32, seed=3)
    f = lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=exchange, kernel="splash",
                                                     is_causal=True)
    with jax.set_mesh(mesh):
        out = jax.jit(f)(q, k, v)
    assert_close(out, reference.dot_product_attention(q, k, v, is_causal=True), F32, f"{exchange=} {cut=}")


def _sub_jaxpr(eqn):
    """The one sub-jaxpr whose inputs are ``eqn``'s (shard_map, jit, custom_vjp_call), else None."""
    return next((j for j in sub_jaxprs(eqn) if len(j.invars) == len(eqn.invars)), None)


def _eqns(eqn):
    """``eqn`` and every equation it holds, at any depth."""
    yield eqn
    for j in sub_jaxprs(eqn):
        for e in j.eqns:
            yield from _eqns(e)


def _holds_a_ring(eqn) -> bool:
    return eqn.primitive.name == "custom_vjp_call" and has_primitive(eqn, "ppermute")


def _is_ring_vjp(eqn) -> bool:
    """The innermost ``custom_vjp_call`` holding a ``ppermute``: the ring's own."""
    return _holds_a_ring(eqn) and not any(_holds_a_ring(x) for j in sub_jaxprs(eqn) for e in j.eqns
                                          for x in _eqns(e))


def _splash_ring_operands(jaxpr, deps, found):
    """Appends to ``found`` the operands of each splash ring call in ``jaxpr`` (followed into shard_map,
    jit and outer ``custom_vjp_call``s) as ``(dtype, the names of deps' values it derives from)``;
    returns the names each of ``jaxpr``'s outputs derives from."""
    for e in jaxpr.eqns:
        src = [set() if hasattr(a, "val") else deps.get(a, set()) for a in e.invars]
        inner = _sub_jaxpr(e)
        if _is_ring_vjp(e):
            assert has_primitive(e, "pallas_call")
            found.append([(a.aval.dtype, s) for a, s in zip(e.invars, src)])
        if inner is not None and len(inner.outvars) == len(e.outvars):
            outs = _splash_ring_operands(inner, dict(zip(inner.invars, src)), found)
        else:
            outs = [set().union(*src)] * len(e.outvars)
        deps.update(zip(e.outvars, outs))
    return [set() if hasattr(v, "val") else deps.get(v, set()) for v in jaxpr.outvars]


def test_splash_ring_masks_are_tied_to_the_layers_queries():
    """The ring's masks come from positions and segment ids, the same in every layer: unless they derive
    from the layer's own data the TPU compiler computes every step's masks once before a scan over layers
    and keeps them live through the step (``pred[c - 2, B, H, T, d]``: 15.5 GiB a chip at 4M tokens on 64
    v5p chips, docs/guides/maxtext.md). Every integer operand of the splash ring (positions, segment ids)
    derives from the queries, read from the traced program's dataflow."""
    mesh = jax_cp.make_mesh(cp_colossal=4, cp_ulysses=2)
    q, k, v, _ = random_qkv(B, S, H, 2, d, F32, seed=3)
    seg = jnp.stack([jnp.arange(S) // 24, jnp.arange(S) // 40]).astype(jnp.int32)
    seg, pos = jax_cp.load_balance.reorder(seg, mesh)
    f = lambda q, k, v, pos, seg: jax_cp.dot_product_attention(  # noqa: E731
        q, k, v, mesh=mesh, kv_exchange="ring", kernel="splash", is_causal=True, positions=pos, segment_ids=seg)
    jaxpr = jax.make_jaxpr(f)(q, k, v, pos, seg).jaxpr
    calls = []
    _splash_ring_operands(jaxpr, dict(zip(jaxpr.invars, ({"q"}, {"k"}, {"v"}, {"pos"}, {"seg"}))), calls)
    assert len(calls) == 1, calls
    ints = [s for dtype, s in calls[0] if jnp.issubdtype(dtype, jnp.integer)]
    assert len(ints) >= 4 and all("q" in s for s in ints), calls[0]


@pytest.mark.parametrize("exchange,cut", [("all_gather", (1, 8)), ("ring", (4, 2))])
def test_masks_known_when_traced_add_no_program_arguments(exchange, cut):
    """With JAX's simplified constants (the default from JAX 0.12.1), constants over
    ``jax_embedded_constants_max_bytes`` become extra arguments of the compiled program. The splash
    masks of the default positions (a bound and a rows-with-a-key flag per query; 3 of each for the
    ring's steps; Ulysses alone: the local kernel's) are computed in the program instead: the
    program takes Q, K and V only."""
    mesh = jax_cp.make_mesh(cp_colossal=cut[0], cp_ulysses=cut[1])
    q, k, v, _ = random_qkv(B, 512, H, 4, d, F32, seed=3)  # 128 queries a rank: 512-byte bounds
    f = jax.jit(lambda q, k, v: jax_cp.dot_product_attention(q, k, v, mesh=mesh, kv_exchange=exchange,
                                                             kernel="splash", is_causal=True))
    saved = jax.config.jax_use_simplified_jaxpr_constants, jax.config.jax_embedded_constants_max_bytes
    jax.config.update("jax_use_simplified_jaxpr_constants", True)
    jax.config.update("jax_embedded_constants_max_bytes", 256)
    try:
        text = f.lower(q, k, v).as_text()
    finally:
        jax.config.update("jax_use_simplified_jaxpr_constants", saved[0])
        jax.config.update("jax_embedded_constants_max_bytes", saved[1])
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, flags=re.S).group(1)
    assert len(re.findall(r"%arg\d+:", main)) == 3, main
