"""Smoke test of benchmarks/compare_peers.py: the harness runs the jax_cp strategies at a tiny S,
finds them correct, and reports a deliberately wrong implementation as WRONG, never as fastest."""
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import needs_devices

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compare_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("compare_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _wrong_impl(bench):
    """Ignores the causal mask (what a peer did under jax.vjp) and is very fast at it."""
    import jax_cp

    def build(case):
        mesh = jax_cp.make_mesh(cp_ulysses=8)

        def attn(q, k, v):
            return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=False)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", ("cp_colossal", "cp_ulysses"),
                                                                              "tp", None))
        return attn, sharding

    return bench.Impl("deliberately wrong (no mask)", "peer", build)


def _nan_impl(bench):
    """Returns NaN: must be WRONG too."""
    def build(case):
        return (lambda q, k, v: q * jnp.nan), jax.devices()[0]
    return bench.Impl("returns NaN", "peer", build)


@needs_devices(8)
def test_harness_marks_wrong_and_ranks_correct(bench):
    lines = []
    rows = bench.main(["--seq", "256", "--dtype", "float32", "--causal", "causal", "--mode", "fwd", "fwd+bwd",
                       "--reps", "1", "--only", "ulysses", "all-gather", "deliberately", "NaN", "--ref-rows", "32"],
                      extra_impls=[_wrong_impl(bench), _nan_impl(bench)], log=lines.append)
    assert len(rows) == 2
    for results in rows:
        by = {r.impl: r for r in results}
        assert by["deliberately wrong (no mask)"].status == "WRONG", by["deliberately wrong (no mask)"]
        assert by["returns NaN"].status == "WRONG"
        assert by["deliberately wrong (no mask)"].ratio is None  # wrong ones are never ranked
        mine = [r for r in results if r.group == "jax_cp"]  # ulysses, all-gather, all-gather +lb
        assert len(mine) == 3 and all(r.status == "ok" and r.times for r in mine), mine
        assert all(r.error < 1e-4 for r in mine)
        assert all(r.ratio is None for r in mine)  # no correct peer in this row: nothing to compare with
    text = "\n".join(lines)
    assert "WRONG" in text and "skipped: MaxText" in text
    assert "peer - (no correct peer)" in text and "peer None" not in text
    summary = bench.summary(rows)
    assert all("deliberately wrong (no mask)" in s["wrong"] for s in summary)
    assert all(s["best_peer"] is None and s["best_jax_cp"].startswith("jax_cp") for s in summary)


@needs_devices(8)
def test_ratio_against_fastest_correct_peer_and_markdown(bench, tmp_path):
    """A correct 'peer' (the jax_cp Ulysses strategy under another name) gives ratios; --prune and the
    long-S options are accepted; the markdown has the summary and the full table."""
    import jax_cp

    def build(case):
        mesh = jax_cp.make_mesh(cp_colossal=8)

        def attn(q, k, v):
            return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=case.causal)
        return attn, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            "dp", ("cp_colossal", "cp_ulysses"), "tp", None))

    md = tmp_path / "out.md"
    rows = bench.main(["--seq", "128", "256", "--dtype", "bfloat16", "--causal", "full", "--mode", "fwd",
                       "--long-dtype", "float32", "--reps", "2", "--only", "ulysses", "stand-in",
                       "--prune", "100", "--drop-after-first", "1000", "--markdown", str(md), "--ref-rows", "16"],
                      extra_impls=[bench.Impl("stand-in peer", "peer", build)], log=lambda *_: None)
    assert [r[0].case.seq for r in rows] == [128, 256]
    for results in rows:
        by = {r.impl: r for r in results}
        assert by["stand-in peer"].ratio == pytest.approx(1.0)
        assert by["jax_cp ulysses (1,8,1)"].ratio is not None and len(by["jax_cp ulysses (1,8,1)"].times) == 2
    text = md.read_text()
    assert "| S=128 bfloat16 full fwd |" in text and "stand-in peer" in text and "Skipped peers" in text


@needs_devices(8)
def test_no_peer_says_what_to_install(bench):
    """Without any peer (none installed, or --only left them out) the summary says so, not 'peer None 0.000s'."""
    lines = []
    bench.main(["--seq", "128", "--dtype", "float32", "--mode", "fwd", "--reps", "1", "--only", "ulysses",
                "--ref-rows", "16"], log=lines.append)
    text = "\n".join(lines)
    assert "no peer ran, so no ratios" in text and "pip install -e '.[bench]'" in text, text
    assert "peer None" not in text and "peer - (no correct peer)" in text
