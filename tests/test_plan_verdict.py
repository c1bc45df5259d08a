"""The planner's verdict line, the auto rule's measured shape against the plan's own overlap, and a
start-up free of libtpu's noise.

The choosing logic is pure (``plan._verdict``: plain numbers in); one command-line run compiles
two tiny layouts on ``v5e:2x4`` (a few seconds) and one plans a single layout.
"""
import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jax_cp import plan
from jax_cp._defaults import MEASURED_AT, RULES, SPLASH_LONG_RULES, SPLASH_RULES, _measured_overlap, choose
from jax_cp.plan._verdict import Option, rule_check, verdict

MiB = 2**20
# The v5p:4x4x4 S = 8K comparison: the estimates tie, the memories do not.
ALL_GATHER = Option(label="all-gather (4,1,4)", step_s=39.98e-3, memory_bytes=593 * MiB, cp_bytes=590 * MiB)
ULYSSES = Option(label="Ulysses (1,4,1)", step_s=39.99e-3, memory_bytes=932 * MiB, cp_bytes=1000 * MiB)
HYBRID = Option(label="hybrid (4,4,1)", step_s=45.0e-3, memory_bytes=700 * MiB, cp_bytes=800 * MiB)
NOISE = ("unexpected worker hostname", "Failed to find host bounds", "E0000", "Source Location Trace")


def test_a_near_tie_goes_to_the_layout_with_less_memory():
    v = verdict([ULYSSES, HYBRID, ALL_GATHER])
    assert (v.pick, v.against, v.decided_by) == (ALL_GATHER, ULYSSES, "memory")
    assert str(v) == ("verdict: run all-gather (4,1,4): est. step 39.98 ms ties Ulysses (1,4,1) 39.99 ms within 2 %; "
                      "it uses 593 vs 932 MiB per device and 0.59x the CP bytes")


def test_a_clear_winner_wins_on_time():
    v = verdict([HYBRID, ULYSSES])
    assert (v.pick, v.against, v.decided_by) == (ULYSSES, HYBRID, "time")
    assert v.line == ("verdict: run Ulysses (1,4,1): est. step 39.99 ms, the lowest (hybrid (4,4,1): 45.00 ms, "
                      "+13 %); it uses 932 vs 700 MiB per device and 1.25x the CP bytes")
    # Just outside the tie: time still decides, whatever the memory.
    slower = Option(label="b", step_s=39.98e-3 * 1.021, memory_bytes=1 * MiB, cp_bytes=0)
    assert verdict([ALL_GATHER, slower]).pick == ALL_GATHER


def test_a_tie_in_time_and_memory_goes_to_fewer_cp_bytes():
    twin = Option(label="twin", step_s=39.90e-3, memory_bytes=595 * MiB, cp_bytes=900 * MiB)
    v = verdict([twin, ALL_GATHER])
    assert (v.pick, v.decided_by) == (ALL_GATHER, "CP bytes")
    assert v.line == ("verdict: run all-gather (4,1,4): est. step 39.98 ms ties twin 39.90 ms within 2 %, and so "
                      "does memory (593 vs 595 MiB per device); it moves 0.66x the CP bytes")


def test_only_layouts_that_fit_count():
    big = Option(label="big", step_s=1e-3, memory_bytes=99 * 2**30, cp_bytes=0, fits=False)
    v = verdict([big, HYBRID])
    assert (v.pick, v.decided_by) == (HYBRID, "fits")
    assert v.line.endswith("the only one of 2 that fits the memory budget")
    none = verdict([big, dataclasses.replace(big, label="bigger", memory_bytes=100 * 2**30)])
    assert none.pick is None and none.decided_by == "nothing fits"
    assert none.line.startswith("verdict: none of the 2 fits the memory budget; the smallest, big, needs 99 GiB "
                                "per device")
    assert verdict([big]).line.startswith("verdict: big does not fit the memory budget: it needs 99 GiB per device")
    assert verdict([HYBRID]).line == "verdict: run hybrid (4,4,1): est. step 45.00 ms, 700 MiB per device"


