"""Every ```python block of every guide in docs/ runs as written: one fresh interpreter per page (8
simulated CPU devices, set by the blocks themselves), each block in a fresh namespace, in order; and
the documents stay the size the project keeps them at, with links that resolve."""
import json
import pathlib
import re
import subprocess
import sys

import pytest

from util import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)

# A page whose blocks compile for a TPU topology (the planner) loads libtpu, which refuses the suite's
# CPU-only XLA flag (util.cpu_only_xla_flags): such a page runs without it.
TPU_MARKERS = ("plan.", "--plan", "topolog")

RUNNER = r"""
import contextlib, io, json, sys, traceback
name, blocks = json.load(sys.stdin)
results = []
for i, src in enumerate(blocks):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(src, f"<{name} block {i}>", "exec"), {"__name__": "__main__"})
        results.append({"out": out.getvalue()})
    except BaseException:
        results.append({"out": out.getvalue(), "error": traceback.format_exc()[-3000:]})
print(json.dumps(results))
"""


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_guide_blocks_run(page, tmp_path):
    blocks = BLOCK.findall(page.read_text())
    for block in blocks:  # a block that starts JAX on one device would leave the page's later blocks one
        assert "import jax\n" not in block or "jax_num_cpu_devices" in block, f"{page.name}: set the device count\n{block}"
    cpu_only = not any(marker in block for block in blocks for marker in TPU_MARKERS)
    name = str(page.relative_to(ROOT))
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([name, blocks]), capture_output=True,
                          text=True, env=child_env(cpu_only=cpu_only), cwd=tmp_path,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(blocks)
    for i, (block, r) in enumerate(zip(blocks, results)):
        assert "error" not in r, f"{name} block {i} failed:\n{block}\n{r['error']}"
        assert r["out"].strip(), f"{name} block {i} should print what it shows"


def test_every_guide_has_an_example():
    guides = sorted((DOCS / "guides").glob("*.md"))
    assert guides and set(guides) <= set(PAGES) | {DOCS / "guides" / "ci.md", DOCS / "guides" / "architecture.md"}


@pytest.mark.parametrize("path, limit", [("README.md", 250), ("benchmarks/RESULTS.md", 460)])
def test_document_length(path, limit):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines; keep it at most {limit} (details go to docs/)"


def _slug(heading: str) -> str:
    """The anchor a code host and mkdocs' toc give a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("path", ["README.md", "benchmarks/RESULTS.md"])
def test_relative_links_resolve(path):
    """docs/ is checked by `mkdocs build --strict` (make docs); these two live outside it."""
    source = ROOT / path
    for target, anchor in re.findall(r"\]\((?!https?:|#)([^)#\s]+)(?:#([^)\s]+))?\)", source.read_text()):
        resolved = (source.parent / target).resolve()
        assert resolved.exists(), f"{path} links {target}, which does not exist"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path} links {target}#{anchor}: no such heading"


NARRATION = re.compile(r"\b(issue|stop) #?\d+\b|\b(\d+(st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|"
                       r"eighth|ninth|tenth|eleventh|twelfth|previous|last|this) session\b", flags=re.I)


def test_no_file_narrates_how_the_project_was_built():
    """The project speaks of itself: no tracked file refers to issue numbers or work sessions (the
    repository's history is git's)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path.suffix not in (".md", ".py", ".ipynb", ".yml", ".toml", ".sh", ".txt", "") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if NARRATION.search(line) and name != "tests/test_docs.py":
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, hits
