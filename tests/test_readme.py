"""Every ```python block of the README runs as written (each in a fresh interpreter)."""
import pathlib
import re
import subprocess
import sys

import pytest

from util import child_env

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], capture_output=True, text=True, env=child_env(),
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "a README example should print what it shows"


def test_readme_has_examples():
    assert len(BLOCKS) >= 3
