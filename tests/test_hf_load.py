"""How much of a checkpoint each process reads (``models.hf.load``), and saving from several processes.

A process reads, through safetensors' ``get_slice``, the distinct shards its devices hold, each once:
one process reads every tensor byte exactly once however parameters are replicated; two processes x
4 CPU devices (gloo over loopback, ``benchmarks/hf_load.py``) with weights stored over the CP axes
(FSDP) each read their half, and together save the checkpoint back bit for bit, each writing its files.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_cp
from conftest import needs_devices
from models import hf
from util import child_env

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs safetensors (pip install -e '.[hf]')")
ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "hf_load.py"
sys.path.insert(0, str(BENCH.parent))
import hf_load  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_tiny")
    hf_load.make_checkpoint("tiny", folder)
    return folder


@needs_devices(8)
@pytest.mark.parametrize("fsdp", [False, True], ids=["tp", "fsdp"])
def test_one_process_reads_every_byte_once(checkpoint, fsdp):
    """Replicated shards (over dp and the CP axes) are read once; the reads add up to the checkpoint."""
    mesh = jax_cp.make_mesh(cp_colossal=2, cp_ulysses=2, tp=2, axis_types=AxisType.Auto)
    reader = hf.Reader(checkpoint)
    kw = dict(fsdp=True, fsdp_axes=("dp", "cp_colossal", "cp_ulysses")) if fsdp else {}
    hf.load(checkpoint, mesh, reader=reader, dtype=jnp.float32, **kw)
    total = sum(int(np.prod(s)) * 2 for s in hf.tensor_shapes(hf.read_config(checkpoint)).values())  # bfloat16
    assert reader.bytes_read == total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_read_their_share_and_save_together(checkpoint, tmp_path):
    """Each of 2 processes reads at most its devices' share (+ 1 KiB), half the checkpoint here; their save
    (3 files: each process writes its own) holds the original tensors bit for bit."""
    port, out = _free_port(), tmp_path / "saved"
    cmd = [sys.executable, str(BENCH), "--checkpoint", str(checkpoint), "--devices", "4", "--fsdp",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--json", str(tmp_path / "figures"),
           "--save", str(out), "--save-shard-bytes", "14000"]
    env = child_env(cpu_only=True)
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log[-3000:]
    for i in (0, 1):
        f = json.loads((tmp_path / f"figures.{i}").read_text())
        assert f["processes"] == 2 and f["bytes_read"] <= f["share_bytes"] + 1024, f
        assert f["share_bytes"] <= f["checkpoint_bytes"] // 2 + 1024, f
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3
    original = safetensors_numpy.load_file(checkpoint / "model.safetensors")
    assert sorted(index) == sorted(original)
    for name, value in original.items():
        saved = safetensors_numpy.load_file(out / index[name])[name]
        np.testing.assert_array_equal(saved, value, err_msg=name)
