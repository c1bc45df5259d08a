"""Overlap of CP collectives with compute, from the real TPU compiler's schedule (no TPU needed).

For each topology and layout, compiles forward+backward of one Llama-3-8B-sized
attention layer (D=4096, 32 heads, 8 kv heads, head dim 128, bf16, causal) three ways:

* ``CPAttention``: the library layer (separate projections, each followed by its
  all-to-all; one attention call over all local heads), ``overlap_chunks`` 1 and 2,
  and with ``kv_exchange="ring"`` where there is a K/V exchange;
* ``naive``: one fused QKV projection, then every collective;
* ``pipelined``: a prototype (this file) of what the layer could do: the heads
  split into chunks with *attention per chunk* (chunk i's exchanges run under
  chunk i+-1's attention and projections), RoPE applied before the all-to-all
  (inside the projection block), and the dK/dV reduction done as an
  all-to-all + local float32 sum (TPU runs reduce-scatter synchronously);
  variants without RoPE, and with the K/V all-gather itself done as an all-to-all.

and prints a markdown table: overlap fraction forward / backward (share of CP
collective bytes with a matmul scheduled between start and done), per-device
memory and the planner's step-time estimate. Measures only; asserts nothing.

    JAX_PLATFORMS=cpu python benchmarks/overlap.py                 # v5e:4x4 and v5p:4x4x4
    JAX_PLATFORMS=cpu python benchmarks/overlap.py --topology v5e:4x4 --variants cp,naive

Letters: B batch, S sequence, D model width, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import kernels  # noqa: E402
from jax_cp import plan  # noqa: E402
from jax_cp._collectives import _a2a, gather_ints  # noqa: E402
from jax_cp._layer import _varying  # noqa: E402
from jax_cp._mesh import lcm  # noqa: E402
from jax_cp._posenc import apply_rope  # noqa: E402
from jax_cp._projection import heads_to_model, project_to_heads  # noqa: E402

# topology -> (batch, seq_len, layouts (name, cp_colossal, cp_ulysses, tp))
CASES = {
    "v5e:4x4": (2, 8192, [("Ulysses", 1, 4, 2), ("all-gather", 4, 1, 4), ("hybrid", 2, 2, 4)]),
    # (2,2,4) with dp=4 does not map onto the 4x4x4 torus (jax.make_mesh); the hybrid uses all 64 chips.
    "v5p:4x4x4": (4, 32768, [("Ulysses", 1, 4, 4), ("all-gather", 4, 1, 4), ("hybrid", 4, 4, 4)]),
}
XS, META = P("dp", ("cp_colossal", "cp_ulysses"), None), P("dp", ("cp_colossal", "cp_ulysses"))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_kv(x_BSKd, axis_name):
    """All-gather along the sequence; backward: all-to-all of the float32 cotangent, then a local sum.

    TPU runs reduce-scatter synchronously; all-to-all is asynchronous (with the
    flag) and moves the same bytes.
    """
    return lax.all_gather(x_BSKd, axis_name, axis=1, tiled=True)


def _gather_kv_fwd(x, axis_name):
    return gather_kv(x, axis_name), jnp.zeros((0,), x.dtype)


def _gather_kv_bwd(axis_name, carrier, g_BSKd):
    c = lax.axis_size(axis_name)
    B, S = g_BSKd.shape[:2]
    g = g_BSKd.astype(jnp.float32).reshape(B, c, S // c, *g_BSKd.shape[2:])
    g = lax.all_to_all(g, axis_name, 1, 1, tiled=True)  # block i of every rank -> rank i
    return (g.sum(1).astype(carrier.dtype),)


gather_kv.defvjp(_gather_kv_fwd, _gather_kv_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def project_rope_to_heads(x_BSD, w_DHd, pos_BS, theta, axis_name, dtype):
    """``rope(x @ w)`` at the local tokens' positions, then the all-to-all ``[B, S/u, H, d] -> [B, S, H/u, d]``.

    RoPE before the exchange keeps the exchange's input a plain matmul output,
    which XLA's async collective fusion handles; after it, RoPE sits between
    the exchange and the colossal all-gather and XLA leaves that gather synchronous.
    """
    y = jnp.einsum("bsd,dhe->bshe", x_BSD.astype(dtype), w_DHd.astype(dtype))
    if theta is not None:
        y = apply_rope(y, pos_BS, theta)
    return _a2a(y, axis_name, 2, 1)


def _prth_fwd(x, w, pos, theta, axis_name, dtype):
    return project_rope_to_heads(x, w, pos, theta, axis_name, dtype), (x, w, pos)


def _prth_bwd(theta, axis_name, dtype, res, g_BSHd):
    x, w, pos = res
    g = _a2a(g_BSHd, axis_name, 1, 2)
    if theta is not None:
        g = apply_rope(g, -pos, theta)  # the rotation's transpose is the rotation by -angle
    dx = jnp.einsum("bshe,dhe->bsd", g, w.astype(dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("bsd,bshe->dhe", x.astype(dtype), g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw, None


project_rope_to_heads.defvjp(_prth_fwd, _prth_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_kv_a2a(x_BSKd, axis_name):
    """The same all-gather done as an all-to-all of c copies (the same bytes on the wire).

    An all-gather is asynchronous on TPU only as v5e collective fusion (continued
    inside matmul fusions, so never under attention, and not at all on v5p);
    all-to-all is asynchronous everywhere (with the flag), under any compute.
    """
    c = lax.axis_size(axis_name)
    copies = jnp.broadcast_to(x_BSKd[:, None], (x_BSKd.shape[0], c, *x_BSKd.shape[1:]))
    out = lax.all_to_all(copies, axis_name, 1, 1, tiled=True)  # [B, c (source), S/c, K, d]
    return out.reshape(x_BSKd.shape[0], -1, *x_BSKd.shape[2:])


gather_kv_a2a.defvjp(lambda x, axis_name: (gather_kv_a2a(x, axis_name), jnp.zeros((0,), x.dtype)), _gather_kv_bwd)


def pipelined_layer(shape: plan.LayerShape, mesh, *, gather=None):
    """Prototype layer: per-chunk projections, exchanges, attention and output projection."""
    gather = gather_kv if gather is None else gather
    dims = jax_cp.mesh_dims(mesh)
    n, H, d, D = shape.overlap_chunks, shape.num_heads, shape.head_dim, shape.d_model
    kv = lcm(shape.num_kv_heads, dims.t * dims.u * n)
    dt = jnp.dtype(shape.dtype)

    def shard(wq, wk, wv, wo, x, pos):
        x = _varying(x.astype(dt))
        wq, wk, wv, wo = map(_varying, (wq, wk, wv, wo))
        pos_u = gather_ints(pos, "cp_ulysses")
        kv_pos = gather_ints(pos_u, "cp_colossal")
        y = 0.0
        for cq, ck, cv, co in zip(*(jnp.split(w, n, 1) for w in (wq, wk, wv)), jnp.split(wo, n, 0)):
            q, k = (project_rope_to_heads(x, w, pos, shape.rope_theta, "cp_ulysses", dt) for w in (cq, ck))
            v = project_to_heads(x, cv, None, "cp_ulysses", dt)
            if dims.c > 1:
                k, v = gather(k, "cp_colossal"), gather(v, "cp_colossal")
            o = kernels.local_attention(q, k, v, kernel=shape.kernel, q_positions=pos_u, kv_positions=kv_pos,
                                        is_causal=shape.is_causal)
            y = y + heads_to_model(o, co, "cp_ulysses").astype(jnp.float32)
        return lax.psum(y, "tp").astype(dt)

    w_in, w_out = P(None, "tp", None), P("tp", None, None)
    fn = jax.shard_map(shard, mesh=mesh, in_specs=(w_in, w_in, w_in, w_out, XS, META), out_specs=XS)
    B, S = shape.batch, shape.seq_len

    def loss(params, x):
        pos = jax.sharding.reshard(jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), NamedSharding(mesh, META))
        return jnp.mean(jnp.square(fn(*params, x, pos).astype(jnp.float32)))

    def sds(shp, spec, dtype=shape.param_dtype):
        return jax.ShapeDtypeStruct(shp, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))

    params = (sds((D, H, d), w_in), sds((D, kv, d), w_in), sds((D, kv, d), w_in), sds((H, d, D), w_out))
    return jax.grad(loss, argnums=(0, 1)), (params, sds((B, S, D), XS, shape.dtype))


def cp_ring_layer(shape: plan.LayerShape, mesh):
    """``CPAttention(kv_exchange="ring")``: K/V passed around cp_colossal by collective-permutes."""
    return plan.cp_layer(dataclasses.replace(shape, kv_exchange="ring"), mesh)


VARIANTS = {
    "cp": ("CPAttention", plan.cp_layer, (1, 2)),
    "cp-ring": ("CPAttention ring", cp_ring_layer, (1, 2)),
    "naive": ("naive fused QKV", plan.naive_layer, (1,)),
    "pipelined": ("pipelined prototype", pipelined_layer, (2, 4)),
    "pipelined-norope": ("pipelined, no RoPE", pipelined_layer, (2,)),
    "pipelined-a2a": ("pipelined, K/V all-gather as all-to-all", partial(pipelined_layer, gather=gather_kv_a2a), (2, 4)),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", action="append", help="repeatable; default: " + ", ".join(CASES))
    p.add_argument("--variants", default="cp,naive,pipelined,pipelined-norope")
    p.add_argument("--kernel", default="blockwise")
    p.add_argument("--layouts", default="Ulysses,all-gather,hybrid")
    args = p.parse_args(argv)
    spec = plan.MODELS["llama3-8b"]
    print("| topology | layout (c,u,t) dp | B, S | variant | chunks | overlap fwd | overlap bwd | "
          "memory/device | est. step | compile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for topo in args.topology or list(CASES):
        batch, seq_len, layouts = CASES[topo]
        devices = plan.get_topology(topo).devices
        for name, c, u, t in layouts:
            if name not in args.layouts.split(","):
                continue
            mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, devices=devices)
            for key in args.variants.split(","):
                label, build, chunk_options = VARIANTS[key]
                for chunks in chunk_options:
                    if spec.num_heads % (t * u * chunks) or (key in ("cp-ring", "pipelined-a2a") and c == 1):
                        continue
                    rope = None if key.endswith("norope") else spec.rope_theta
                    shape = plan.LayerShape(batch=batch, seq_len=seq_len, d_model=spec.d_model,
                                            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                            head_dim=spec.head_dim, rope_theta=rope, kernel=args.kernel,
                                            overlap_chunks=chunks)
                    t0 = time.perf_counter()
                    fn, fargs = build(shape, mesh)
                    a = plan.analyze_program(fn, fargs, topology=topo, mesh=mesh, label=label)
                    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                    print(f"| {topo} | {name} ({c},{u},{t}) dp={mesh.shape['dp']} | {batch}, {seq_len} | {label} | "
                          f"{chunks} | {fmt(a.overlap('fwd'))} | {fmt(a.overlap('bwd'))} | "
                          f"{a.memory.total / 2**30:.2f} GiB | {a.estimate.step_s * 1e3:.2f} ms | "
                          f"{time.perf_counter() - t0:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
