"""Samples text from a ``models.train`` checkpoint: ``python -m models.generate --help``.

The prompt is prefilled with context parallelism (every attention layer runs its CP path and writes
its KV cache, sharded along the sequence over ``cp_colossal x cp_ulysses`` and by kv heads over
``tp``); then each new token is one decode step that attends every device's cache shard and merges
the partial results (``jax_cp._decode``). A hybrid model's gated DeltaNet layers (``models.hybrid``)
keep their recurrent state instead, split over ``tp`` by heads, and advance it one token a step.
Greedy (``--temperature 0``) or temperature / top-k sampling; the text streams as it is generated,
then prefill and per-token times are reported.
``--plan TOPOLOGY`` instead compiles one decode step of ``--model`` for a TPU topology ahead of
time at ``--cache-len`` and reports per-chip cache memory and the decode collectives.
"""
from __future__ import annotations

import argparse
import codecs
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp
from models import data as data_lib
from models.hybrid import get_config, model_class
from models.llama import Sharding

__all__ = ["GenerateConfig", "Generator", "load_model", "main", "sample_logits", "serving_params"]

PROG = "python -m models.generate"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    checkpoint: str | None = None
    prompt: str = "def "
    max_new_tokens: int = 200
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    batch: int | None = None
    max_length: int | None = None
    devices: int | None = None
    cp_colossal: int = 1
    cp_ulysses: int = 1
    tp: int = 1
    stop_at_eod: bool = True
    plan: str | None = None
    model: str = "llama3-8b"
    cache_len: int = 131072
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("max_new_tokens", "cp_colossal", "cp_ulysses", "tp", "cache_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be a positive integer.")
        for name in ("batch", "max_length", "devices", "top_k"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')}={value} must be a positive integer.")
        if self.temperature < 0:
            raise ValueError(f"--temperature={self.temperature} must be >= 0 (0: greedy).")
        if self.plan is None and self.checkpoint is None:
            raise ValueError("--checkpoint DIR is needed (a models.train --out folder or its checkpoints/), "
                             "or --plan TOPOLOGY to plan a decode step.")
        if self.plan is None and not self.prompt:
            raise ValueError("--prompt is empty; give at least one character.")


def _parser() -> argparse.ArgumentParser:
    d = GenerateConfig(plan="defaults")
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a models.train --out folder (or its checkpoints/ folder), or a Hugging "
                                        "Face checkpoint folder (config.json, safetensors, tokenizer.json: models.hf)")
    p.add_argument("--prompt", default=d.prompt)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch", type=int, help="sequences sampled at once (default: dp); the first is printed")
    p.add_argument("--max-length", type=int, help="cache length (default: the prompt plus the new tokens)")
    p.add_argument("--no-stop-at-eod", dest="stop_at_eod", action="store_false",
                   help="keep going past the end-of-document token")
    g = p.add_argument_group("mesh")
    g.add_argument("--devices", type=int, help="simulated CPU devices (e.g. 8)")
    for name in ("cp_colossal", "cp_ulysses", "tp"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=1)
    g = p.add_argument_group("planning (no checkpoint: shapes only)")
    g.add_argument("--plan", metavar="TOPOLOGY", help="compile one decode step for a TPU topology, e.g. v5p:4x4x4")
    g.add_argument("--model", default=d.model, help="the model to plan (models.llama.CONFIGS, models.hybrid.CONFIGS)")
    g.add_argument("--cache-len", type=int, default=d.cache_len, help="the planned cache length")
    g.add_argument("--dtype", default=d.dtype)
    return p


def parse_args(argv=None) -> GenerateConfig:
    parser = _parser()
    try:
        return GenerateConfig(**vars(parser.parse_args(argv)))
    except ValueError as e:
        parser.exit(2, f"{PROG}: error: {e}\n")


def checkpoint_dir(path: str) -> Path:
    p = Path(path)
    p = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not p.is_dir() or not any(c.name.isdigit() for c in p.iterdir()):
        raise ValueError(f"--checkpoint {path}: no models.train checkpoint there (expected OUT or OUT/checkpoints "
                         "holding numbered step folders; run make train first).")
    return p.absolute()


