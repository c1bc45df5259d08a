"""Shared test helpers: inputs, fixed per-dtype tolerances, forward+VJP in one compile."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

# The suite's CPU programs are tiny, and LLVM's optimisation passes were most of their compile time
# (level 0 took the suite from 19 to 14 minutes). The level changes how XLA:CPU generates machine
# code, not what the HLO computes; benchmarks/ and `make train` keep the default. Notebooks, README
# blocks and training subprocesses get it through ``child_env``.
CHILD_XLA_FLAGS = "--xla_backend_optimization_level=0"

# XLA:CPU's loop emitters instead of its fusion emitters: the suite's CPU tests ran in 43 s instead of
# 79 s on jax 0.10.2 (test_ring + test_masks + test_sinks, 2 workers). Newer XLA has no such flag, and
# an unknown XLA_FLAGS entry aborts the process, as does this one in libtpu (which parses XLA_FLAGS
# again when a TPU test first asks for a topology): so it is probed once per run, given only to
# processes that never load libtpu, and conftest drops it from the environment once XLA:CPU has read it.
_CPU_ONLY_FLAG = "--xla_cpu_use_fusion_emitters=false"
_CPU_ONLY_ENV = "JAX_CP_TEST_CPU_ONLY_XLA_FLAGS"  # the probe's result, inherited by xdist workers


def cpu_only_xla_flags() -> str:
    """``_CPU_ONLY_FLAG`` where the installed XLA:CPU knows it, else ``""`` (probed once per run)."""
    if _CPU_ONLY_ENV not in os.environ:
        import subprocess
        import sys

        probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1)"], timeout=300,
                               env=os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": _CPU_ONLY_FLAG},
                               capture_output=True)
        os.environ[_CPU_ONLY_ENV] = _CPU_ONLY_FLAG if probe.returncode == 0 else ""
    return os.environ[_CPU_ONLY_ENV]


def child_env(cpu_only: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a subprocess or notebook kernel under test: CPU, the suite's compile flags,
    no device count (each child sets its own) and no xdist worker id. ``cpu_only=True`` (a child that
    never loads libtpu) adds ``cpu_only_xla_flags()``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    flags = " ".join([CHILD_XLA_FLAGS, cpu_only_xla_flags() if cpu_only else ""]).strip()
    return env | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags} | extra

# Fixed per dtype; never loosened to make a test pass. ``atol`` is relative to the
# largest magnitude of the expected tensor (at least 1): an element's error is
# judged against the scale of the whole tensor, as rounding in a sum is.
TOL = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=3e-2, rtol=3e-2),
    jnp.dtype(jnp.float16): dict(atol=1e-2, rtol=1e-2),
}

MESHES = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2), (4, 1, 2), (1, 2, 4), (2, 2, 1), (1, 2, 2)]


def assert_close(actual, expected, dtype, what=""):
    tol = TOL[jnp.dtype(dtype)]
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, err_msg=what, rtol=tol["rtol"], atol=tol["atol"] * scale)


def random_qkv(B, S, H, K, d, dtype=jnp.float32, seed=0, layout="BSHD"):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    qs, ks = (B, S, H, d), (B, S, K, d)
    if layout == "BNSD":
        qs, ks = (B, H, S, d), (B, K, S, d)
    q = jax.random.normal(kq, qs, jnp.float32).astype(dtype)
    k = jax.random.normal(kk, ks, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, ks, jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, qs, jnp.float32).astype(dtype)
    return q, k, v, ct


def fwd_and_vjp(f, args, ct):
    """``(f(*args), grads of <f(*args), ct> w.r.t. args)`` in one jit compile."""

    @jax.jit
    def run(args, ct):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)

    return run(args, ct)


def assert_matches(f, ref, args, ct, dtype, what=""):
    """Forward and every gradient of ``f`` equal those of ``ref``."""
    out, grads = fwd_and_vjp(f, args, ct)
    r_out, r_grads = fwd_and_vjp(ref, args, ct)
    assert bool(jnp.isfinite(jnp.asarray(out, jnp.float32)).all()), what
    assert_close(out, r_out, dtype, f"forward {what}")
    for i, (g, rg) in enumerate(zip(grads, r_grads)):
        assert_close(g, rg, dtype, f"grad {i} {what}")


def sub_jaxprs(eqn):
    """The jaxprs an equation holds (shard_map's, jit's, a custom_vjp_call's, scan's...)."""
    for v in eqn.params.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns"):
                yield inner


def has_primitive(eqn, name: str) -> bool:
    """Whether ``eqn`` is, or holds at any depth, a ``name`` primitive."""
    return eqn.primitive.name == name or any(has_primitive(e, name) for j in sub_jaxprs(eqn) for e in j.eqns)
