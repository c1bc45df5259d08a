"""Loading a Hugging Face checkpoint onto a CP mesh: time, and bytes each process reads (``models.hf``).

    JAX_PLATFORMS=cpu python benchmarks/hf_load.py --make 300m --checkpoint /tmp/hf300m
    JAX_PLATFORMS=cpu python benchmarks/hf_load.py --checkpoint /tmp/hf300m --devices 8 --fsdp
    # two processes x 4 devices (run both; the same flags but --process-id):
    JAX_PLATFORMS=cpu python benchmarks/hf_load.py --checkpoint /tmp/hf300m --devices 4 --fsdp \\
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0

``--make NAME`` first writes a random bfloat16 Llama-layout checkpoint of shape NAME (``SHAPES``;
files of at most 1 GiB with an index). Then every process loads it on the mesh
``cp_colossal x cp_ulysses x tp`` (dp the rest; ``--fsdp``: weights stored over dp and the CP axes
as well) and prints one JSON line: ``load_s`` (wall time of ``models.hf.load``, the arrays ready),
``bytes_read`` (the tensor bytes its ``get_slice`` reads returned), ``share_bytes`` (the bytes of
the distinct parameter shards its devices hold, in the file's dtype: what it must read at least),
``checkpoint_bytes`` and the process's peak resident memory. ``--json PATH`` also writes it there
(``PATH.<process>``); ``--save DIR`` saves the loaded model back (every process writes its files).
Measures only; asserts nothing (tests/test_hf_load.py runs it with two processes and checks).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

SHAPES = {  # Llama-layout shapes (bfloat16 bytes: tiny 0.1 MB, 300m 0.6 GB, 1b 2.5 GB)
    "tiny": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8),
    "300m": dict(vocab_size=32_000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64),
    "1b": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}


def make_checkpoint(name: str, folder: Path, seed: int = 0) -> None:
    """A random bfloat16 checkpoint of ``SHAPES[name]`` (Llama 3.2 style: tied embeddings, llama3 RoPE)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from models import hf

    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=500_000.0,
                  rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192),
                  tie_word_embeddings=True, hidden_act="silu", max_position_embeddings=131_072) | SHAPES[name]
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files, current, size, index = [], {}, 0, {}
    for tensor, shape in sorted(hf.tensor_shapes(config).items()):
        value = (rng.standard_normal(shape, np.float32) * (0.02 if len(shape) > 1 else 0.1) + (len(shape) == 1))
        current[tensor] = value.astype(ml_dtypes.bfloat16)
        size += current[tensor].nbytes
        if size > 2**30:
            files, current, size = files + [current], {}, 0
    files = files + [current] if current else files
    for i, tensors in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        index |= {t: fname for t in tensors}
    if len(files) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(config))


def share_bytes(model, itemsizes: dict) -> int:
    """Bytes of the distinct shards of every parameter this process's devices hold, at the file's itemsize."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        seen = set()
        for shard in var[...].addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            if key not in seen:
                seen.add(key)
                total += shard.data.size * itemsizes[tuple(path)]
    return total


def measure(args):
    """Loads the checkpoint on this process's mesh; returns ``(figures, model)``."""
    import jax_cp
    from models import families, hf

    mesh = jax_cp.make_mesh(cp_colossal=args.cp_colossal, cp_ulysses=args.cp_ulysses, tp=args.tp,
                            axis_types=AxisType.Auto)
    reader = hf.Reader(args.checkpoint)
    kw = dict(fsdp=True, fsdp_axes=("dp", "cp_colossal", "cp_ulysses")) if args.fsdp else {}
    t0 = time.perf_counter()
    model, config = hf.load(args.checkpoint, mesh, reader=reader, dtype=jnp.bfloat16, **kw)
    jax.block_until_ready(nnx.state(model, nnx.Param))
    load_s = time.perf_counter() - t0
    files = hf.Reader(args.checkpoint)  # for the files' dtypes (these look-ups read no tensor)
    table = families.tensors(model.cfg, families.family_of(config), config)
    itemsizes = {p: files.itemsize(t.name) for p, t in table.items()}
    total = sum(int(np.prod(s)) * files.itemsize(n) for n, s in hf.tensor_shapes(config).items())
    files.close()
    figures = dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                   mesh={k: int(v) for k, v in mesh.shape.items()}, fsdp=args.fsdp, load_s=round(load_s, 3),
                   bytes_read=reader.bytes_read, share_bytes=share_bytes(model, itemsizes), checkpoint_bytes=total,
                   peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    return figures, model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (written first with --make)")
    p.add_argument("--make", choices=sorted(SHAPES), help="write a random checkpoint of this shape first")
    p.add_argument("--devices", type=int, help="simulated CPU devices of this process")
    p.add_argument("--cp-colossal", type=int, default=2)
    p.add_argument("--cp-ulysses", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="weights stored over dp and the CP axes too")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--json", help="also write the figures to JSON.<process>")
    p.add_argument("--save", help="save the loaded model back to this folder")
    p.add_argument("--save-shard-bytes", type=int, default=5 * 2**30, help="the largest file --save writes")
    args = p.parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                                   initialization_timeout=120)
    if args.make and jax.process_index() == 0:
        make_checkpoint(args.make, Path(args.checkpoint))
    figures, model = measure(args)
    if args.save:
        from models import hf

        t0 = time.perf_counter()
        hf.save(model, args.save, hf.read_config(args.checkpoint), dtype=jnp.bfloat16,
                max_shard_bytes=args.save_shard_bytes)
        figures["save_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(figures))
    if args.json:
        Path(f"{args.json}.{jax.process_index()}").write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
