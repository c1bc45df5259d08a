"""Test configuration: 8 simulated CPU devices, set once before JAX initialises."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from util import CHILD_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
                                    CHILD_XLA_FLAGS]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

N_DEVICES = 8


def needs_devices(n: int):
    """Skip (with the reason) where fewer than ``n`` devices exist."""
    return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == N_DEVICES, jax.devices()
