#!/usr/bin/env python
"""Side-by-side benchmark: jax_cp strategies against the JAX context-parallel peers.

One process, one run, the same inputs and the same devices for everyone:
every available peer and every jax_cp strategy, forward (``fwd``) and
forward+backward (``fwd+bwd``), causal and not, for each sequence length and
dtype asked for. Repetitions are interleaved round-robin (the order rotates
each repetition), so load from other processes spreads over all of them.
Compilation is done ahead of time (``jit(...).lower(...).compile()``) and is
not timed.

Each result is checked against an independent float32 reference before its
time counts: a wrong result is reported as WRONG (with its error), never as
fast. The reference is exact dense attention (written here, not taken from
jax_cp or a peer) for a fixed random subset of R query rows spread over the
whole sequence (rows 0 and S-1 included), so it stays cheap at 32K. The
cotangent ``do`` of the backward pass is non-zero only on those rows, which
makes the reference dK and dV (all key rows) and dQ (zero off those rows)
exact too. Inputs are drawn in bfloat16 and used as is (bfloat16) or widened
exactly (float32), so one reference serves both dtypes.

Peers (``pip install -e '.[bench]'``; missing ones are listed as skipped):

* ``ringattention`` - ``ringattention_jax`` (plain-JAX blockwise ring) in ``jax.shard_map``;
  a small shim provides ``jax.lib.xla_bridge``, which jax >= 0.8 removed.
* ``tokamax xla_chunked`` - ``tokamax.dot_product_attention(implementation="xla_chunked",
  q_sharding=...)``: queries stay sharded, K/V are all-gathered.
* ``tokamax ring splash`` - the ring splash-attention kernel
  (``make_ring_attention``), Pallas in interpret mode on CPU.
* ``ejkernel ring`` - ejkernel's XLA ring attention kernel in ``jax.shard_map``
  (installs with its light dependencies: beartype, chex, pydantic, ...).
* MaxText - not installable on Python 3.11 (needs >= 3.12); always skipped here.

Usage::

    python benchmarks/compare_peers.py                       # everything: S 8192 32768, f32 bf16
    python benchmarks/compare_peers.py --seq 8192 --dtype float32 --quick
    python benchmarks/compare_peers.py --only jax_cp --seq 1024 --reps 2
    python benchmarks/compare_peers.py --markdown out.md --json out.json

Times are medians of the repetitions, in seconds; ``ratio`` is the time over
the fastest *correct peer* of the same row (< 1 means faster than every peer).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from typing import Callable

import numpy as np

# --------------------------------------------------------------------------- setup


def setup_jax(num_devices: int = 8):
    """CPU platform with ``num_devices`` simulated devices (when JAX is not initialised yet)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except Exception:  # backend already initialised (e.g. under pytest's conftest)
        pass
    if jax.device_count() < num_devices:
        raise SystemExit(f"need {num_devices} devices, have {jax.device_count()}: set up JAX before importing")
    return jax


def shim_xla_bridge():
    """``ringattention`` 0.1.2 calls ``jax.lib.xla_bridge.get_backend()``, which jax >= 0.8 removed."""
    import jax

    try:
        jax.lib.xla_bridge  # noqa: B018
    except AttributeError:
        from jax.extend import backend

        mod = types.ModuleType("jax.lib.xla_bridge")
        mod.get_backend = backend.get_backend
        jax.lib.xla_bridge = mod
        sys.modules["jax.lib.xla_bridge"] = mod


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- cases and implementations


@dataclasses.dataclass(frozen=True)
class Case:
    seq: int
    dtype: str  # "float32" | "bfloat16"
    causal: bool
    mode: str  # "fwd" | "fwd+bwd"
    batch: int = 1
    heads: int = 8
    head_dim: int = 64

    @property
    def label(self) -> str:
        return f"S={self.seq} {self.dtype} {'causal' if self.causal else 'full'} {self.mode}"


class NotApplicable(Exception):
    """The implementation does not serve this case (reported as n/a, not as a failure)."""


@dataclasses.dataclass
class Impl:
    """``build(case)`` returns ``(attn, sharding)`` or ``(attn, sharding, order)``: ``attn(q, k, v) -> o``
    on global BSHD arrays (jit-able), the input sharding it is fed with, and optionally the token
    order it expects (``order[j]`` = natural index of sequence slot ``j``; inputs are permuted into it
    and outputs back before checking, both outside the timed call, as a data pipeline would)."""

    name: str
    group: str  # "jax_cp" | "peer"
    build: Callable
    note: str = ""


