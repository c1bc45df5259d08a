"""``"auto"`` knobs: the rule (a pure function of platform and layout), its resolution, explicit overrides."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_cp
from jax_cp import exchanges
from jax_cp._defaults import KV_MEMORY_SHARE, RULES, gathered_bytes, SPLASH_LONG_RULES, chip_of, choose

AG, A2A, RING = exchanges.AllGather(), exchanges.AllToAll(), exchanges.Ring()
GiB = 2**30


@pytest.mark.parametrize("chip, layout, want", [
    ("v5e", (1, 4, 2), (AG, 4, 1)),    # Ulysses: 4 chunks, the first fused
    ("v5e", (4, 1, 4), (A2A, 1, 0)),   # all-gather layout: K/V in one all-to-all, one chunk
    ("v5e", (2, 2, 4), (A2A, 2, 0)),   # hybrid: K/V in one all-to-all over both CP axes
    ("v5p", (1, 4, 4), (AG, 2, 2)),    # Ulysses: 2 chunks, both fused
    ("v5p", (4, 1, 4), (A2A, 1, 0)),
    ("v5p", (4, 4, 4), (RING, 2, 2)),  # hybrid: the ring, fused
    ("v6e", (2, 2, 4), (A2A, 2, 0)),   # unmeasured generation: the v5e rule, said so
])
def test_tpu_rule_per_chip_and_layout(chip, layout, want):
    c, u, t = layout
    got = choose(platform="tpu", chip=chip, c=c, u=u, t=t, num_heads=32)
    assert (got.kv_exchange, got.overlap_chunks, got.fused_qkv_chunks) == want
    assert "measured" in got.why and (chip in RULES or "the v5e rule" in got.why)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_cpu_and_gpu_keep_the_plain_layer(platform):
    got = choose(platform=platform, chip=None, c=2, u=2, t=2, num_heads=32)
    assert (got.kv_exchange, got.overlap_chunks, got.fused_qkv_chunks) == (AG, 1, 0)
    assert platform in got.why


def test_chunks_fit_the_heads_and_memory_picks_the_ring():
    # 2 query heads per device: 4 chunks cannot be, 2 can; fused never exceeds the chunks.
    got = choose(platform="tpu", chip="v5e", c=1, u=4, t=4, num_heads=32)
    assert (got.overlap_chunks, got.fused_qkv_chunks) == (2, 1)
    # 1 head per device: one chunk.
    assert choose(platform="tpu", chip="v5p", c=1, u=4, t=2, num_heads=8).overlap_chunks == 1
    # What a gathering exchange adds to a step (6x its gathered K/V, measured) beyond an eighth of HBM: the
    # ring (O(S/c) memory), whatever the table says.
    hbm = 16 * GiB
    layer = dict(platform="tpu", chip="v5e", c=4, u=1, t=4, num_heads=32, hbm_bytes=hbm)
    big = choose(**layer, kv_bytes_per_device=0.021 * hbm)
    small = choose(**layer, kv_bytes_per_device=0.020 * hbm)
    assert big.kv_exchange == RING and small.kv_exchange == A2A
    assert "would add 2.0 GiB (for 0.3 GiB of gathered K/V) > 12.5% of 16 GiB HBM: the ring" in big.why
    assert gathered_bytes(GiB) == 6 * GiB and KV_MEMORY_SHARE == 0.125
    # Llama 3.1 8B, B = 1, 1M tokens over c = 64 (8 kv heads of 128, bf16: 4 GiB gathered) on v5p: the ring
    # (the all-to-all's step did not fit: 99.5 GiB a chip, docs/guides/maxtext.md). 256K over c = 64 fits,
    # and takes the ring for its 64 ranks; over c = 16 the table's all-to-all.
    v5p = dict(platform="tpu", chip="v5p", c=64, u=1, t=1, num_heads=32, hbm_bytes=95 * GiB)
    assert choose(**v5p, kv_bytes_per_device=2**20 * 8 * 256 * 2).kv_exchange == RING
    at_256k = choose(**v5p, kv_bytes_per_device=2**18 * 8 * 256 * 2)
    assert at_256k.kv_exchange == RING and at_256k.why.startswith("cp_colossal=64 >= 32 ranks: the ring")
    assert choose(**{**v5p, "c": 16, "t": 4}, kv_bytes_per_device=2**18 * 8 * 256 * 2).kv_exchange == A2A


def test_chip_of_reads_the_device_kind():
    class Dev:
        def __init__(self, platform, kind=""):
            self.platform, self.device_kind = platform, kind

    assert chip_of(Dev("tpu", "TPU v5 lite")) == ("tpu", "v5e")
    assert chip_of(Dev("tpu", "TPU v5")) == ("tpu", "v5p")
    assert chip_of(Dev("tpu", "TPU v99")) == ("tpu", None)
    assert chip_of(Dev("cuda")) == ("gpu", None)
    assert chip_of(jax.devices()[0]) == ("cpu", None)


def test_resolution_keeps_explicit_values_on_a_tpu_mesh():
    pytest.importorskip("libtpu", reason="TPU topology devices come from the libtpu wheel")
    from jax_cp import plan

    mesh = plan.topology_mesh("v5e:2x4", cp_colossal=2, cp_ulysses=2, tp=2)
    base = dict(num_heads=32, num_kv_heads=8, head_dim=16, in_features=64)
    spec, why = jax_cp.AttentionSpec(**base).resolve(mesh)
    assert (spec.kv_exchange, spec.overlap_chunks, spec.fused_qkv_chunks) == (A2A, 2, 0) and spec.is_resolved
    assert "measured" in why.why
    spec, _ = jax_cp.AttentionSpec(**base, overlap_chunks=1).resolve(mesh)  # explicit chunks win
    assert (spec.kv_exchange, spec.overlap_chunks) == (A2A, 1)
    spec, _ = jax_cp.AttentionSpec(**base, fused_qkv_chunks=1).resolve(mesh)  # fusing rules out all_to_all
    assert (spec.kv_exchange, spec.overlap_chunks, spec.fused_qkv_chunks) == (AG, 2, 1)
    spec, _ = jax_cp.AttentionSpec(**base, kv_exchange="ring").resolve(mesh)  # explicit exchange wins
    assert spec.kv_exchange == RING
    explicit = jax_cp.AttentionSpec(**base, kv_exchange="all_gather", overlap_chunks=1, fused_qkv_chunks=0)
    assert explicit.resolve(mesh) == (explicit.replace(kernel="splash"), None)  # only the kernel was auto
    assert explicit.replace(kernel="blockwise").resolve(mesh) == (explicit.replace(kernel="blockwise"), None)


def test_module_defaults_are_auto_and_resolve_on_the_cpu():
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2)
    attn = jax_cp.CPAttention(8, 32, mesh=mesh, rngs=nnx.Rngs(0))
    assert (attn.spec.kv_exchange, attn.spec.overlap_chunks, attn.spec.fused_qkv_chunks) == ("auto",) * 3
    spec, why = attn.resolved(batch=2, seq_len=64)
    assert (spec.kv_exchange, spec.overlap_chunks, spec.fused_qkv_chunks) == (AG, 1, 0) and "cpu" in why.why
    fused = jax_cp.CPAttention(8, 32, mesh=mesh, fused_qkv_chunks=2, rngs=nnx.Rngs(0))  # the rule says 1 chunk
    spec, _ = fused.resolved(batch=2, seq_len=64)
    assert (spec.overlap_chunks, spec.fused_qkv_chunks) == (2, 2)  # auto chunks make room for explicit fusing
    pinned = jax_cp.CPAttention(8, 32, mesh=mesh, overlap_chunks=2, kv_exchange="ring", rngs=nnx.Rngs(0))
    spec, _ = pinned.resolved(batch=2, seq_len=64)
    assert (spec.kv_exchange, spec.overlap_chunks, spec.fused_qkv_chunks) == (RING, 2, 0)
    x = jax.random.normal(jax.random.key(0), (2, 64, 32))
    nnx.update(pinned, nnx.state(attn))  # same parameters: the resolved defaults and the pinned ring agree
    run = nnx.jit(lambda m, x: m(x))
    assert jnp.allclose(run(attn, x), run(pinned, x), atol=2e-5)


def _overlaps(layout, topology="v5e:2x4", kernel="blockwise", *, model=None, seq_len=4096, batch=1, **knobs):
    from jax_cp import plan

    c, u, t = layout
    spec = model or plan.ModelSpec(d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64)
    # The rules hold entries per kernel; with splash (what kernel="auto" runs on TPU) the Ulysses and
    # hybrid layers hide less (benchmarks/RESULTS.md, "Defaults with splash"), so those tests pin the
    # blockwise kernel and its rule.
    r = plan.analyze(topology=topology, model=spec, seq_len=seq_len, batch=batch, cp_colossal=c, cp_ulysses=u, tp=t,
                     baseline=False, kernel=kernel, **knobs)
    cp = r.analysis.schedule.select()
    return r, cp, (r.analysis.overlap("fwd"), r.analysis.overlap("bwd"))


PLAIN = dict(kv_exchange="all_gather", overlap_chunks=1, fused_qkv_chunks=0)  # the defaults before "auto"


def test_defaults_hide_the_hybrid_layer_in_the_tpu_schedule():
    """v5e:2x4 (2,2,2), 32 heads / 8 kv heads, S=4096: with nothing set, every CP collective of
    forward and backward has compute inside it; the plain layer leaves most forward bytes exposed.
    The defaults are kv_exchange='all_to_all' in 2 chunks, so this also checks the Q-gradient tie:
    chunk 1's projected Q is tied to chunk 2's Q weight (``tie_cotangents``), so chunk 1's
    Q-projection backward waits for chunk 2's weight gradient and XLA puts that matmul inside chunk
    1's Q-gradient all-to-all (without the tie it stays empty: 7 of 8 backward all-to-all bytes
    hidden); every backward Ulysses all-to-all (per chunk: output gradient, Q gradient) is async and
    encloses compute."""
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    r, cp, overlap = _overlaps((2, 2, 2))
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("all_to_all", 2, 0)
    assert "measured" in r.defaults and "auto (kv_exchange, overlap_chunks, fused_qkv_chunks)" in str(r)
    assert cp and all(c.overlapped for c in cp), [(c.kind, c.phase) for c in cp if not c.overlapped]
    bwd_ulysses = [c for c in r.analysis.schedule.select("bwd") if c.axes == ("cp_ulysses",)]
    assert len(bwd_ulysses) == 4 and all(c.is_async for c in bwd_ulysses), [(c.name, c.is_async) for c in bwd_ulysses]
    _, plain_cp, plain = _overlaps((2, 2, 2), **PLAIN)
    assert overlap == (1.0, 1.0) and plain[0] < 0.5 and not all(c.overlapped for c in plain_cp)
    # In time too: the matmuls inside cover at least 0.9 of each direction's estimated transfer time.
    assert r.analysis.covered("fwd") >= 0.9 and r.analysis.covered("bwd") >= 0.9, r.analysis.time_covered


def test_defaults_chunk_the_ulysses_layer_in_the_tpu_schedule():
    """v5e:2x4 (1,4,2), blockwise kernel: the defaults (4 chunks, the first fused) hide the whole forward
    and most of the backward (measured 1.00 / 0.88 at this size; 1.00 / 1.00 at Llama-3-8B size,
    benchmarks/RESULTS.md), against 0.20 / 0.60 for the plain layer."""
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    r, _, overlap = _overlaps((1, 4, 2))
    assert (r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == (4, 1)
    _, _, plain = _overlaps((1, 4, 2), **PLAIN)
    assert overlap[0] == 1.0 and overlap[1] >= 0.85 and overlap[0] > plain[0] + 0.5 and overlap[1] > plain[1]


def test_defaults_hide_the_ulysses_layer_with_splash():
    """v5e:2x4 (1,4,2) with splash (what kernel="auto" runs on a TPU): the splash rule (2 chunks, the
    first fused) puts every CP collective of forward and backward around compute, in bytes and in
    transfer time. This needs each splash call's rows-with-a-key mask tied to its own output
    (``_splash._splash_jit``): the two chunks' masks are equal, and untied XLA merges their selects
    into one fusion, so chunk 0's output all-to-all would wait for chunk 1's kernel with nothing
    inside it."""
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    r, cp, overlap = _overlaps((1, 4, 2), kernel="auto")
    assert r.analysis.kernel.startswith("splash"), r.analysis.kernel
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("all_gather", 2, 1)
    assert cp and all(c.overlapped for c in cp), [(c.phase, c.name) for c in cp if not c.overlapped]
    assert overlap == (1.0, 1.0) and r.analysis.covered("fwd") == r.analysis.covered("bwd") == 1.0
    # chunk 0's output all-to-all (a forward cp_ulysses exchange issued after a kernel) has a kernel inside
    fwd = [c for c in cp if c.phase == "fwd"]
    assert sum(any("splash" in n for n in c.compute_inside) for c in fwd) >= 2, [c.compute_inside for c in fwd]


@pytest.mark.parametrize("topology, kernel", [("v5e:2x4", "auto"), ("v5p:2x2x2", "blockwise")])
def test_defaults_hide_the_all_gather_layout_on_v5e_and_v5p(topology, kernel):
    """(4,1,2), nothing set: K/V in one all-to-all over cp_colossal, and every CP collective of forward
    and backward, with splash on v5e (what kernel="auto" runs) and the blockwise kernel on a small v5p,
    has compute inside, in bytes and in transfer time. (all_gather in 2 chunks hides less here, by an
    amount that depends on the JAX release, so the resolved knobs are what pins the rule.)"""
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    r, cp, overlap = _overlaps((4, 1, 2), topology, kernel)
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("all_to_all", 1, 0)
    assert cp and all(c.overlapped for c in cp), [(c.kind, c.phase) for c in cp if not c.overlapped]
    assert overlap == (1.0, 1.0) and r.analysis.covered("fwd") == r.analysis.covered("bwd") == 1.0


def test_defaults_hide_the_llama_layer_on_v5p():
    """v5p:4x4x4, Llama-3-8B attention dims, B=4, S=8192, kernel="auto" (splash), nothing set. On a small
    v5p (2x2x2) no grouping hides every Ulysses or hybrid exchange at any size we compiled
    (benchmarks/RESULTS.md, "Defaults"), so the v5p rules are checked on the topology they were
    measured on. Ulysses (1,4,4): every CP collective of forward and backward has compute inside, in
    bytes and in transfer time, against less than half the forward for the plain layer. Hybrid (4,4,4),
    the ring: the same. While the ring sorted positions at run time, 0.87 of the forward's transfer
    time was covered (the sorts were all that ran under the first chunk's fused all-to-all) and a few
    small position transfers of the backward ran alone; with the default positions its masks are
    known when traced, picked by the step (``_splash._natural_masks``), and no positions travel."""
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    big = dict(model="llama3-8b", seq_len=8192, batch=4)
    r, cp, overlap = _overlaps((1, 4, 4), "v5p:4x4x4", "auto", **big)
    assert r.analysis.kernel.startswith("splash"), r.analysis.kernel
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("all_gather", 2, 2)
    assert cp and all(c.overlapped for c in cp), [(c.phase, c.name) for c in cp if not c.overlapped]
    assert overlap == (1.0, 1.0) and r.analysis.covered("fwd") == r.analysis.covered("bwd") == 1.0
    _, _, plain = _overlaps((1, 4, 4), "v5p:4x4x4", "auto", **big, **PLAIN)
    assert plain[0] < 0.5, plain

    r, cp, overlap = _overlaps((4, 4, 4), "v5p:4x4x4", "auto", **big)
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("ring", 2, 1)
    assert {c.kind for c in cp} == {"all-to-all", "collective-permute"}, {c.kind for c in cp}
    assert all(c.overlapped for c in cp), [(c.phase, c.name) for c in cp if not c.overlapped]
    assert overlap == (1.0, 1.0) and r.analysis.covered("fwd") == r.analysis.covered("bwd") == 1.0


def test_defaults_hide_the_ulysses_layer_without_tp_on_v5p():
    """v5p:4x4x4 Ulysses (1,4,1) (dp=16), Llama-3-8B attention dims, splash, nothing set: the rule's
    ``"ulysses, t=1"`` entry (2 chunks, only the first fused) puts every CP collective of forward and
    backward around compute, in bytes and in transfer time. With tp=1 each device holds 8 query heads;
    with both chunks fused (the (1,4,4) entry) the second chunk's Q/K/V all-to-all had nothing inside
    from two sequences per replica on (0.50 / 1.00 here, 0.70 / 1.00 at S=8K with B=32 and 64). S=2048
    keeps the compile short; the rule was measured at 8K, 32K and 128K (jax_cp._defaults)."""
    v5p = dict(platform="tpu", chip="v5p", c=1, u=4, num_heads=32, kernel="splash")
    pick = lambda **k: (lambda ch: (ch.kv_exchange, ch.overlap_chunks, ch.fused_qkv_chunks))(choose(**k))  # noqa: E731
    assert pick(**v5p, t=1) == pick(**v5p, t=1, tokens_per_device=32768) == (AG, 2, 1)
    assert pick(**v5p, t=4) == (AG, 2, 2) and pick(**{**v5p, "kernel": "blockwise"}, t=1) == (AG, 2, 2)
    pytest.importorskip("libtpu", reason="the TPU schedule comes from the libtpu wheel's compiler")
    r, cp, overlap = _overlaps((1, 4, 1), "v5p:4x4x4", "auto", model="llama3-8b", seq_len=2048, batch=32)
    assert r.analysis.kernel.startswith("splash"), r.analysis.kernel
    assert (r.layer.kv_exchange, r.layer.overlap_chunks, r.layer.fused_qkv_chunks) == ("all_gather", 2, 1)
    assert cp and all(c.overlapped for c in cp), [(c.phase, c.name) for c in cp if not c.overlapped]
    assert overlap == (1.0, 1.0) and r.analysis.covered("fwd") == r.analysis.covered("bwd") == 1.0


def test_recommended_flags_for_this_host():
    """models.train applies plan's flags before JAX starts: TPU (libtpu installed) with the chip from
    TPU_ACCELERATOR_TYPE, nothing on a CPU-only run, and flags the user set keep their value."""
    from jax_cp import plan

    assert plan.apply_for_this_host({"JAX_PLATFORMS": "cpu"}) is None
    pytest.importorskip("libtpu", reason="the TPU branch needs the libtpu wheel")
    env = {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_all_to_all=false"}
    name, value = plan.apply_for_this_host(env)
    assert name == "LIBTPU_INIT_ARGS" and env[name] == value
    flags = value.split()
    assert "--xla_tpu_enable_async_all_to_all=false" in flags  # the user's choice wins
    assert set(plan.recommended_xla_flags("tpu", chip="v5e")) - {"--xla_tpu_enable_async_all_to_all=true"} <= set(flags)
    _, v5p = plan.apply_for_this_host({"TPU_ACCELERATOR_TYPE": "v5p-128"})
    assert set(v5p.split()) == set(plan.recommended_xla_flags("tpu", chip="v5p"))
    _, fsdp = plan.apply_for_this_host({"TPU_ACCELERATOR_TYPE": "v5p-128"}, fsdp=True)  # models.train unless --no-fsdp
    added = set(fsdp.split()) - set(v5p.split())
    assert added == {"--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
                     "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true"}


def test_splash_layers_take_the_rule_measured_with_splash():
    """The rule is per kernel: with splash in the layer (what kernel="auto" runs on a TPU) the v5e Ulysses
    grouping is the one measured with splash; layouts splash was not re-measured for keep the blockwise one;
    a layer splash cannot serve (the max-logit statistic: blockwise on TPU) keeps the blockwise rule."""
    splash = choose(platform="tpu", chip="v5e", c=1, u=4, t=2, num_heads=32, kernel="splash")
    blockwise = choose(platform="tpu", chip="v5e", c=1, u=4, t=2, num_heads=32)
    assert (splash.overlap_chunks, splash.fused_qkv_chunks, blockwise.overlap_chunks) == (2, 1, 4)
    assert "with splash" in splash.why and "with splash" not in blockwise.why
    colossal = choose(platform="tpu", chip="v5e", c=4, u=1, t=4, num_heads=32, kernel="splash")
    assert colossal == choose(platform="tpu", chip="v5e", c=4, u=1, t=4, num_heads=32)
    spec = jax_cp.AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, is_causal=True)
    assert spec._tpu_kernel("tpu") == "splash" and spec._tpu_kernel("gpu") == "blockwise"
    assert spec.replace(local_window_size=(128, 0))._tpu_kernel("tpu") == "splash"  # windows too, now
    assert spec.replace(record_max_logits=True)._tpu_kernel("tpu") == "blockwise"
    assert spec.replace(kernel="blockwise")._tpu_kernel("tpu") == "blockwise"


def test_long_sequences_take_the_long_splash_entry():
    """v5p Ulysses with splash: both chunks fused up to 16K tokens per device, only the first from there
    on (measured at 8K, 16K and 32K tokens per device: jax_cp._defaults.SPLASH_LONG_RULES); the blockwise
    rule and other chips are not length-dependent; the sequence length reaches the rule through resolve."""
    (threshold, _), = SPLASH_LONG_RULES["v5p"].values()
    assert threshold == 16384
    v5p = dict(platform="tpu", chip="v5p", c=1, u=4, t=4, num_heads=32, kernel="splash")
    pick = lambda **k: (lambda ch: (ch.kv_exchange, ch.overlap_chunks, ch.fused_qkv_chunks))(choose(**k))  # noqa: E731
    assert pick(**v5p) == pick(**v5p, tokens_per_device=threshold - 1) == (AG, 2, 2)
    assert pick(**v5p, tokens_per_device=threshold) == pick(**v5p, tokens_per_device=32768) == (AG, 2, 1)
    assert "16K tokens per device" in choose(**v5p, tokens_per_device=threshold).why
    assert pick(**{**v5p, "kernel": "blockwise"}, tokens_per_device=32768) == (AG, 2, 2)
    assert pick(**{**v5p, "chip": "v5e", "t": 2}, tokens_per_device=32768) == (AG, 2, 1)  # v5e's splash entry
    hybrid = dict(v5p, c=4)
    assert pick(**hybrid, tokens_per_device=32768) == pick(**hybrid) == (RING, 2, 1)
    pytest.importorskip("libtpu", reason="TPU topology devices come from the libtpu wheel")
    from jax_cp import plan

    mesh = plan.topology_mesh("v5p:2x2x2", cp_ulysses=4, tp=2)
    base = jax_cp.AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, is_causal=True)
    short, _ = base.resolve(mesh, batch=1, seq_len=4 * 8192)
    long, why = base.resolve(mesh, batch=1, seq_len=4 * 16384)
    assert (short.overlap_chunks, short.fused_qkv_chunks, long.overlap_chunks, long.fused_qkv_chunks) == (2, 2, 2, 1)
    assert "tokens per device" in why.why
