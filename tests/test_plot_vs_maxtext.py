"""``benchmarks/plot_vs_maxtext.py``: the summaries ``vs_maxtext.py`` writes, grouped into jax_cp (its lowest
estimated step at each context), MaxText with its flags and with jax_cp's, then drawn."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plot_vs_maxtext as plot  # noqa: E402


def _summary(folder, side, S, step_s, peak=2**30, topology="v5p:4x4x4"):
    folder.mkdir(parents=True, exist_ok=True)
    figures = {"peak": peak, "exposed_s": 0.01, "step_s": step_s}
    (folder / f"{side}-summary.json").write_text(json.dumps(
        {"side": side, "topology": topology, "seq_len": S, "batch": 1, "layers": 32, "figures": figures}))


def test_the_summaries_group_by_family_and_keep_jax_cps_fastest(tmp_path):
    run = tmp_path / "runs"
    _summary(run / "a", "jax_cp-fsdp-scan", 1024, 3.0)
    _summary(run / "a", "jax_cp-fsdp-scan-ring", 1024, 2.0)  # the faster variant is jax_cp's point
    _summary(run / "a", "maxtext-ring-full", 1024, 4.0)
    _summary(run / "a", "maxtext-ring-full-jaxcpflags", 1024, 3.5)
    _summary(run / "b", "jax_cp-fsdp-scan", 2048, 5.0, topology="v5e:4x4")  # another topology: left out
    data = plot.collect([str(run)], "v5p:4x4x4")
    assert {f: {S: fig["step_s"] for S, fig in pts.items()} for f, pts in data.items()} == {
        "jax_cp": {1024: 2.0}, "MaxText, its flags": {1024: 4.0}, "MaxText, jax_cp's flags": {1024: 3.5}}
    assert data["jax_cp"][1024]["side"] == "jax_cp-fsdp-scan-ring"
    png = tmp_path / "out.png"
    plot.main(["--runs", str(run), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no \\*-summary.json for v6e:4x4"):
        plot.main(["--runs", str(run), "--topology", "v6e:4x4", "--png", str(png)])


def test_the_whole_step_is_taken_as_compiled_and_cuts_are_extrapolated():
    import vs_maxtext

    cuts = {2: {"peak": 10.0, "exposed_s": 1.0}, 4: {"peak": 14.0, "exposed_s": 1.5}}
    assert vs_maxtext.extrapolate(cuts, 32) == {"peak": 70.0, "exposed_s": 8.5, "step_s": None}
    whole = {32: {"peak": 69.0, "exposed_s": 8.0}}
    assert vs_maxtext.extrapolate({**cuts, **whole}, 32) == {"peak": 69.0, "exposed_s": 8.0, "step_s": None}
    with pytest.raises(SystemExit, match=r"--layers=\[4\]: two layer counts .* the model's 32 \(--full-layers\)"):
        vs_maxtext.extrapolate({4: cuts[4]}, 32)


def test_a_records_remat_is_the_one_its_step_compiled_with():
    """``--jax-cp-remat auto`` compiles with the policy ``models.train.plan_train_step`` takes, named in the
    analysis's label; the FLOP count's kernel rerun follows it (older records: their config's policy)."""
    import vs_maxtext

    assert vs_maxtext.remat_of({"label": "train step llama3-8b-L32 remat=attention",
                                "train_config": {"remat_policy": "auto"}}) == "attention"
    assert vs_maxtext.remat_of({"label": "train step llama3-8b-L32 remat=offload"}) == "offload"
    assert vs_maxtext.remat_of({"train_config": {"remat_policy": "attention"}}) == "attention"
    assert vs_maxtext.remat_of({}) == "full"


def test_jax_cp_can_compile_for_maxtexts_description_of_the_pod():
    """``--jax-cp-topology maxtext`` (the default): libtpu takes MaxText's description of each pod the comparison uses (its
    chip config, chips per host, wraparound links) and gives the same devices as jax_cp.plan's; other
    topologies get a ValueError that names the option."""
    import vs_maxtext
    from jax.experimental import topologies

    from jax_cp import plan

    for name, devices in (("tpu7x:4x4x4", 128), ("v5p:4x4x4", 64)):
        kw = vs_maxtext.maxtext_topology_kwargs(name)
        assert kw["wrap"] == (True, True, True) and kw["chips_per_host_bounds"] == (2, 2, 1)
        theirs = topologies.get_topology_desc(**kw).devices
        assert len(theirs) == len(plan.get_topology(name).devices) == devices
    ours = plan.get_topology("tpu7x:4x4x4")
    try:  # plan.set_topology: later plans for the name use the description given
        given = plan.set_topology("tpu7x:4x4x4", **vs_maxtext.maxtext_topology_kwargs("tpu7x:4x4x4"))
        assert plan.get_topology("tpu7x:4x4x4") is given is not ours
    finally:
        plan.set_topology("tpu7x:4x4x4")  # back to the name alone, for the tests after this one
    with pytest.raises(ValueError, match=r"--topology v5e:4x4 has no MaxText description.*--jax-cp-topology plan"):
        vs_maxtext.maxtext_topology_kwargs("v5e:4x4")
