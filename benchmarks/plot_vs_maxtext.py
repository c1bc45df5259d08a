"""Draws ``vs_maxtext.py``'s comparisons: peak memory and estimated step per context, each side.

    JAX_PLATFORMS=cpu python benchmarks/plot_vs_maxtext.py --runs runs/vs_maxtext --png docs/assets/vs_maxtext.png

Reads every ``<side>-summary.json`` that ``vs_maxtext.py`` wrote under ``--runs`` (one folder per topology,
context, batch and head size) and groups the sides into jax_cp (its lowest estimated step at each context,
over the variants compiled: e.g. its default exchange and ``--jax-cp-kv-exchange ring``), MaxText with its
own flags and MaxText with jax_cp's (``--maxtext-flags jax_cp``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 2**30
FAMILIES = ("jax_cp", "MaxText, its flags", "MaxText, jax_cp's flags")


def family(side: str) -> str:
    """The line a side's figures belong to."""
    if side.startswith("jax_cp"):
        return FAMILIES[0]
    return FAMILIES[2] if side.endswith("-jaxcpflags") else FAMILIES[1]


def collect(runs: list[str], topology: str) -> dict[str, dict[int, dict]]:
    """``{family: {seq_len: figures}}``; where a family has several sides at a context, the lowest
    estimated step."""
    out: dict[str, dict[int, dict]] = {f: {} for f in FAMILIES}
    for path in sorted(p for r in runs for p in Path(r).glob("*/*-summary.json")):
        rec = json.loads(path.read_text())
        if rec["topology"] != topology:
            continue
        fam, S = family(rec["side"]), rec["seq_len"]
        fig = dict(rec["figures"], side=rec["side"], layers=rec["layers"])
        if S not in out[fam] or fig["step_s"] < out[fam][S]["step_s"]:
            out[fam][S] = fig
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["runs/vs_maxtext"], help="vs_maxtext.py's --out folders")
    p.add_argument("--topology", default="v5p:4x4x4")
    p.add_argument("--png", default="vs_maxtext.png")
    a = p.parse_args(argv)
    data = collect(a.runs, a.topology)
    if not any(data.values()):
        raise SystemExit(f"no *-summary.json for {a.topology} under {a.runs}: run benchmarks/vs_maxtext.py first")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 3.8))
    base = data[FAMILIES[1]]
    for fam, marker in zip(FAMILIES, "o^s"):
        pts = sorted(data[fam].items())
        if not pts:
            continue
        xs = [S for S, _ in pts]
        mem.plot(xs, [f["peak"] / GiB for _, f in pts], marker=marker, label=fam)
        ratio = [(S, f["step_s"] / base[S]["step_s"]) for S, f in pts if S in base]
        step.plot([S for S, _ in ratio], [r for _, r in ratio], marker=marker, label=fam)
        for S, f in pts:
            print(f"{fam:24} S={S:>8}  peak {f['peak'] / GiB:6.2f} GiB  exposed {f['exposed_s'] * 1e3:7.1f} ms  "
                  f"est. step {f['step_s'] * 1e3:9.1f} ms  ({f['side']})")
    for ax in (mem, step):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    mem.set_ylabel("peak per chip (GiB)")
    step.set_ylabel("est. step / MaxText's (its flags)")
    step.axhline(0.95, color="grey", ls="--", lw=0.8)
    mem.legend(fontsize=8)
    layers = sorted({f["layers"] for pts in data.values() for f in pts.values()})
    fig.suptitle(f"Llama 3.1 8B training step, {a.topology}, {'/'.join(map(str, layers))} layers "
                 "(benchmarks/vs_maxtext.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print("wrote", a.png)


if __name__ == "__main__":
    main()