@pytest.mark.parametrize("call, match", [
    (lambda: verdict([]), "verdict needs at least one option"),
    (lambda: verdict([HYBRID], tie=1.5), r"tie=1.5 must be a share in \[0, 1\)"),
    (lambda: Option(label="x", step_s=-1.0, memory_bytes=0, cp_bytes=0), "Option 'x': step_s=-1.0 must be >= 0"),
    (lambda: plan.parse_layout("4,1"), r"layout='4,1' must be three integers C,U,T"),
    (lambda: plan.compare(topology="v5e:2x4", layouts=[], seq_len=512), "layouts is empty"),
    (lambda: plan.compare(topology="v5e:2x4", layouts=["1,4,2"], seq_len=512, baseline=True),
     "baseline= is set by compare itself"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rule_check_says_when_a_plan_hides_less_than_the_rule_measured():
    met = rule_check((1.0, 1.0), (1.0, 0.999))
    assert met == "this plan hides 1.00 / 1.00 of its CP bytes (fwd / bwd), as the rule measured"
    below = rule_check((1.0, 1.0), (0.80, 0.90))
    assert below.startswith("this plan hides 0.80 / 0.90 of its CP bytes (fwd / bwd), below the rule's 1.00 / 1.00 "
                            "at the shape in brackets") and "strategy auto" in below
    assert rule_check((1.0, 1.0), (None, None)) == ""


def test_every_tpu_rule_names_its_measured_shape_and_overlap():
    """The auto line carries the shape the rule was measured at (batch, sequence, model) and the figure,
    so a plan of another shape can be told apart; the picks themselves are unchanged (tests/test_defaults.py)."""
    notes = [e[3] for table in (RULES, SPLASH_RULES) for kinds in table.values() for e in kinds.values()]
    notes += [e[1][3] for kinds in SPLASH_LONG_RULES.values() for e in kinds.values()]
    for note in notes:
        got = _measured_overlap(note)
        assert got is not None and all(0 < x <= 1 for x in got), note
    assert _measured_overlap("v5p (1,4,4) with splash at >= 16K tokens per device: 0.75-1.00 / 1.00") == (0.75, 1.0)
    for chip in ("v5e", "v5p", "v6e"):
        for kernel in ("blockwise", "splash"):
            for c, u in ((1, 4), (4, 1), (2, 2)):
                ch = choose(platform="tpu", chip=chip, c=c, u=u, t=1, num_heads=32, kernel=kernel)
                known = chip if chip in RULES else "v5e"
                assert ch.measured_at == MEASURED_AT[known] and f"[{known} = {MEASURED_AT[known]}]" in ch.why
                assert ch.measured_overlap == _measured_overlap(ch.why)
    assert "B=4" in MEASURED_AT["v5p"] and "Llama-3-8B" in MEASURED_AT["v5p"] and "S = 8K" in MEASURED_AT["v5p"]
    # Not the measured grouping: no claim to compare against.
    assert choose(platform="cpu", chip=None, c=2, u=2, t=1, num_heads=8).measured_overlap is None
    ring = choose(platform="tpu", chip="v5e", c=4, u=1, t=1, num_heads=8, kv_bytes_per_device=8e9, hbm_bytes=16e9)
    assert "the ring" in ring.why and ring.measured_overlap is None


def _planned(step_ms, mib, cp_mib, label="CPAttention (4,4,4)", fits=True):
    """What the one-layout verdict reads of an Analysis (no compile)."""
    return SimpleNamespace(label=label, estimate=SimpleNamespace(step_s=step_ms * 1e-3), cp_bytes=cp_mib * MiB,
                           memory=SimpleNamespace(total=mib * MiB, fits=fits))


def test_one_layout_verdict_weighs_the_layout_against_the_naive_placement():
    """README's first example (v5p:4x4x4 (4,4,4), S = 128K, B = 1): the estimates tie and the chunked
    grouping costs memory and bytes, so the verdict says the grouping does not pay and what to plan instead;
    a grouping that wins is run as planned."""
    from jax_cp.plan._analyze import _one_layout_verdict

    shape = SimpleNamespace(kv_exchange="ring", overlap_chunks=2, fused_qkv_chunks=1)
    chunked, naive = _planned(39.976, 931.78, 576), _planned(39.993, 593.52, 320, label="naive fused QKV")
    assert _one_layout_verdict(chunked, naive, shape) == (
        "verdict: CPAttention (4,4,4)'s grouping (kv_exchange=ring, overlap_chunks=2, fused_qkv_chunks=1) does not "
        "beat the naive placement here, whose est. step 39.99 ms ties CPAttention (4,4,4) 39.98 ms within 2 %; it "
        "uses 594 vs 932 MiB per device and 0.56x the CP bytes: plan one chunk (--overlap-chunks 1 "
        "--fused-qkv-chunks 0) or let --strategy auto compile the groupings")
    one_chunk = SimpleNamespace(kv_exchange="ring", overlap_chunks=1, fused_qkv_chunks=0)
    assert _one_layout_verdict(_planned(39.502, 561.44, 320), naive, one_chunk) == (
        "verdict: run CPAttention (4,4,4): est. step 39.50 ms ties the naive placement 39.99 ms within 2 %; it uses "
        "561 vs 594 MiB per device and 1.00x the CP bytes; the only layout planned: to choose one, --compare C,U,T "
        "C,U,T ... (plan.compare) or --strategy auto")
    assert _one_layout_verdict(_planned(39.0, 900, 576), None, shape).startswith(
        "verdict: run CPAttention (4,4,4): est. step 39.00 ms, 900 MiB per device; the only layout planned")
    assert "does not fit the memory budget" in _one_layout_verdict(_planned(1.0, 9e5, 1, fits=False), None, shape)


def _child_env() -> dict[str, str]:
    """The test process's environment without libtpu's worker variables (so the planner's own handling runs)."""
    env = {k: v for k, v in os.environ.items() if k not in plan._analyze.QUIET_LIBTPU_ENV}
    return env | {"JAX_PLATFORMS": "cpu"}


def test_cli_compares_layouts_and_ends_with_a_verdict_without_libtpu_noise():
    cmd = [sys.executable, "-m", "jax_cp.plan", "--topology", "v5e:2x4", "--model", "tiny", "--seq-len", "512",
           "--compare", "1,4,2", "4,1,2"]
    out = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not any(n in out.stderr for n in NOISE), out.stderr[-3000:]
    lines = out.stdout.rstrip().splitlines()
    assert lines[0] == "jax_cp plan: v5e:2x4 (TPU v5 lite), 2 layouts of one layer at the same global batch"
    assert "CPAttention (1,4,2)   CPAttention (4,1,2)" in out.stdout
    assert lines[-1].startswith("verdict: run CPAttention (") and " per device and " in lines[-1], lines[-1]
    assert "[v5e = v5e:4x4, a Llama-3-8B layer" in out.stdout and "this plan hides " in out.stdout


def test_one_layout_plan_ends_with_a_verdict_and_leaves_the_environment_as_it_was():
    code = ("import os; from jax_cp.plan.__main__ import main; "
            "rc = main(['--topology', 'v5e:2x4', '--model', 'tiny', '--seq-len', '512', '--cp-ulysses', '4', "
            "'--tp', '2']); print('env after:', os.environ.get('TPU_WORKER_HOSTNAMES'), "
            "os.environ.get('TPU_HOST_BOUNDS')); raise SystemExit(rc)")
    out = subprocess.run([sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not any(n in out.stderr for n in NOISE), out.stderr[-3000:]
    *report, verdict_line, env_line = out.stdout.rstrip().splitlines()
    assert verdict_line.startswith("verdict: ") and "CPAttention (1,4,2)" in verdict_line and \
        "the naive placement" in verdict_line and "--strategy auto" in verdict_line, verdict_line
    assert env_line == "env after: None None"
    auto = next(i for i, x in enumerate(report) if x.startswith("auto (kv_exchange"))
    assert "[v5e = v5e:4x4, a Llama-3-8B layer (D=4096, 32 heads, 8 kv heads), B=2" in report[auto]
    assert report[auto + 1].startswith("  this plan hides ")


def test_auto_strategy_picks_by_the_verdict_and_prints_it_last():
    r = plan.analyze(topology="v5e:2x4", model="tiny", seq_len=512, batch=1, strategy="auto", candidates=1,
                     baseline=False)
    assert r.verdict.startswith("verdict: run (") and str(r).splitlines()[-1] == r.verdict
    chosen = next(x for x in r.reasons if x.startswith("chosen: "))
    m = r.mesh_shape
    assert f"cp_colossal={m['cp_colossal']} cp_ulysses={m['cp_ulysses']} tp={m['tp']}" in chosen
    assert r.verdict.startswith(f"verdict: run ({m['cp_colossal']},{m['cp_ulysses']},{m['tp']}) {r.layer.kv_exchange} "
                                f"overlap_chunks={r.layer.overlap_chunks}")
