"""benchmarks/linear_speed.py's token orders for ``--tpu``, on the host: packed rows are valid documents
(ids rising, positions restarting at 0, lengths in range), and every order hands the layer a permutation
of a row's (segment id, position) pairs whose slots ``linear.needed_pieces`` counts."""
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

import jax_cp
from conftest import needs_devices
from jax_cp import linear

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "linear_speed.py"
_SPEC = importlib.util.spec_from_file_location("linear_speed", _PATH)
ls = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ls)


def test_packed_rows_are_documents():
    pos, seg = ls.packed_rows(3, 8192, seed=1, shortest=256, longest=2048)
    assert pos.shape == seg.shape == (3, 8192) and pos.dtype == seg.dtype == np.int32
    for p, s in zip(pos, seg):
        assert s[0] == 0 and np.all(np.diff(s) >= 0) and np.all(np.diff(s) <= 1)
        new = np.concatenate([[True], s[1:] != s[:-1]])
        assert np.all(p[new] == 0) and np.all(p[~new] == p[np.flatnonzero(~new) - 1] + 1)
        lengths = np.bincount(s)
        assert np.all((lengths[:-1] >= 256) & (lengths[:-1] <= 2048)) and 1 <= lengths[-1] <= 2048
    again = ls.packed_rows(3, 8192, seed=1, shortest=256, longest=2048)
    assert all(np.array_equal(a, b) for a, b in zip((pos, seg), again))  # seeded


@needs_devices(8)
@pytest.mark.parametrize("order", ls.ORDERS)
def test_orders_permute_the_rows(order):
    mesh = jax_cp.make_mesh(cp_colossal=4, dp=2, devices=jax.devices()[:8])
    B, S = 2, 4096
    pos, seg = ls.order_metadata(order, mesh, B, S, seed=3)
    assert pos.shape == seg.shape == (B, S) and pos.dtype == seg.dtype == np.int32
    natural = ls.packed_rows(B, S, seed=3) if order == "dispatch" else (np.arange(S)[None].repeat(B, 0),
                                                                          np.zeros((B, S), int))
    for b in range(B):  # the same tokens, in another order
        got = sorted(zip(seg[b].tolist(), pos[b].tolist()))
        assert got == sorted(zip(natural[1][b].tolist(), natural[0][b].tolist()))
    need = linear.needed_pieces(pos, seg, 4)
    assert need == {"natural": 1, "dual-chunk": 2}.get(order, need) and 1 <= need <= 2 * 8 * 4 + 1


def test_kv_bytes():
    assert ls.kv_gather_bytes(4, 4, 131072, 8, 128, 128) == 536_870_912  # the 537 MB