def load_model(path: str, mesh):
    """The model of the latest checkpoint under ``path``, restored onto ``mesh``; and the checkpoint's meta.

    A Hugging Face checkpoint folder (``config.json``) loads through ``models.hf`` (bfloat16 compute); its
    meta carries its ``tokenizer`` (``tokenizer.json``, else bytes) and end-of-sequence id ``eod``.
    """
    from models import train

    if (Path(path) / "config.json").is_file():
        from models import hf

        model, config = hf.load(path, mesh, dtype=jnp.bfloat16)
        tokenizer = hf.load_tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        eos = hf.eos_token_id(config)
        return model, {"model": Path(path).name, "step": "final", "tokenizer": tokenizer,
                       "eod": data_lib.EOD if eos is None else eos}
    with ocp.CheckpointManager(checkpoint_dir(path), item_names=("state", "meta")) as mngr:
        step = mngr.latest_step()
        meta = dict(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        dims = jax_cp.mesh_dims(mesh)
        cfg = train.TrainConfig(model=meta["model"], cp_colossal=dims.c, cp_ulysses=dims.u, tp=dims.t,
                                seq_len=2 * dims.cp, batch=dims.dp, steps=2, warmup=1, load_balance=False,
                                logits_soft_cap=meta.get("logits_soft_cap"), use_sinks=meta.get("use_sinks", False),
                                dtype=meta.get("dtype", "bfloat16"))
        tx, _ = train.make_optimizer(cfg)
        with jax.set_mesh(mesh):
            graphdef, state = nnx.split(nnx.eval_shape(train._init_fn(cfg, mesh, tx)))
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=NamedSharding(mesh, x.sharding.spec)),
                              nnx.to_pure_dict(state))
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    nnx.replace_by_pure_dict(state, got["state"])
    model, _ = nnx.merge(graphdef, state)
    return model, meta | {"step": step}


def sample_logits(logits_BV, key, temperature: float, top_k: int | None):
    """The next token of each row: argmax at temperature 0, else a draw from softmax(logits / T) over the
    ``top_k`` most likely (all when None)."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def serving_params(params, dtype):
    """The weight matrices (every parameter of 2 or more dims but the embedding table) in the compute
    ``dtype``, once: each decode step then reads half the bytes of float32 weights, and the outputs are
    unchanged, since every matmul casts its weight to that dtype anyway. The embedding table (its rows
    enter the float32 residual stream), norms and sinks keep their dtype."""
    def cast(path, x):
        keep = len(x.shape) < 2 or getattr(path[0], "key", None) == "embed" or not jnp.issubdtype(x.dtype, jnp.floating)
        if keep:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):  # planning: shapes only
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Generator:
    """Compiled prefill and decode steps of ``model`` for ``batch`` sequences and a ``max_length`` cache.

    Each step's cache is donated: XLA updates it in place (one copy of the cache, ever). The weights
    are held in the model's compute dtype (``serving_params``)."""

    def __init__(self, model, *, batch: int, prompt_len: int, max_length: int, temperature=0.0, top_k=None):
        dims = jax_cp.mesh_dims(model.mesh)
        self.mesh, self.batch, n = model.mesh, batch, dims.cp
        self.prefill_len = _round_up(prompt_len, n)  # the prompt padded to a multiple of the CP degree
        if self.prefill_len > max_length:
            raise ValueError(f"the prompt ({prompt_len} tokens, padded to {self.prefill_len}) is longer than "
                             f"max_length={max_length}; raise --max-length.")
        model.init_cache(batch, max_length)
        self.graphdef, params, self.cache = nnx.split(model, nnx.Param, nnx.Cache)
        self.params = serving_params(params, model.dtype)
        sample = lambda logits, key: sample_logits(logits, key, temperature, top_k)

        def prefill(params, cache, tokens, lengths, key):
            m = nnx.merge(self.graphdef, params, cache)
            logits = m(tokens, prefill=True, lengths=lengths)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            return sample(last, key), nnx.state(m, nnx.Cache)

        def step(params, cache, tok_B, key):
            m = nnx.merge(self.graphdef, params, cache)
            return sample(m(tok_B[:, None], decode=True)[:, 0], key), nnx.state(m, nnx.Cache)

        self._prefill = jax.jit(prefill, donate_argnums=1)
        self._step = jax.jit(step, donate_argnums=1)
        self.compile_s = 0.0

    def _run(self, name: str, *args):
        """Runs the jitted ``name`` (compiled ahead of time on first use, its compile time counted)."""
        fn = getattr(self, name)
        if not isinstance(fn, jax.stages.Compiled):
            t = time.perf_counter()
            fn = fn.lower(*args).compile()
            self.compile_s += time.perf_counter() - t
            setattr(self, name, fn)
        return fn(*args)

    def prefill(self, prompts_BS: np.ndarray, lengths_B: np.ndarray, key):
        tokens = np.zeros((self.batch, self.prefill_len), np.int32)
        tokens[:, :prompts_BS.shape[1]] = prompts_BS
        tokens = jax.device_put(tokens, NamedSharding(self.mesh, Sharding().tokens_BS))
        lengths = jax.device_put(np.asarray(lengths_B, np.int32), NamedSharding(self.mesh, P("dp")))
        tok, self.cache = self._run("_prefill", self.params, self.cache, tokens, lengths, key)
        return tok

    def step(self, tok_B, key):
        tok_B = jax.device_put(tok_B, NamedSharding(self.mesh, P("dp")))
        tok, self.cache = self._run("_step", self.params, self.cache, tok_B, key)
        return tok