def _seq_sharding(mesh, axes):
    from jax.sharding import NamedSharding, PartitionSpec as P

    return NamedSharding(mesh, P(None, axes, None, None))


def jax_cp_impls(kernels=("auto",), xla_max_seq: int = 8192) -> list[Impl]:
    import jax.numpy as jnp
    import jax_cp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from jax_cp import load_balance

    strategies = [
        ("ulysses (1,8,1)", dict(cp_ulysses=8), "all_gather"),
        ("all-gather (8,1,1)", dict(cp_colossal=8), "all_gather"),
        ("hybrid (2,4,1)", dict(cp_colossal=2, cp_ulysses=4), "all_gather"),
        ("hybrid (4,2,1)", dict(cp_colossal=4, cp_ulysses=2), "all_gather"),
        ("ring (8,1,1)", dict(cp_colossal=8), "ring"),
    ]
    out = []
    for kernel in kernels:
        for balanced in (False, True):
            for label, axes, exchange in strategies:
                if balanced and axes.get("cp_colossal", 1) == 1:
                    continue  # Ulysses needs no balancing

                def build(case, axes=axes, exchange=exchange, kernel=kernel, balanced=balanced):
                    if kernel == "xla" and case.seq > xla_max_seq:
                        raise NotApplicable(f"dense kernel memory is quadratic; skipped above S={xla_max_seq}")
                    if balanced and not case.causal:
                        raise NotApplicable("load balancing is for causal masks")
                    mesh = jax_cp.make_mesh(**axes, axis_types=AxisType.Explicit)
                    order = np.asarray(load_balance.positions(case.seq, mesh)) if balanced else None
                    positions = None if order is None else jnp.asarray(order, jnp.int32)

                    def attn(q, k, v):
                        return jax_cp.dot_product_attention(q, k, v, mesh=mesh, is_causal=case.causal, kernel=kernel,
                                                            kv_exchange=exchange, positions=positions)
                    # jax_cp's own layout (dp and tp have size 1): the output and the cotangent share it.
                    return attn, NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses"), "tp", None)), order
                suffix = (" +lb" if balanced else "") + ("" if kernel == "auto" else f" [{kernel}]")
                out.append(Impl(f"jax_cp {label}{suffix}", "jax_cp", build,
                                "+lb: inputs in load_balance order (dual chunks), positions passed"))
    return out


def _peer_mesh():
    import jax
    import jax_cp
    from jax.sharding import AxisType

    # The same devices in the same order as the jax_cp meshes; the sequence on one axis of 8.
    return jax_cp.make_mesh(cp_colossal=jax.device_count(), axis_types=AxisType.Auto)


