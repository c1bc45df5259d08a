"""Every ```python block of the README runs as written: in order, each in a fresh namespace of one
fresh interpreter (one Python and JAX start-up for all of them instead of one per block)."""
import json
import pathlib
import re
import subprocess
import sys

from util import child_env

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)

# Runs each block with its own globals and stdout; reports, per block, what it printed or how it failed.
# The first block (CPU only) starts XLA:CPU, which reads the CPU-only compile flag then (util.
# cpu_only_xla_flags); the flag leaves the environment before later blocks load libtpu (the planner's).
RUNNER = r"""
import contextlib, io, json, os, sys, traceback
results = []
for i, src in enumerate(json.load(sys.stdin)):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(src, f"<README block {i}>", "exec"), {"__name__": "__main__"})
        results.append({"out": out.getvalue()})
    except BaseException:
        results.append({"out": out.getvalue(), "error": traceback.format_exc()[-3000:]})
    cpu_only = os.environ.get("JAX_CP_TEST_CPU_ONLY_XLA_FLAGS")
    if i == 0 and cpu_only:
        os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(cpu_only, "").strip()
print(json.dumps(results))
"""


def test_readme_blocks_run(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(BLOCKS), capture_output=True, text=True,
                          env=child_env(cpu_only=True), cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(BLOCKS)
    assert "plan" not in BLOCKS[0] and "topolog" not in BLOCKS[0], "block 0 must stay CPU-only (see RUNNER)"
    for i, (block, r) in enumerate(zip(BLOCKS, results)):
        assert "error" not in r, f"README block {i} failed:\n{block}\n{r['error']}"
        assert r["out"].strip(), f"README block {i} should print what it shows"


def test_readme_has_examples():
    assert len(BLOCKS) >= 3
