"""Per-chip memory of ring vs all-gather K/V exchange, from TPU ahead-of-time compilation (no TPU needed).

Compiles forward+backward of a Llama-3-8B-sized attention (32 query heads, 8 kv
heads, head dim 128, bfloat16, causal, blockwise kernel) through
``jax_cp.dot_product_attention`` for TPU topology devices (libtpu) at
S = 128K ... 1M, and prints ``compiled.memory_analysis()`` per chip (temporaries,
and arguments+outputs) as a markdown table. Measures only; asserts nothing.

    JAX_PLATFORMS=cpu python benchmarks/ring_memory.py
    JAX_PLATFORMS=cpu python benchmarks/ring_memory.py --topology v5p:4x4x4 --mesh 16,4,1 --seq 131072

Letters: B batch, S sequence, H query heads, K kv heads, d head dim.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402

GIB = 2**30


def per_chip(mesh, S, *, H=32, K=8, d=128, kv_exchange):
    spec = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    q = jax.ShapeDtypeStruct((1, S, H, d), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, S, K, d), jnp.bfloat16, sharding=spec)
    loss = lambda q, k, v: jax_cp.dot_product_attention(
        q, k, v, mesh=mesh, is_causal=True, kernel="blockwise", kv_exchange=kv_exchange).astype(jnp.float32).sum()
    m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().memory_analysis()
    return m.temp_size_in_bytes, m.argument_size_in_bytes + m.output_size_in_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5p:4x4x4")
    ap.add_argument("--mesh", default="64,1,1;8,8,1", help="c,u,t meshes separated by ';' (dp takes the rest)")
    ap.add_argument("--seq", default="131072,262144,524288,1048576")
    args = ap.parse_args()
    topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    seqs = [int(s) for s in args.seq.split(",")]
    print(f"jax {jax.__version__}, TPU {args.topology} ({len(topo.devices)} chips, ahead of time); H=32 K=8 d=128 "
          "bfloat16 causal, blockwise kernel, forward+backward; GiB per chip: temporaries (+ arguments and outputs)\n")
    print("| mesh (c,u,t) | exchange | " + " | ".join(f"S={s // 1024}K" for s in seqs) + " |")
    print("|---|---|" + "---|" * len(seqs))
    for cut in args.mesh.split(";"):
        c, u, t = map(int, cut.split(","))
        try:
            mesh = jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, devices=topo.devices,
                                    axis_types=jax.sharding.AxisType.Explicit)
        except NotImplementedError:  # no torus-aware layout for this shape: plain device order
            grid = np.array(topo.devices).reshape(-1, c, u, t)
            mesh = jax.sharding.Mesh(grid, jax_cp.AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 4)
        for exchange in ("all_gather", "ring"):
            t0 = time.time()
            cells = []
            for S in seqs:
                temp, io = per_chip(mesh, S, kv_exchange=exchange)
                cells.append(f"{temp / GIB:.2f} (+{io / GIB:.2f})")
            print(f"| {c},{u},{t} | {exchange} | " + " | ".join(cells) + f" |  <!-- {time.time() - t0:.0f}s -->",
                  flush=True)


if __name__ == "__main__":
    main()