def peer_impls() -> tuple[list[Impl], list[tuple[str, str]]]:
    """The installed peers, and ``(name, reason)`` for the skipped ones."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    impls, skipped = [], []
    axis = "cp_colossal"
    spec = P(None, axis, None, None)

    # ringattention ----------------------------------------------------------------
    try:
        if importlib.util.find_spec("ringattention") is None:
            raise ModuleNotFoundError("No module named 'ringattention'")
        shim_xla_bridge()
        import ringattention

        def build_ringattention(case):
            mesh = _peer_mesh()
            kw = dict(causal_block_size=1 if case.causal else None, query_chunk_size=512, key_chunk_size=512,
                      deterministic=True, dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32,
                      policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)
            kw["query_chunk_size"] = kw["key_chunk_size"] = min(512, case.seq // mesh.shape[axis])

            def local(q, k, v):
                return ringattention.ringattention_jax(q, k, v, None, None, None, axis, True, kw)

            attn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
            return attn, _seq_sharding(mesh, axis)

        impls.append(Impl("ringattention", "peer", build_ringattention,
                          f"ringattention {version('ringattention')}: ringattention_jax in shard_map"))
    except Exception as e:  # noqa: BLE001
        skipped.append(("ringattention", f"not importable ({type(e).__name__}: {e})"))

    # tokamax -----------------------------------------------------------------------
    try:
        import tokamax
        from absl import flags

        if not flags.FLAGS.is_parsed():  # tokamax's config parses sys.argv (ours) lazily otherwise
            flags.FLAGS(sys.argv[:1])

        def build_tokamax_chunked(case):
            mesh = _peer_mesh()
            sharding = _seq_sharding(mesh, axis)

            def attn(q, k, v):
                return tokamax.dot_product_attention(q, k, v, is_causal=case.causal, implementation="xla_chunked",
                                                     q_sharding=sharding)
            return attn, sharding

        impls.append(Impl("tokamax xla_chunked", "peer", build_tokamax_chunked,
                          f"tokamax {version('tokamax')}: dot_product_attention(implementation='xla_chunked', "
                          "q_sharding=seq-sharded)"))
    except Exception as e:  # noqa: BLE001
        skipped.append(("tokamax xla_chunked", f"not importable ({type(e).__name__}: {e})"))

    try:
        import dataclasses as dc

        from tokamax._src.ops.experimental.tpu.splash_attention import ring_attention_kernel as rak
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as sk
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

        def build_tokamax_ring(case):
            mesh = _peer_mesh()
            n = mesh.shape[axis]
            S = case.seq
            mask = mask_lib.make_causal_mask((S, S)) if case.causal else mask_lib.FullMask(_shape=(S, S))
            block = min(512, S // n)
            config = dc.replace(sk.SplashConfig.get_default(), block_q=block, block_kv=block, block_kv_compute=block,
                                block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                use_base2_exp=False, fuse_reciprocal=True, interpret=True)
            kernel = rak.make_ring_attention(mask, is_mqa=False, ring_axis=axis, config=config,
                                             save_residuals=False, q_seq_shards=n, kv_seq_shards=n)
            kspec = kernel.manual_sharding_spec()
            hspec = P(None, axis, None)  # [heads, seq, d]
            scale = case.head_dim**-0.5

            def local(kern, q, k, v):
                return kern(q, k, v, None)

            ring = jax.shard_map(local, mesh=mesh, in_specs=(kspec, hspec, hspec, hspec), out_specs=hspec,
                                 check_vma=False)

            def attn(q, k, v):  # BSHd -> per batch row [H, S, d]; splash does not scale the logits
                q = q * jnp.asarray(scale, q.dtype)
                outs = [ring(kernel, *(jnp.swapaxes(a[b], 0, 1) for a in (q, k, v))) for b in range(q.shape[0])]
                return jnp.stack([jnp.swapaxes(o, 0, 1) for o in outs])
            return attn, _seq_sharding(mesh, axis)

        impls.append(Impl("tokamax ring splash", "peer", build_tokamax_ring,
                          f"tokamax {version('tokamax')}: make_ring_attention (splash, Pallas interpret=True)"))
    except Exception as e:  # noqa: BLE001
        skipped.append(("tokamax ring splash", f"not importable ({type(e).__name__}: {e})"))

    # ejkernel ----------------------------------------------------------------------
    try:
        from ejkernel.kernels._xla.ring_attention import ring_attention as ej_ring

        def build_ejkernel(case):
            mesh = _peer_mesh()
            chunk = min(512, case.seq // mesh.shape[axis])

            def local(q, k, v):
                return ej_ring(q, k, v, causal=case.causal, axis_name=axis, chunk_size=chunk)

            attn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
            return attn, _seq_sharding(mesh, axis)

        impls.append(Impl("ejkernel ring", "peer", build_ejkernel,
                          f"ejkernel {version('ejkernel')}: XLA ring_attention kernel in shard_map"))
    except Exception as e:  # noqa: BLE001
        skipped.append(("ejkernel ring", f"not importable ({type(e).__name__}: {e})"))

    skipped.append(("MaxText", "needs Python >= 3.12 and a forced install; not part of the bench extra"))
    return impls, skipped


# --------------------------------------------------------------------------- inputs and reference


@dataclasses.dataclass
class Inputs:
    q: np.ndarray  # float32 values exactly representable in bfloat16, [B, S, H, d]
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray  # non-zero only on ``rows``
    rows: np.ndarray  # [R] sorted query rows the reference covers


def make_inputs(case: Case, ref_rows: int, seed: int = 0) -> Inputs:
    import ml_dtypes

    rng = np.random.default_rng(seed + case.seq)
    shape = (case.batch, case.seq, case.heads, case.head_dim)
    bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    q, k, v = (bf(rng.standard_normal(shape, np.float32)) for _ in range(3))
    R = min(ref_rows, case.seq)
    rows = np.unique(np.concatenate([[0, case.seq - 1], rng.choice(case.seq, R - 2, replace=False)]))
    do = np.zeros(shape, np.float32)
    do[:, rows] = bf(rng.standard_normal((case.batch, len(rows), case.heads, case.head_dim), np.float32))
    return Inputs(q, k, v, do, rows)


def reference(inp: Inputs, causal: bool):
    """Exact float32 attention for the rows ``inp.rows``: ``o`` there, and the full dQ, dK, dV
    of ``sum(o * do)`` (``do`` vanishes elsewhere). Independent of jax_cp and the peers."""
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST
    rows = jnp.asarray(inp.rows)
    S, d = inp.q.shape[1], inp.q.shape[3]

    def f(q_rows, k, v):
        s = jnp.einsum("brhd,bshd->bhrs", q_rows, k, precision=hi) * d**-0.5
        if causal:
            s = jnp.where(rows[:, None] >= jnp.arange(S)[None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhrs,bshd->brhd", p, v, precision=hi)

    @jax.jit
    def run(q, k, v, do):
        o_rows, vjp = jax.vjp(f, q[:, rows], k, v)
        dq_rows, dk, dv = vjp(do[:, rows])
        return o_rows, jnp.zeros_like(q).at[:, rows].set(dq_rows), dk, dv

    dev = jax.devices()[0]
    out = run(*(jax.device_put(a, dev) for a in (inp.q, inp.k, inp.v, inp.do)))
    return tuple(np.asarray(a) for a in out)


def rel_error(x, ref) -> float:
    """``max |x - ref| / max |ref|`` in float64 (inf for non-finite values)."""
    x = np.asarray(x, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    scale = float(np.max(np.abs(ref))) or 1.0
    return float(np.max(np.abs(x - ref))) / scale


TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}


# --------------------------------------------------------------------------- the harness


@dataclasses.dataclass
class Result:
    impl: str
    group: str
    case: Case
    status: str = "ok"  # ok | WRONG | FAILED | n/a
    times: list = dataclasses.field(default_factory=list)
    compile_s: float | None = None
    error: float | None = None  # max relative error over o, dq, dk, dv
    errors: dict = dataclasses.field(default_factory=dict)
    message: str = ""
    ratio: float | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


def _prepare(impl: Impl, case: Case, inp: Inputs):
    """Builds, places the inputs and compiles; returns ``(compiled, args, order, compile_seconds)``."""
    import jax
    import jax.numpy as jnp

    attn, sharding, *rest = impl.build(case)
    order = rest[0] if rest else None
    dtype = jnp.dtype(case.dtype)
    put = lambda a: jax.device_put((a if order is None else a[:, order]).astype(dtype), sharding)  # noqa: E731
    args = [put(a) for a in (inp.q, inp.k, inp.v)]
    if case.mode == "fwd":
        fn = jax.jit(attn)
    else:
        args.append(put(inp.do))

        def fn(q, k, v, do):
            o, vjp = jax.vjp(attn, q, k, v)
            return (o, *vjp(do))
        fn = jax.jit(fn)
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, args, order, time.perf_counter() - t0


def _natural(x, order):
    x = np.asarray(x, np.float32)
    if order is None:
        return x
    y = np.empty_like(x)
    y[:, order] = x
    return y


def _check(res: Result, out, ref, rows, order=None):
    o_ref, dq_ref, dk_ref, dv_ref = ref
    outs = [_natural(x, order) for x in (out if isinstance(out, (tuple, list)) else (out,))]
    res.errors["o"] = rel_error(np.asarray(outs[0], np.float32)[:, rows], o_ref)
    if len(outs) == 4:
        for name, x, r in zip(("dq", "dk", "dv"), outs[1:], (dq_ref, dk_ref, dv_ref)):
            res.errors[name] = rel_error(np.asarray(x, np.float32), r)
    res.error = max(res.errors.values())
    if not res.error <= TOLERANCE[res.case.dtype]:
        res.status = "WRONG"
        res.message = "max rel err " + ", ".join(f"{k} {v:.2g}" for k, v in res.errors.items())


def _timed_call(compiled, args):
    import jax

    t0 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def run_row(impls: list[Impl], case: Case, inp: Inputs, ref, reps: int, warmup: int, log=print,
            pruned: dict | None = None, drop_after_first: float | None = None) -> list[Result]:
    """One row: every implementation on ``case``, repetitions interleaved round-robin.

    ``pruned`` maps implementation names to the reason they are not run for this case; with
    ``drop_after_first``, implementations slower than that factor times the fastest correct one in
    the first repetition are not repeated."""
    results, live = [], []
    for impl in impls:
        res = Result(impl.name, impl.group, case)
        results.append(res)
        if pruned and impl.name in pruned:
            res.status, res.message = "pruned", pruned[impl.name]
            continue
        try:
            compiled, args, order, res.compile_s = _prepare(impl, case, inp)
        except NotApplicable as e:
            res.status, res.message = "n/a", str(e)
            continue
        except Exception as e:  # noqa: BLE001
            res.status, res.message = "FAILED", "build/compile: " + _short(e)
            log(f"    {impl.name}: {res.message}")
            if os.environ.get("COMPARE_PEERS_DEBUG"):
                traceback.print_exc()
            continue
        live.append([res, compiled, args, True, order])  # the flag: correctness not checked yet

    def call(entry, timed: bool):
        res, compiled, args, unchecked, order = entry
        try:
            dt, out = _timed_call(compiled, args)
        except Exception as e:  # noqa: BLE001
            res.status, res.message = "FAILED", "run: " + _short(e)
            log(f"    {res.impl}: {res.message}")
            return
        if unchecked:
            _check(res, out, ref, inp.rows, order)
            entry[3] = False
        del out
        if timed:
            res.times.append(dt)

    for w in range(warmup):
        for entry in live:
            if entry[0].status == "ok":
                call(entry, timed=False)
    for r in range(reps):
        shift = (r * len(live)) // max(reps, 1)  # each repetition starts elsewhere in the order
        if r == 1 and drop_after_first:
            # Clear losers of the first repetition are not repeated: their one time stands.
            firsts = [e[0].times[0] for e in live if e[0].status == "ok" and e[0].times]
            for e in live:
                if firsts and e[0].status == "ok" and e[0].times and e[0].times[0] > drop_after_first * min(firsts):
                    e[0].message = "1 repetition (> {:g}x the fastest in the first)".format(drop_after_first)
        for entry in live[shift:] + live[:shift]:
            res = entry[0]
            if res.message.startswith("1 repetition"):
                continue
            if res.status == "ok" or (res.status == "WRONG" and not res.times):
                call(entry, timed=True)  # a wrong result is timed once (shown, never ranked), then dropped
    live.clear()
    gc.collect()

    peers_ok = [r.median for r in results if r.group == "peer" and r.status == "ok" and r.times]
    best = min(peers_ok) if peers_ok else None
    for r in results:
        if best and r.times:
            r.ratio = r.median / best
    return results


# --------------------------------------------------------------------------- reporting


def _fmt_time(r: Result) -> str:
    return f"{r.median:.3f}" if r.median is not None else "-"


def _fmt_cell(r: Result) -> str:
    if r.status in ("n/a", "pruned"):
        return r.status
    if r.status == "FAILED":
        return "FAILED"
    if r.status == "WRONG":
        return f"WRONG ({r.error:.2g})"
    ratio = f" ({r.ratio:.2f})" if r.ratio is not None else ""
    once = "¹" if r.message.startswith("1 repetition") else ""
    return f"{r.median:.2f}{once}{ratio}"


def print_row(results: list[Result], log=print):
    case = results[0].case
    log(f"\n{case.label}")
    log(f"  {'implementation':<28} {'median s':>9} {'ratio':>7} {'rel err':>9} {'compile s':>9}  status")
    for r in results:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None and r.status == "ok" else "-"
        err = f"{r.error:.1e}" if r.error is not None else "-"
        comp = f"{r.compile_s:.1f}" if r.compile_s is not None else "-"
        status = r.status + (f": {r.message}" if r.message else "")
        log(f"  {r.impl:<28} {_fmt_time(r):>9} {ratio:>7} {err:>9} {comp:>9}  {status}")


def summary(rows: list[list[Result]]) -> list[dict]:
    out = []
    for results in rows:
        case = results[0].case
        ok = lambda g: [r for r in results if r.group == g and r.status == "ok" and r.times]  # noqa: E731
        peer = min(ok("peer"), key=lambda r: r.median, default=None)
        mine = min(ok("jax_cp"), key=lambda r: r.median, default=None)
        out.append(dict(
            case=case.label, best_peer=peer and peer.impl, best_peer_s=peer and peer.median,
            best_jax_cp=mine and mine.impl, best_jax_cp_s=mine and mine.median,
            ratio=(mine.median / peer.median) if (mine and peer) else None,
            wrong=[r.impl for r in results if r.status == "WRONG"],
            failed=[r.impl for r in results if r.status == "FAILED"],
        ))
    return out


def markdown(rows: list[list[Result]], header: dict) -> str:
    lines = [f"Command: `{header['command']}`  ", f"Date: {header['date']}  ",
             f"Machine: {header['machine']}  ", f"Load average (1, 5, 15 min) at start / end: "
             f"{header['load_start']} / {header.get('load_end')}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v) + "  ",
             f"Repetitions: {header['reps']}; reference rows per case: {header['ref_rows']}  ", ""]
    if header.get("skipped"):
        lines += ["Skipped peers: " + "; ".join(f"{n} ({why})" for n, why in header["skipped"]), ""]
    lines += ["Summary (ratio = fastest correct jax_cp strategy / fastest correct peer; <= 1.00 meets the target):",
              "", "| case | fastest correct peer | s | fastest jax_cp | s | ratio | wrong |",
              "|---|---|---:|---|---:|---:|---|"]
    for s in summary(rows):
        fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else "-"  # noqa: E731
        lines.append(f"| {s['case']} | {s['best_peer'] or '-'} | {fmt(s['best_peer_s'])} | {s['best_jax_cp'] or '-'} | "
                     f"{fmt(s['best_jax_cp_s'])} | {'-' if s['ratio'] is None else format(s['ratio'], '.2f')} | "
                     f"{', '.join(s['wrong']) or '-'} |")
    names = []
    for results in rows:
        for r in results:
            if r.impl not in names:
                names.append(r.impl)
    lines += ["", "All results: median seconds (ratio to the fastest correct peer); WRONG (max relative error); "
              "¹ one repetition only (more than --drop-after-first times the fastest in the first).", "",
              "| implementation | " + " | ".join(_short_label(r[0].case) for r in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    cells = [{r.impl: _fmt_cell(r) for r in results} for results in rows]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(c.get(n, "-") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _short_label(case: Case) -> str:
    seq = f"{case.seq // 1024}K" if case.seq % 1024 == 0 else str(case.seq)
    dtype = {"float32": "f32", "bfloat16": "bf16"}[case.dtype]
    return f"{seq} {dtype} {'causal' if case.causal else 'full'} {case.mode}"


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768], help="sequence lengths (default 8192 32768)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--causal", nargs="+", default=["causal", "full"], choices=["causal", "full"])
    p.add_argument("--mode", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per implementation and case (default 3)")
    p.add_argument("--reps-long", type=int, default=None, help="repetitions for S > 8192 (default: --reps)")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed calls before the timed ones (compilation is ahead of time; default 0)")
    p.add_argument("--long-causal", nargs="+", default=None, choices=["causal", "full"],
                   help="--causal for S > 8192 (default: --causal)")
    p.add_argument("--long-dtype", nargs="+", default=None, choices=["float32", "bfloat16"],
                   help="--dtype for S > 8192 (default: --dtype)")
    p.add_argument("--long-mode", nargs="+", default=None, choices=["fwd", "fwd+bwd"],
                   help="--mode for S > 8192 (default: --mode)")
    p.add_argument("--prune", type=float, default=None,
                   help="at each S after the first, leave out implementations that were WRONG/FAILED or slower "
                        "than PRUNE x the fastest correct peer on the same case at the previous S (default: off)")
    p.add_argument("--drop-after-first", type=float, default=None,
                   help="do not repeat implementations slower than this factor x the fastest correct one "
                        "in the first repetition of a case (their single time is reported; default: off)")
    p.add_argument("--quick", action="store_true", help="one repetition, fwd only unless --mode is given")
    p.add_argument("--only", nargs="+", default=None,
                   help="substrings of implementation names to keep (e.g. jax_cp ringattention)")
    p.add_argument("--kernels", nargs="+", default=["auto"], help="jax_cp kernels to include (auto blockwise xla)")
    p.add_argument("--xla-max-seq", type=int, default=8192, help="largest S for the dense jax_cp 'xla' kernel")
    p.add_argument("--ref-rows", type=int, default=256, help="query rows covered by the reference (default 256)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--markdown", default=None, help="write the tables as markdown to this file")
    p.add_argument("--json", default=None, help="write all results as JSON to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 1
        if argv is None and "--mode" not in sys.argv or argv is not None and "--mode" not in argv:
            args.mode = ["fwd"]
    return args


def collect_impls(args, extra: list[Impl] = ()) -> tuple[list[Impl], list[tuple[str, str]]]:
    impls = jax_cp_impls(tuple(args.kernels), args.xla_max_seq)
    peers, skipped = peer_impls()
    impls = impls + peers + list(extra)
    if args.only:
        impls = [i for i in impls if any(s in i.name for s in args.only)]
    return impls, skipped


def main(argv=None, extra_impls: list[Impl] = (), log=print) -> list[list[Result]]:
    args = parse_args(argv)
    jax = setup_jax(args.devices)
    impls, skipped = collect_impls(args, extra_impls)
    versions = {d: version(d) for d in ("jax", "jaxlib", "jax_cp", "flax", "ringattention", "tokamax", "ejkernel")}
    header = dict(
        command="python " + " ".join(["benchmarks/compare_peers.py", *(sys.argv[1:] if argv is None else argv)]),
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores, {jax.device_count()} simulated "
                f"{jax.default_backend()} devices, Python {platform.python_version()}",
        load_start=load_average(), versions=versions, reps=args.reps, ref_rows=args.ref_rows,
        skipped=skipped,
    )
    if args.reps_long is not None:
        header["reps"] = f"{args.reps} (S <= 8192), {args.reps_long} (S > 8192)"
    log(f"# {header['date']} | {header['machine']} | load {header['load_start']}")
    log("# " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    log("# implementations: " + ", ".join(i.name for i in impls))
    for name, why in skipped:
        log(f"# skipped: {name}: {why}")

    rows = []
    previous = {}  # (dtype, causal, mode) -> results at the previous S, for --prune
    for seq in args.seq:
        long = seq > 8192
        reps = args.reps if (args.reps_long is None or not long) else args.reps_long
        causals = (args.long_causal or args.causal) if long else args.causal
        for causal in (c == "causal" for c in causals):
            inp = None
            ref = None
            for dtype in (args.long_dtype or args.dtype) if long else args.dtype:
                for mode in (args.long_mode or args.mode) if long else args.mode:
                    case = Case(seq, dtype, causal, mode, args.batch, args.heads, args.head_dim)
                    pruned = {}
                    for r in previous.get((dtype, causal, mode), []) if args.prune else []:
                        at = f"at S={r.case.seq}"
                        if r.status == "pruned":
                            pruned[r.impl] = r.message
                        elif r.status in ("WRONG", "FAILED"):
                            pruned[r.impl] = f"{r.status} {at}"
                        elif r.ratio is not None and r.ratio > args.prune:
                            pruned[r.impl] = f"{r.ratio:.1f}x the fastest correct peer {at}"
                    if inp is None:
                        t0 = time.perf_counter()
                        inp = make_inputs(case, args.ref_rows)
                        ref = reference(inp, causal)
                        log(f"# reference S={seq} causal={causal}: {time.perf_counter() - t0:.1f}s")
                    results = run_row(impls, case, inp, ref, reps, args.warmup, log=log, pruned=pruned,
                                      drop_after_first=args.drop_after_first)
                    print_row(results, log=log)
                    rows.append(results)
                    previous[(dtype, causal, mode)] = results
            del inp, ref
            gc.collect()

    header["load_end"] = load_average()
    log("\nSummary (ratio = fastest correct jax_cp / fastest correct peer):")
    if not any(i.group == "peer" for i in impls):
        log(f"  no peer ran, so no ratios (not installed: {', '.join(name for name, _ in skipped) or '-'}; "
            "pip install -e '.[bench]', best in a separate virtual environment)")
    for s in summary(rows):
        ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
        peer = f"{s['best_peer']} {s['best_peer_s']:.3f}s" if s["best_peer"] else "- (no correct peer)"
        log(f"  {s['case']:<34} peer {peer} | jax_cp {s['best_jax_cp']} "
            f"{s['best_jax_cp_s'] or 0:.3f}s | ratio {ratio} | wrong: {', '.join(s['wrong']) or '-'}")
    log(f"# load at end: {header['load_end']}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, summary=summary(rows),
                           results=[dict(dataclasses.asdict(r), case=r.case.label, median=r.median)
                                    for row in rows for r in row]), f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