def _piece(tokens: list[int], decoder, tokenizer) -> str:
    """The text the last of ``tokens`` adds: its UTF-8 byte, or what it adds to a tokenizer's decoding."""
    if tokenizer is None:
        return decoder.decode(bytes([tokens[-1]])) if tokens[-1] < 256 else ""
    return tokenizer.decode(tokens)[len(tokenizer.decode(tokens[:-1])):]


def generate(cfg: GenerateConfig, model, out=None, tokenizer=None, eod: int = data_lib.EOD) -> dict:
    """Prefills the prompt, decodes up to ``max_new_tokens`` (streaming the first sequence to ``out``); text
    is bytes, or ``tokenizer``'s (a ``tokenizers.Tokenizer``) with its end-of-sequence id ``eod``."""
    out = out or sys.stdout
    dims = jax_cp.mesh_dims(model.mesh)
    batch = cfg.batch or dims.dp
    prompt = (np.asarray(tokenizer.encode(cfg.prompt).ids, np.int32) if tokenizer is not None
              else np.frombuffer(cfg.prompt.encode(), np.uint8).astype(np.int32))
    need = _round_up(_round_up(len(prompt), dims.cp) + cfg.max_new_tokens, dims.cp)
    max_length = cfg.max_length or need
    if max_length < need:
        raise ValueError(f"--max-length={max_length} cannot hold the prompt ({len(prompt)} tokens, padded to a "
                         f"multiple of {dims.cp}) and {cfg.max_new_tokens} new tokens; use --max-length >= {need}.")
    gen = Generator(model, batch=batch, prompt_len=len(prompt), max_length=max_length,
                    temperature=cfg.temperature, top_k=cfg.top_k)
    keys = iter(list(jax.random.split(jax.random.key(cfg.seed), cfg.max_new_tokens + 1)))  # split before timing
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(cfg.prompt)
    t0 = time.perf_counter()
    tok = gen.prefill(np.broadcast_to(prompt, (batch, len(prompt))), np.full(batch, len(prompt)), next(keys))
    tok.block_until_ready()
    prefill_s, times, tokens = time.perf_counter() - t0 - gen.compile_s, [], []
    for _ in range(cfg.max_new_tokens):
        first = int(tok[0])
        tokens.append(first)
        if cfg.stop_at_eod and first == eod:
            break
        out.write(_piece(tokens, decoder, tokenizer))
        out.flush()
        if len(tokens) == cfg.max_new_tokens:
            break
        t, compiled = time.perf_counter(), gen.compile_s
        tok = gen.step(tok, next(keys))
        tok.block_until_ready()
        times.append(time.perf_counter() - t - (gen.compile_s - compiled))
    out.write(decoder.decode(b"", final=True) + "\n")
    return {"tokens": tokens, "prompt_tokens": len(prompt), "prefill_s": prefill_s,
            "step_s": float(np.median(times)) if times else None, "compile_s": gen.compile_s,
            "max_length": max_length, "batch": batch}


