"""Test configuration: 8 simulated CPU devices, set once before JAX initialises."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from util import CHILD_XLA_FLAGS, cpu_only_xla_flags  # noqa: E402

_FLAGS = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", CHILD_XLA_FLAGS])
os.environ["XLA_FLAGS"] = " ".join([_FLAGS, cpu_only_xla_flags()]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.jit(lambda x: x + 1)(1)  # XLA:CPU reads XLA_FLAGS once, at its first compile: here
os.environ["XLA_FLAGS"] = _FLAGS.strip()  # what libtpu reads later (TPU tests): no CPU-only flag

import pytest  # noqa: E402

N_DEVICES = 8


def needs_devices(n: int):
    """Skip (with the reason) where fewer than ``n`` devices exist."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    if jax.default_backend() == "cpu":  # on an accelerator (benchmarks/gpu/check.sh) only -m gpu runs
        assert jax.device_count() == N_DEVICES, jax.devices()


# Files whose tests take tens of seconds each (notebooks, training subprocesses, TPU compiles):
# collected first, so that xdist's workers start them early and the run does not end on one of them.
_HEAVY_FIRST = ("test_notebooks.py", "test_defaults.py", "test_train.py", "test_plan.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within