def plan_decode(cfg: GenerateConfig):
    """Compiles one decode step of ``cfg.model`` for the TPU topology ``cfg.plan`` with a ``cache_len`` cache
    (shapes only) and analyzes it (``jax_cp.plan.analyze_program``); returns ``(analysis, cache bytes per chip)``."""
    from jax_cp import plan

    mesh = plan.topology_mesh(cfg.plan, cp_colossal=cfg.cp_colossal, cp_ulysses=cfg.cp_ulysses, tp=cfg.tp,
                              axis_types=AxisType.Auto)
    batch = cfg.batch or jax_cp.mesh_dims(mesh).dp
    def build():  # shapes only: nothing is allocated
        config = get_config(cfg.model)
        model = model_class(config)(config, mesh=mesh, dtype=jnp.dtype(cfg.dtype), rngs=nnx.Rngs(0))
        model.init_cache(batch, cfg.cache_len)
        return model

    with jax.set_mesh(mesh):
        graphdef, params, cache = nnx.split(nnx.eval_shape(build), nnx.Param, nnx.Cache)
    sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec))
    params, cache = serving_params(jax.tree.map(sds, params), jnp.dtype(cfg.dtype)), jax.tree.map(sds, cache)
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=NamedSharding(mesh, P("dp", None)))

    def step(params, cache, tok_BT):
        m = nnx.merge(graphdef, params, cache)
        return m(tok_BT, decode=True), nnx.state(m, nnx.Cache)

    per_chip = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))
    with jax.set_mesh(mesh):
        a = plan.analyze_program(step, (params, cache, tok), topology=cfg.plan, mesh=mesh,
                                 label=f"decode step {cfg.model}", donate_argnums=1)
    return a, int(per_chip)


def _plan_main(cfg: GenerateConfig) -> None:
    from jax_cp import plan

    a, cache_bytes = plan_decode(cfg)
    mesh = plan.topology_mesh(cfg.plan, cp_colossal=cfg.cp_colossal, cp_ulysses=cfg.cp_ulysses, tp=cfg.tp,
                              axis_types=AxisType.Auto)
    print(f"jax_cp plan: one decode step of {cfg.model} on {cfg.plan}, mesh "
          + " ".join(f"{k}={v}" for k, v in mesh.shape.items())
          + f"\ncache {cfg.cache_len} tokens x {cfg.batch or jax_cp.mesh_dims(mesh).dp} sequences, {cfg.dtype}: "
          f"{cache_bytes / 2**30:.2f} GiB per chip (all layers)\n")
    print(plan.format_programs([a], grouped=True))


def main(argv=None) -> None:
    cfg = parse_args(argv)
    try:
        if cfg.plan is not None:
            return _plan_main(cfg)
        if cfg.devices is not None:
            jax.config.update("jax_num_cpu_devices", cfg.devices)
        mesh = jax_cp.make_mesh(cp_colossal=cfg.cp_colossal, cp_ulysses=cfg.cp_ulysses, tp=cfg.tp)
        model, meta = load_model(cfg.checkpoint, mesh)
        r = generate(cfg, model, tokenizer=meta.get("tokenizer"), eod=meta.get("eod", data_lib.EOD))
    except ValueError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        raise SystemExit(2) from None
    dims = jax_cp.mesh_dims(mesh)
    print(f"-- {meta['model']} (step {meta['step']}) on {jax.device_count()} {jax.default_backend()} devices "
          f"(dp={dims.dp} cp_colossal={dims.c} cp_ulysses={dims.u} tp={dims.t}), batch {r['batch']}, cache "
          f"{r['max_length']}: prefill {r['prompt_tokens']} tokens {r['prefill_s'] * 1e3:.1f} ms, "
          f"{len(r['tokens'])} new tokens "
          + (f"{r['step_s'] * 1e3:.1f} ms each" if r["step_s"] else "")
          + f" (compile {r['compile_s']:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
