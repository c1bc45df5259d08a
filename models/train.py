"""Trains the Llama-style (or hybrid) model on a context-parallel mesh: ``python -m models.train --help``.

One process or many (``--coordinator host:port --num-processes N --process-id i``,
or a TPU pod's environment). Each step: the global batch (built per process;
its packed rows each put in the order a dispatch plan of the batch gives, so the
CP ranks get equal attention work) -> loss and gradients (bfloat16 compute,
float32 parameters) -> AdamW with gradient clipping and warmup + cosine decay.
Each step logs the slowest CP rank's attention work over the mean, for the order
used and for the dual-chunk order of the same batch. With the dispatch order and
``--kv-exchange auto`` (the defaults), each step's attention moves only the K/V
blocks its queries may see: the batch's plan's ``Attended`` exchange, a static
argument of the step (at most ``MAX_EXCHANGES`` compiled steps a run), where that
moves less than the configured exchange. Writes ``OUT/metrics.jsonl``,
``OUT/loss.png``, ``OUT/summary.json`` and orbax checkpoints (atomic: a kill
during a save leaves the previous one usable); ``--resume`` continues from the
latest one with the same data order. ``--plan TOPOLOGY`` compiles one training
step for a TPU topology ahead of time (libtpu wheel, no TPU needed) and prints
its memory, collectives and overlap.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from tqdm import tqdm

import jax_cp
from jax_cp import load_balance
from models import data as data_lib
from models import hf
from jax_cp import linear
from models.hybrid import HybridConfig, abstract_model, get_config, model_class
from models.llama import REMAT, Sharding, next_token_loss

REMAT_POLICIES = ("auto", *REMAT)  # --remat-policy: auto picks one of REMAT by memory (resolve_remat)
AUTO_REMAT = ("attention", "full", "offload")  # what auto tries, fastest first

__all__ = ["TrainConfig", "global_batch", "main", "parse_args", "run"]

PROG = "python -m models.train"
BALANCES = ("dispatch", "dual-chunk")  # --balance: a plan per batch (jax_cp.load_balance.plan), or one fixed order
MAX_EXCHANGES = 4  # K/V exchanges (so compiled steps) a run uses at most: the configured one and Attended values


class UsageError(ValueError):
    """A problem with the flags found once training has started (e.g. a checkpoint made with others)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run depends on; validated on creation (device-independent checks)."""

    devices: int | None = None
    dp: int | None = None
    cp_colossal: int = 1
    cp_ulysses: int = 1
    tp: int = 1
    fsdp: bool | str = "auto"  # True (--fsdp), False (--no-fsdp) or "auto": fsdp_choice decides
    fsdp_axes: str = "dp,cp_colossal,cp_ulysses"  # comma-separated: the axes FSDP stores weights and moments over
    model: str = "tiny"
    seq_len: int = 256
    batch: int = 8
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    dtype: str = "bfloat16"
    kv_exchange: str = "auto"
    kernel: str = "auto"
    overlap_chunks: int | str = "auto"
    fused_qkv_chunks: int | str = "auto"
    load_balance: bool = True
    balance: str = "dispatch"  # with load_balance: one of BALANCES
    logits_soft_cap: float | None = None  # every attention layer: logits -> c * tanh(logits / c)
    use_sinks: bool = False  # every attention layer: a learned sink logit per query head
    prefix_lm: float | None = None  # a prefix-LM objective: this share of each document is a bidirectional prompt
    remat: bool = False
    remat_policy: str = "auto"  # with remat: what a block keeps beside its input (one of REMAT_POLICIES)
    scan_layers: bool = True  # the blocks as one lax.scan over stacked parameters (models.llama.Llama)
    residual_dtype: str = "auto"  # the residual stream between blocks: auto (the compute --dtype), float32, bfloat16
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    resume: bool = False
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 2
    out: str = "runs/train"
    progress: bool = True
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = 30
    debug_step_sleep: float = 0.0  # test hook: widens the window in which a run can be killed
    plan: str | None = None  # a TPU topology: compile one step for it and report instead of training
    xla_flags: bool = True  # apply jax_cp.plan's recommended XLA flags on TPU / GPU hosts
    init_from: str | None = None  # a Hugging Face checkpoint folder: its model, weights and tokenizer (models.hf)
    rope_scaling: str | None = None  # with init_from: linear:F or llama3:F stretches its RoPE for F times the context
    linear_pieces: int | None = None  # hybrid models: fixed state slots a linear layer holds (None: each batch's need)
    dispatch_chunks: int | None = None  # --balance dispatch: chunks per colossal rank (None: the model's, else the plan's 8)

    def __post_init__(self):
        from models import hybrid, llama

        positive = ["cp_colossal", "cp_ulysses", "tp", "seq_len", "batch", "steps", "heartbeat_timeout"]
        positive += ["overlap_chunks"] if self.overlap_chunks != "auto" else []
        positive += [n for n in ("devices", "dp", "num_processes", "linear_pieces") if getattr(self, n) is not None]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value} must be a positive integer.")
        for name in ("warmup", "checkpoint_every", "eval_every", "eval_batches", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 0.")
        if self.dispatch_chunks is not None and (not isinstance(self.dispatch_chunks, int) or self.dispatch_chunks < 2
                                                 or self.dispatch_chunks % 2):
            raise ValueError(f"--dispatch-chunks={self.dispatch_chunks} must be an even integer >= 2 (a rank's chunks "
                             "include the two halves of the dual-chunk order).")
        if self.warmup >= self.steps:
            raise ValueError(f"--warmup={self.warmup} must be smaller than --steps={self.steps}.")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be > 0.")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"--logits-soft-cap={self.logits_soft_cap} must be > 0 (or left out: no cap).")
        if self.prefix_lm is not None and not 0 < self.prefix_lm < 1:
            raise ValueError(f"--prefix-lm={self.prefix_lm} must be in (0, 1): the share of each document that is "
                             "the bidirectional prompt (or left out: plain next-token training).")
        if self.balance not in BALANCES:
            raise ValueError(f"--balance={self.balance!r} must be one of {BALANCES}.")
        if self.init_from is None and self.rope_scaling is not None:
            raise ValueError(f"--rope-scaling {self.rope_scaling} stretches a loaded checkpoint's RoPE; give "
                             "--init-from PATH too.")
        if self.init_from is not None and (self.use_sinks or self.logits_soft_cap is not None):
            raise ValueError("--init-from trains the checkpoint's own architecture; drop --use-sinks and "
                             "--logits-soft-cap.")
        if self.model not in llama.CONFIGS and self.model not in hybrid.CONFIGS:
            raise ValueError(f"--model={self.model!r} is unknown; choose one of {sorted(llama.CONFIGS)} (Llama) or "
                             f"{sorted(hybrid.CONFIGS)} (hybrid: gated DeltaNet and attention layers).")
        if self.prefix_lm is not None and self.model in hybrid.CONFIGS:
            raise ValueError(f"--prefix-lm={self.prefix_lm} needs bidirectional prompts, which the recurrent layers "
                             f"of --model={self.model} cannot see; train it without --prefix-lm.")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"--remat-policy={self.remat_policy!r} must be one of {REMAT_POLICIES}.")
        if self.remat_policy != "auto" and not self.remat:
            raise ValueError(f"--remat-policy={self.remat_policy} says what remat keeps; add --remat (or drop it).")
        if self.fsdp not in (True, False, "auto"):
            raise ValueError(f"fsdp={self.fsdp!r} must be True (--fsdp), False (--no-fsdp) or 'auto'.")
        try:
            Sharding(fsdp_axes=self.fsdp_axes_tuple)
        except ValueError as e:
            raise ValueError(f"--fsdp-axes={self.fsdp_axes}: {e}") from None
        cp = self.cp_colossal * self.cp_ulysses
        if self.seq_len % cp:
            raise ValueError(f"--seq-len={self.seq_len} is not divisible by cp_colossal*cp_ulysses="
                             f"{self.cp_colossal}*{self.cp_ulysses}={cp}; use a multiple of {cp}.")
        if self.load_balance and self.cp_colossal > 1 and self.seq_len % (2 * cp):
            raise ValueError(f"--seq-len={self.seq_len} is not divisible by 2*cp_colossal*cp_ulysses={2 * cp}, "
                             "as causal load balancing needs; use a multiple of it (or --no-load-balance).")
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(f"--data {self.data}: no such file or folder.")
        multi = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in multi) and not all(v is not None for v in multi):
            raise ValueError("multi-process runs need all of --coordinator HOST:PORT, --num-processes N and "
                             "--process-id I.")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id={self.process_id} must be in [0, --num-processes={self.num_processes}).")
        if self.plan is not None and (self.devices is not None or self.num_processes is not None or self.resume):
            raise ValueError(f"--plan {self.plan} compiles one step for the topology's own devices in this one "
                             "process and trains nothing; drop --devices, --resume and the multi-process flags.")

    @property
    def fsdp_axes_tuple(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.fsdp_axes.split(",") if a.strip())

    @property
    def model_name(self) -> str:
        """``--model``, or the ``--init-from`` folder's name (what logs and plans call the model)."""
        return self.model if self.init_from is None else Path(self.init_from).resolve().name

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.out) / "checkpoints"


def int_or_auto(text: str):
    """``"auto"`` or an integer: the command-line type of the chunk options."""
    return text if text == "auto" else int(text)


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = TrainConfig()
    g = p.add_argument_group("mesh (dp takes the devices left over)")
    g.add_argument("--devices", type=int, help="simulated CPU devices per process (CPU only)")
    g.add_argument("--dp", type=int, help="data-parallel degree (default: the rest)")
    g.add_argument("--cp-colossal", type=int, default=d.cp_colossal, help="K/V all-gather sequence parallelism")
    g.add_argument("--cp-ulysses", type=int, default=d.cp_ulysses, help="all-to-all sequence parallelism")
    g.add_argument("--tp", type=int, default=d.tp, help="tensor parallelism over heads")
    g.add_argument("--fsdp", dest="fsdp", action="store_const", const=True, default=d.fsdp,
                   help="shard parameters and optimizer state over --fsdp-axes (default: auto, where the replicated "
                        f"state would take {FSDP_AUTO_BYTES // 2**20} MiB a device or more: models.train.fsdp_choice)")
    g.add_argument("--no-fsdp", dest="fsdp", action="store_const", const=False,
                   help="replicate parameters and optimizer state over dp and the CP axes")
    g.add_argument("--fsdp-axes", default=d.fsdp_axes,
                   help="the axes FSDP shards them over, comma-separated (default: dp and both CP axes; the gradient "
                        "sums over them become reduce-scatters)")
    g = p.add_argument_group("model and optimisation")
    g.add_argument("--model", default=d.model,
                   help="tiny, or hybrid-tiny (gated DeltaNet layers, attention every 4th: models.hybrid); "
                        "llama3-8b/70b are shapes for planning")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    g.add_argument("--batch", type=int, default=d.batch, help="global batch (sequences per step)")
    g.add_argument("--steps", type=int, default=d.steps, help="total steps (including resumed ones)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps, then cosine decay")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default=d.dtype, help="compute dtype")
    g.add_argument("--kv-exchange", default=d.kv_exchange,
                   help="colossal K/V exchange (see jax_cp); auto with --balance dispatch: each batch's plan's "
                        "Attended exchange (only the K/V blocks a rank's queries may see), where it moves less")
    g.add_argument("--kernel", default=d.kernel, help="local attention kernel (see jax_cp.kernels)")
    g.add_argument("--overlap-chunks", type=int_or_auto, default=d.overlap_chunks,
                   help="head chunks per attention layer, to overlap exchanges with compute (see jax_cp)")
    g.add_argument("--fused-qkv-chunks", type=int_or_auto, default=d.fused_qkv_chunks,
                   help="leading chunks whose Q, K and V share one Ulysses all-to-all (see jax_cp.plan)")
    g.add_argument("--no-xla-flags", dest="xla_flags", action="store_false",
                   help="do not add jax_cp.plan's recommended XLA flags on TPU / GPU hosts")
    g.add_argument("--no-load-balance", dest="load_balance", action="store_false",
                   help="keep the natural sequence order (causal load balancing is on by default)")
    g.add_argument("--balance", choices=BALANCES, default=d.balance,
                   help="load-balance order: a dispatch plan per batch (equal attention work per CP rank on packed "
                        "rows) or the fixed dual-chunk order (balanced for one document per row)")
    g.add_argument("--remat", action="store_true", help="recompute each block in the backward pass")
    g.add_argument("--remat-policy", choices=REMAT_POLICIES, default=d.remat_policy,
                   help="with --remat: auto (default) takes the first of attention, full, offload whose step fits "
                        "the device's memory (compiled ahead of time to read it; full where the device states no "
                        "limit, as a CPU); full recomputes the whole block from its input; attention also keeps its "
                        "attention output and log-sum-exp, so the backward pass does not rerun the kernel (long "
                        "context: about 2/9 of the attention's FLOPs, for one more activation a layer); offload "
                        "recomputes the whole block and keeps its input in host memory (the longest contexts)")
    g.add_argument("--scan-layers", dest="scan_layers", action="store_true", default=d.scan_layers,
                   help="run the blocks as one lax.scan (the default; their parameters stacked for the step, the "
                        "checkpoint layout unchanged): one block's buffers in the schedule, one block compiled")
    g.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                   help="unroll the blocks: one program with every layer's own buffers and collectives")
    g.add_argument("--residual-dtype", choices=("auto", "float32", "bfloat16"), default=d.residual_dtype,
                   help="the residual stream between blocks: auto (default: the compute --dtype, so bfloat16 for a "
                        "bfloat16 run, as MaxText and Hugging Face keep it: half what remat keeps a layer), float32 "
                        "or bfloat16")
    g.add_argument("--linear-pieces", type=int, default=d.linear_pieces,
                   help="hybrid models: state slots per CP rank of every linear layer, fixed (default: each batch's "
                        "need, counted on the host and rounded up to a power of two: one program per value; "
                        "--plan: the layer's default, min(S/cp_colossal, 16))")
    g.add_argument("--dispatch-chunks", type=int, default=d.dispatch_chunks,
                   help="--balance dispatch: chunks per CP colossal rank of each batch's plan (an even number; default: "
                        "4 for hybrid models, whose linear layers pass one state per chunk, else the plan's 8)")
    g.add_argument("--logits-soft-cap", type=float, default=d.logits_soft_cap,
                   help="cap every attention logit to c*tanh(logits/c) (Gemma 2 style)")
    g.add_argument("--use-sinks", action="store_true", help="a learned sink logit per query head (GPT-OSS style)")
    g.add_argument("--init-from", metavar="PATH",
                   help="fine-tune a Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json; "
                        "models.hf): its model replaces --model, --data is tokenized with its tokenizer, and the "
                        "result is saved in the same layout to OUT/hf")
    g.add_argument("--rope-scaling", metavar="KIND:FACTOR",
                   help="with --init-from: linear:F or llama3:F stretches its RoPE for F times its context")
    g.add_argument("--prefix-lm", type=float, default=d.prefix_lm, metavar="FRACTION",
                   help="prefix-LM objective: the first FRACTION of each document is a bidirectional prompt "
                        "(jax_cp span_ids) and its labels are not trained")
    g = p.add_argument_group("data, checkpoints, logs")
    g.add_argument("--data", help="text file or folder (default: this Python's standard library)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--out", default=d.out, help="metrics.jsonl, loss.png, summary.json go here")
    g.add_argument("--checkpoint-dir", help="default: OUT/checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="steps between checkpoints (0: none; otherwise the last step is saved too)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between eval losses (0: end only)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches, help="held-out batches per eval (0: none)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g = p.add_argument_group("multi-process")
    g.add_argument("--coordinator", help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument("--heartbeat-timeout", type=int, default=d.heartbeat_timeout,
                   help="seconds after which a silent process fails the run")
    g.add_argument("--debug-step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    g = p.add_argument_group("planning")
    g.add_argument("--plan", metavar="TOPOLOGY",
                   help="compile one training step for this TPU topology (e.g. v5p:4x4x4; libtpu wheel, no TPU "
                        "needed) and print memory, collectives and overlap instead of training")
    return p


def parse_args(argv=None) -> TrainConfig:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(ns))
    except ValueError as e:
        parser.error(str(e))


def _pod_environment() -> bool:
    """A multi-host TPU slice announces its workers; jax.distributed then auto-detects the rest."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def _no_cache_loads_over_gloo() -> None:
    """From jax 0.12.1, CPU processes that load a program with collectives from the persistent
    compilation cache hang in its first collective (gloo over loopback; 0.10.2 runs it): such runs
    compile instead, and say so."""
    if jax.__version_info__ >= (0, 12, 1) and jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_enable_compilation_cache", False)
        print(f"persistent compilation cache off ({jax.config.jax_compilation_cache_dir}): jax "
              f"{jax.__version__} hangs in the first collective of a program it loads from it on CPU processes")


def init_jax(cfg: TrainConfig) -> None:
    """Recommended XLA flags, simulated CPU devices and the multi-process runtime, before JAX's backend starts."""
    if cfg.xla_flags:
        from jax_cp import plan

        # what the planner assumes (xla_flags_for); user-set flags keep their value
        applied = plan.apply_for_this_host(fsdp=cfg.fsdp is not False)
        if applied:
            print(f"{applied[0]}={applied[1]}  (jax_cp.plan.recommended_xla_flags; --no-xla-flags to skip)")
    if cfg.devices is not None:
        jax.config.update("jax_num_cpu_devices", cfg.devices)
    if cfg.coordinator is not None:
        if "cpu" in os.environ.get("JAX_PLATFORMS", "") or cfg.devices is not None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            _no_cache_loads_over_gloo()
        jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id,
                                   initialization_timeout=120, heartbeat_timeout_seconds=cfg.heartbeat_timeout,
                                   shutdown_timeout_seconds=30)
    elif _pod_environment():
        jax.distributed.initialize(heartbeat_timeout_seconds=cfg.heartbeat_timeout)
    if cfg.devices is not None and jax.default_backend() != "cpu":
        raise ValueError(f"--devices={cfg.devices} simulates CPU devices, but the platform is "
                         f"{jax.default_backend()!r}; drop --devices there.")


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run needs besides its config, checked before anything is allocated."""

    mesh: jax.sharding.Mesh
    train_windows: data_lib.Windows
    eval_windows: data_lib.Windows
    balance: str | None  # the order of the batches: one of BALANCES, or None (natural)
    dual_chunk: np.ndarray | None  # the dual-chunk order [S] (natural index at each slot), where cp_colossal > 1
    batch_sharding: NamedSharding
    prefix_lm: float | None = None  # the prefix-LM share of each document (TrainConfig.prefix_lm), or None
    per_batch_exchange: bool = False  # each step takes its batch's plan's K/V exchange (global_batch's "kv_exchange")
    exchange_note: str = ""  # the K/V exchange the steps run, in the log's words
    dispatch_chunks: int | None = None  # chunks per colossal rank of each dispatch plan (None: the plan's default)


def _exchange_policy(cfg: TrainConfig, balance: str | None) -> tuple[bool, str]:
    """Whether each step runs its batch's dispatch-plan exchange (``Attended``), and the log's words for it."""
    if cfg.kv_exchange != "auto":
        return False, f"--kv-exchange {cfg.kv_exchange} on every step"
    if balance != "dispatch":
        return False, "auto on every step (no dispatch plan to size an Attended exchange)"
    return True, ("the dispatch plan's Attended exchange per batch (auto where a rank's queries need every key, or "
                  f"past {MAX_EXCHANGES - 1} values)")


def setup(cfg: TrainConfig, devices=None) -> Setup:
    """Mesh, model shapes and data; every problem here is a ``ValueError`` naming the fix."""
    devices = jax.devices() if devices is None else list(devices)
    mesh = jax_cp.make_mesh(cp_colossal=cfg.cp_colossal, cp_ulysses=cfg.cp_ulysses, tp=cfg.tp, dp=cfg.dp,
                            devices=devices, axis_types=AxisType.Auto)
    dims = jax_cp.mesh_dims(mesh)
    if cfg.model not in ("tiny", "hybrid-tiny") and jax.default_backend() == "cpu":
        raise ValueError(f"--model={cfg.model!r} does not fit a CPU; train --model tiny here (the large configs "
                         "are for accelerators and for planning: models.llama.abstract_model).")
    _check_batch(cfg, dims.dp)
    model_cfg = model_config(cfg)
    abstract_model(model_cfg, mesh, **_model_kwargs(cfg, mesh))  # head/kernel/exchange checks, no memory
    if jax.process_count() > 1:
        _check_same_flags(cfg)
    saved = _saved_steps(cfg.ckpt_dir)
    if saved and cfg.checkpoint_every and not cfg.resume:
        raise ValueError(f"{cfg.ckpt_dir} already holds checkpoints (up to step {saved[-1]}); pass --resume to "
                         "continue them, or another --out/--checkpoint-dir to start afresh.")
    corpus = data_lib.load_corpus(cfg.data, **hf.corpus_options(cfg.init_from))
    train_windows = data_lib.Windows(corpus.train, cfg.seq_len, cfg.seed, eod=corpus.eod)
    eval_windows = data_lib.Windows(corpus.eval, cfg.seq_len, seed=1_000_003, eod=corpus.eod)
    balance = cfg.balance if cfg.load_balance and dims.c > 1 else None
    dual_chunk = None
    if dims.c > 1 and cfg.seq_len % (2 * dims.c) == 0:
        dual_chunk = np.asarray(load_balance.positions(cfg.seq_len, mesh))  # natural index of each balanced slot
    chunks = cfg.dispatch_chunks or getattr(model_cfg, "dispatch_chunks", None)
    return Setup(mesh, train_windows, eval_windows, balance, dual_chunk, NamedSharding(mesh, Sharding().tokens_BS),
                 cfg.prefix_lm, *_exchange_policy(cfg, balance), dispatch_chunks=chunks)


def global_batch(s: Setup, windows: data_lib.Windows, step: int, batch: int) -> tuple[dict, dict]:
    """The global batch of ``step`` in the order of ``s.balance``, and what that order costs attention.

    Returns ``(arrays, balance)``: ``balance["imbalance"]`` is the slowest CP rank's visible (query,
    key) pairs over the mean (worst dp shard) in the order used, ``balance["imbalance_dual_chunk"]``
    the same for the dual-chunk order of the same rows (``None`` where it does not exist), over this
    process's dp shards. A dispatch plan reorders each row its own way: the arrays keep their shapes
    and dtypes, so the order alone does not recompile the step. ``balance["kv_exchange"]``: where
    ``s.per_batch_exchange``, the ``Attended`` exchange serving every dp shard's plan (the same on
    every process), or ``None`` where a rank's queries need every key; else ``None``.
    """
    dims = jax_cp.mesh_dims(s.mesh)
    rows = data_lib.process_rows(s.batch_sharding, batch, windows.seq_len)
    local = windows.rows(step, batch, rows)
    if s.prefix_lm:
        local = data_lib.prefix_lm(local, s.prefix_lm)
    held = dataclasses.replace(dims, dp=len(rows) * dims.dp // batch)  # this process's dp shards
    measure = lambda balanced: load_balance.fixed(local["segment_ids"], held, balanced=balanced,
                                                  positions=local["positions"],
                                                  span_ids=local.get("span_ids")).imbalance()
    exchange = None
    if s.balance == "dispatch":
        plans = data_lib.plan_rows(local, s.mesh, rows, batch, chunks_per_rank=s.dispatch_chunks)  # one per dp shard
        order, used = np.concatenate([d.perm for d in plans]), max(d.imbalance() for d in plans)
        exchange = _planned_exchange(plans) if s.per_batch_exchange else None
    else:
        order = s.dual_chunk if s.balance == "dual-chunk" else None
        used = measure(s.balance == "dual-chunk")
    dual = None if s.dual_chunk is None else measure(True)
    return data_lib.place(local, s.batch_sharding, batch, order=order), {"imbalance": used,
                                                                         "imbalance_dual_chunk": dual,
                                                                         "kv_exchange": exchange,
                                                                         "slots": _slots(local, order, dims)}


def _slots(local: dict, order, dims) -> tuple[int, int] | None:
    """The state slots a linear layer needs for these rows in this order (``None`` without CP): over
    ``cp_colossal`` (the state passing) and over both CP axes (the convolution's halo)."""
    if dims.c * dims.u == 1:
        return None
    pos, seg = (local[k] if order is None else local[k][:, order] if np.ndim(order) == 1
                else np.take_along_axis(local[k], order, axis=1) for k in ("positions", "segment_ids"))
    return linear.needed_pieces(pos, seg, dims.c), linear.needed_pieces(pos, seg, dims.c * dims.u)


def check_linear_slots(model_cfg, slots: tuple[int, int] | None, seq_len: int, dims) -> None:
    """A hybrid model's linear layers hold ``linear_max_pieces`` state slots per rank (traced metadata:
    ``GatedDeltaNetSpec.held_slots``); a batch order needing more would come out NaN inside the step,
    so it is a ValueError here, on the host, first."""
    if slots is None or not isinstance(model_cfg, HybridConfig):
        return
    held = model_cfg.linear.held_slots(seq_len, dims)
    for need, have, what in zip(slots, held, ("cp_colossal rank (state passing)", "CP device (convolution halo)")):
        if need > have:
            raise ValueError(f"linear_max_pieces={model_cfg.linear_max_pieces} gives {have} state slots per {what}, "
                             f"but this batch's order needs {need}: its linear layers would return NaN. Use a "
                             f"HybridConfig with linear_max_pieces={need} or more (a dispatch plan needs at most "
                             "twice its chunks per rank, plus one).")


def linear_pieces(model_cfg, slots: tuple[int, int] | None, seq_len: int, dims) -> int | None:
    """The state slots a hybrid model's linear layers hold in the step of a batch needing ``slots``
    (``_slots``): ``None`` (the layers' own ``linear_max_pieces``) without linear layers or CP, or where
    the configuration fixes them (checked: ``check_linear_slots``); else the batch's need rounded up to a
    power of two, the largest over processes (each counts its own rows): a static argument of the step,
    so each value compiles once and a step moves only the states its order needs."""
    if slots is None or not isinstance(model_cfg, HybridConfig):
        return None
    if model_cfg.linear_max_pieces is not None:
        check_linear_slots(model_cfg, slots, seq_len, dims)
        return None
    need = max(slots)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        need = int(np.max(multihost_utils.process_allgather(np.int32(need))))
    return linear.sized_pieces(need)


def _planned_exchange(plans: list[load_balance.Dispatch]):
    """The ``Attended`` exchange serving every plan (the largest buffers, agreed by every process: each
    plans its own dp shards), or ``None`` where some rank's queries need all the other ranks' keys."""
    exchanges = [d.kv_exchange for d in plans]  # one block length and transport per batch shape
    buffers = np.max([ex.buffers() for ex in exchanges], axis=0)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        buffers = np.asarray(multihost_utils.process_allgather(buffers)).max(axis=0)
    rows, S, c = plans[0].perm.shape[0], plans[0].perm.shape[1], plans[0].dims.c
    every = rows * (S - S // c) if exchanges[0].capacity is not None else S // c  # every other rank's keys
    if buffers.max() * exchanges[0].block >= every:
        return None  # buffers for every key: the configured exchange, without Attended's block bookkeeping
    return exchanges[0].with_buffers(buffers)


class _ExchangeCap:
    """At most ``MAX_EXCHANGES`` exchanges a run: the configured one (``None``) and the first
    ``MAX_EXCHANGES - 1`` ``Attended`` values; a batch wanting another takes the smallest of those
    whose buffers hold its blocks, else the configured one. Deterministic, so every process agrees."""

    def __init__(self):
        self.used: list = []

    def __call__(self, exchange):
        """The exchange a batch wanting ``exchange`` (``None``: the configured one) runs."""
        if exchange is None or exchange in self.used:
            return exchange
        if len(self.used) < MAX_EXCHANGES - 1:
            self.used.append(exchange)
            return exchange
        fits = [ex for ex in self.used if ex.holds(exchange)]
        return min(fits, key=lambda ex: ex.received_tokens(), default=None)


def _check_batch(cfg: TrainConfig, dp: int) -> None:
    if cfg.batch % dp:
        raise ValueError(f"--batch={cfg.batch} is not divisible by dp={dp}; use a multiple of {dp}.")


def _check_same_flags(cfg: TrainConfig) -> None:
    """Processes started with different flags would hang in mismatched collectives; fail instead."""
    from jax.experimental import multihost_utils

    flags = dataclasses.asdict(cfg) | {"process_id": None, "ckpt_dir": str(cfg.ckpt_dir.absolute())}
    digest = hashlib.sha256(json.dumps(flags, sort_keys=True).encode()).digest()
    try:
        multihost_utils.assert_equal(np.frombuffer(digest[:16], np.int32), "flags differ")
    except AssertionError:
        raise ValueError("the processes were started with different flags; all but --process-id must match "
                         "(--out and --checkpoint-dir included: checkpoints need one shared directory).") from None


def model_config(cfg: TrainConfig):
    """The ``LlamaConfig`` (or ``models.hybrid.HybridConfig``) of ``--model`` with the run's attention options
    (soft cap, sinks)."""
    base = get_config(cfg.model) if cfg.init_from is None else hf.finetune_config(cfg.init_from, cfg.rope_scaling)[0]
    cap = base.logits_soft_cap if cfg.logits_soft_cap is None else cfg.logits_soft_cap
    if cfg.linear_pieces is not None:
        if not isinstance(base, HybridConfig):
            raise ValueError(f"--linear-pieces={cfg.linear_pieces} sizes the linear layers of a hybrid model; "
                             f"--model {cfg.model} has none: drop it.")
        base = dataclasses.replace(base, linear_max_pieces=cfg.linear_pieces)
    return dataclasses.replace(base, logits_soft_cap=cap, use_sinks=base.use_sinks or cfg.use_sinks)


FSDP_AUTO_BYTES = 256 * 2**20  # --fsdp auto: replicated training state per device from which FSDP stores it


@functools.lru_cache(maxsize=16)
def fsdp_choice(cfg: TrainConfig, dims: jax_cp.MeshDims) -> tuple[bool, str]:
    """``(fsdp, why)``: whether the run stores parameters and AdamW moments sharded over ``--fsdp-axes``.

    ``--fsdp``/``--no-fsdp`` decide; ``auto`` shards them where, replicated over those axes, they would
    take ``FSDP_AUTO_BYTES`` or more a device (12 bytes a parameter: float32 weights and two moments,
    over tp): a model that small costs little memory replicated, while each layer's weight all-gathers
    would still cost time (benchmarks/RESULTS.md, "A whole training step").
    """
    if cfg.fsdp != "auto":
        return bool(cfg.fsdp), "--fsdp" if cfg.fsdp else "--no-fsdp"
    sizes = dataclasses.asdict(dims)
    n = math.prod(sizes[{"cp_colossal": "c", "cp_ulysses": "u"}.get(a, a)] for a in cfg.fsdp_axes_tuple)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(model_config(cfg)), nnx.Param)))
    replicated = 12 * params / dims.t
    say = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"  # noqa: E731
    if n == 1:
        return False, f"auto: the --fsdp-axes {cfg.fsdp_axes} have one device"
    if replicated >= FSDP_AUTO_BYTES:
        return True, (f"auto: parameters and AdamW moments take {say(replicated)} a device replicated over "
                      f"{cfg.fsdp_axes} ({n} devices), {say(replicated / n)} sharded")
    return False, (f"auto: parameters and AdamW moments take {say(replicated)} a device replicated, under "
                   f"{say(FSDP_AUTO_BYTES)}: replicated, no weight all-gathers")


def residual_dtype(cfg: TrainConfig) -> str:
    """The residual stream's dtype name: ``--residual-dtype``, or the compute ``--dtype`` for ``auto``."""
    return cfg.dtype if cfg.residual_dtype == "auto" else cfg.residual_dtype


def _model_kwargs(cfg: TrainConfig, mesh) -> dict:
    fsdp, _ = fsdp_choice(cfg, jax_cp.mesh_dims(mesh))
    return dict(dtype=jnp.dtype(cfg.dtype), fsdp=fsdp, fsdp_axes=cfg.fsdp_axes_tuple,
                remat=cfg.remat and ("full" if cfg.remat_policy == "auto" else cfg.remat_policy),
                scan_layers=cfg.scan_layers, residual_dtype=jnp.dtype(residual_dtype(cfg)), kernel=cfg.kernel,
                kv_exchange=cfg.kv_exchange, overlap_chunks=cfg.overlap_chunks,
                fused_qkv_chunks=cfg.fused_qkv_chunks)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup, decay_steps=cfg.steps,
        end_value=cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # no decay on norms
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask))
    return tx, schedule


# ----------------------------------------------------------------------------- checkpoints

_META_KEYS = ("model", "seq_len", "batch", "seed", "data", "steps", "lr", "warmup", "dtype", "logits_soft_cap",
              "use_sinks")  # the last three: what models.generate rebuilds the model with


def _manager(cfg: TrainConfig) -> ocp.CheckpointManager:
    if jax.process_count() > 1:
        # Orbax's default barrier is a device collective, which can interleave with the training
        # step's collectives in another order on another process (async saves run in a thread) and
        # deadlock; the coordination service's barrier cannot, and it times out.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        flags.FLAGS["experimental_orbax_use_distributed_barrier"].value = True
    # Orbax writes each step into a temporary directory and renames it when complete,
    # so a kill during a save leaves the previous step as the latest usable one.
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, cleanup_tmp_directories=True)
    return ocp.CheckpointManager(cfg.ckpt_dir.absolute(), options=options, item_names=("state", "meta"))


def _saved_steps(directory: Path) -> list[int]:
    """Completed checkpoints (orbax renames a step's directory into place only once it is written)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def _save(mngr, step: int, state, cfg: TrainConfig) -> None:
    meta = {k: getattr(cfg, k) for k in _META_KEYS} | {"step": step}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(nnx.to_pure_dict(state)),
                                            meta=ocp.args.JsonSave(meta)))


def _restore(mngr, state, cfg: TrainConfig) -> int:
    """Loads the latest checkpoint into ``state`` (in place, onto its shardings); returns its step."""
    step = mngr.latest_step()
    if step is None:
        return 0
    pure = nnx.to_pure_dict(state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), pure)
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                     meta=ocp.args.JsonRestore()))
    meta = dict(got["meta"])
    for key in ("model", "seq_len", "batch", "seed", "data"):
        if meta.get(key) != getattr(cfg, key):
            raise UsageError(f"--resume: the checkpoint in {cfg.ckpt_dir} was made with {key}={meta.get(key)!r}, "
                             f"this run has {key}={getattr(cfg, key)!r}; use the same value or another "
                             "--checkpoint-dir.")
    nnx.replace_by_pure_dict(state, got["state"])
    return step


# ----------------------------------------------------------------------------- training


def _log(fh, record: dict) -> None:
    if fh is not None:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def _init_fn(cfg: TrainConfig, mesh, tx):
    """``() -> (model, optimizer)``: the parameters and AdamW state, sharded on ``mesh``."""
    def init():
        config = model_config(cfg)
        model = model_class(config)(config, mesh=mesh, rngs=nnx.Rngs(cfg.seed), **_model_kwargs(cfg, mesh))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    return init


def _use(model, kv_exchange=None, linear_pieces=None):
    """``model`` with every attention layer's exchange and every linear layer's state slots set, where given."""
    if kv_exchange is not None:
        model.use_kv_exchange(kv_exchange)
    if linear_pieces is not None:
        model.use_linear_pieces(linear_pieces)
    return model


def _train_step_fn(graphdef):
    """``(state, batch, kv_exchange=None, linear_pieces=None) -> (state, metrics)``: loss, gradients and the
    optimizer update of one step; static (hashable) arguments, ``None`` the model's own: ``kv_exchange``,
    every attention layer's exchange; ``linear_pieces``, every linear layer's state slots."""
    def train_step(state, batch, kv_exchange=None, linear_pieces=None):
        model, opt = nnx.merge(graphdef, state)
        _use(model, kv_exchange, linear_pieces)
        (loss, _), grads = nnx.value_and_grad(next_token_loss, has_aux=True)(model, batch)
        opt.update(model, grads)
        return nnx.state((model, opt)), {"loss": loss, "grad_norm": optax.global_norm(grads)}
    return train_step


def xla_flags_for(cfg: TrainConfig, chip: str) -> tuple[str, ...]:
    """``jax_cp.plan.recommended_xla_flags`` for a run of ``cfg`` on TPU ``chip``: with the FSDP flags unless
    ``--no-fsdp`` (``--fsdp auto`` is decided after JAX starts, too late for libtpu's flags, so it gets them
    too; they cost a replicated 8B step 1.4 ms of exposed communication in 8 layers: jax_cp/plan/_flags.py)."""
    from jax_cp import plan

    return plan.recommended_xla_flags("tpu", chip=chip, fsdp=cfg.fsdp is not False)


def plan_train_step(cfg: TrainConfig, topology: str | None = None, *, memory_budget: int | None = None,
                    xla_flags: tuple[str, ...] | None = None):
    """Compiles one training step of ``cfg`` for a TPU ``topology`` ahead of time and analyzes it.

    The same step ``train`` runs (model, AdamW state, gradient clipping), on
    the mesh ``cfg`` asks for, laid onto the topology's devices; nothing is
    allocated, so the planning shapes (``--model llama3-8b``) work on a CPU.
    Returns a ``jax_cp.plan.Analysis``: per-device memory (and whether it
    fits), FLOPs, every collective with its overlap, the estimated step time.
    With ``--remat --remat-policy auto`` the step is compiled with each of ``AUTO_REMAT`` in turn until one
    fits the chip (the analysis's label names the policy taken, ``remat=...``). Needs the libtpu wheel
    (``pip install -e '.[tpu-aot]'``).
    """
    from jax_cp import plan

    topology = topology or cfg.plan
    if topology is None:
        raise ValueError("topology=None: name a TPU topology to plan for, e.g. 'v5p:4x4x4'.")
    found = {}  # policy -> its analysis, or the compiler's refusal

    def fits(c: TrainConfig) -> bool:
        try:
            found[c.remat_policy] = a = _plan_one(c, topology, memory_budget, xla_flags)
        except (ValueError, jax.errors.JaxRuntimeError) as e:  # the compiler's out-of-HBM refusal
            if "does not fit" not in str(e) and "RESOURCE_EXHAUSTED" not in str(e):
                raise
            found[c.remat_policy] = e
            return False
        return a.memory.fits

    chosen, _ = resolve_remat(cfg, fits)
    a = found.get(chosen.remat_policy) or _plan_one(chosen, topology, memory_budget, xla_flags)
    if isinstance(a, Exception):  # no policy fits: the last one's refusal, not a second compile of it
        raise a
    return a


def _plan_one(cfg: TrainConfig, topology: str, memory_budget, xla_flags):
    from jax_cp import plan

    mesh = _plan_mesh(cfg, topology)
    _check_batch(cfg, jax_cp.mesh_dims(mesh).dp)
    graphdef, state, batch = _abstract_step(cfg, mesh)
    remat = f" {_REMAT_LABEL}{cfg.remat_policy}" if cfg.remat else ""
    with jax.set_mesh(mesh):  # the state is donated, as train's step does: the peak counts it once
        a = plan.analyze_program(_train_step_fn(graphdef), (state, batch), topology=topology, mesh=mesh,
                                 label=f"train step {cfg.model_name}{remat}", memory_budget=memory_budget,
                                 xla_flags=xla_flags_for(cfg, plan.chip_for(topology).name) if xla_flags is None else xla_flags,
                                 donate_argnums=0)
    if not a.kernel_calls:  # no splash: the compiler counted every FLOP
        return a
    executed = a.flops + splash_flops(cfg, model_config(cfg), jax_cp.mesh_dims(mesh))
    return dataclasses.replace(a, executed_flops=executed, estimate=dataclasses.replace(
        a.estimate, compute_s=executed / plan.chip_for(topology).device_flops))


_REMAT_LABEL = "remat="  # how a planned step's label names its remat policy (planned_remat reads it)


def planned_remat(label: str) -> str | None:
    """The remat policy a planned step's label names (``plan_train_step``: ``auto``'s choice), or None."""
    return label.split(_REMAT_LABEL)[1].split()[0] if _REMAT_LABEL in label else None


def _abstract_step(cfg: TrainConfig, mesh):
    """``(graphdef, state, batch)`` of one training step on ``mesh``: ``jax.ShapeDtypeStruct`` s carrying
    the shardings ``train`` gives them, nothing allocated."""
    tx, _ = make_optimizer(cfg)
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(nnx.eval_shape(_init_fn(cfg, mesh, tx)))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)),
                         state)
    tokens = NamedSharding(mesh, Sharding().tokens_BS)
    fields = data_lib.FIELDS + (("span_ids",) if cfg.prefix_lm else ())  # what global_batch hands the step
    batch = {k: jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), data_lib.FIELD_DTYPES.get(k, np.int32), sharding=tokens)
             for k in fields}
    return graphdef, state, batch


def resolve_remat(cfg: TrainConfig, fits) -> tuple[TrainConfig, str]:
    """``cfg`` with ``--remat-policy auto`` made concrete, and why, in the log's words.

    ``auto`` takes the first of ``AUTO_REMAT`` (keep the attention; recompute all; recompute all with the
    blocks' inputs in host memory) whose step ``fits(cfg)``: ``True``, ``False``, or ``None`` where the
    device states no memory limit (a CPU), which gives ``full``. Where none fits, the last (``offload``).
    Any other policy, or no ``--remat``, is returned as given."""
    if not cfg.remat or cfg.remat_policy != "auto":
        return cfg, "as given"
    for policy in AUTO_REMAT:
        c = dataclasses.replace(cfg, remat_policy=policy)
        ok = fits(c)
        if ok is None:
            return dataclasses.replace(cfg, remat_policy="full"), "auto: the device states no memory limit"
        if ok:
            return c, f"auto: the first of {', '.join(AUTO_REMAT)} whose step fits the device's memory"
    return c, f"auto: none of {', '.join(AUTO_REMAT)} fits the device's memory; the last"


def _memory_limit(mesh) -> int | None:
    """The bytes one of this process's devices of ``mesh`` can hold (``memory_stats``), or None (a CPU)."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    return (device.memory_stats() or {}).get("bytes_limit") or None


def _step_fits(cfg: TrainConfig, mesh) -> bool | None:
    """Whether one training step of ``cfg`` fits a device of ``mesh`` (compiled ahead of time, its memory
    analysis against the device's ``bytes_limit``); ``None`` where the device states no limit."""
    limit = _memory_limit(mesh)
    if not limit:
        return None
    graphdef, state, batch = _abstract_step(cfg, mesh)
    with jax.set_mesh(mesh):
        try:
            compiled = jax.jit(_train_step_fn(graphdef), donate_argnums=0).lower(state, batch).compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e):
                return False
            raise
    if compiled.memory_analysis() is None:  # a backend that gives no memory analysis: as if no limit were stated
        return None
    from jax_cp import plan

    return plan.Memory.of(compiled, limit).fits


def splash_flops(cfg: TrainConfig, model_cfg, dims) -> float:
    """Per-device FLOPs of one training step's splash kernels, which the compiler counts as none.

    Per attention layer and visible (query, key) pair, ``2 d`` FLOPs per matmul and head: the forward's
    2 matmuls, their rerun under ``--remat`` (not with ``--remat-policy attention``), and the backward's 7
    (the dq and dK/dV kernels both recompute the scores). Pairs: one causal document per row (a sliding layer's window), spread
    evenly over ``cp_colossal`` as the load-balanced orders do; heads over ``tp * cp_ulysses``, rows
    over ``dp``.
    """
    S = cfg.seq_len
    matmuls = 2 + (2 if cfg.remat and cfg.remat_policy in ("full", "offload") else 0) + 7
    per_pair = matmuls * 2 * model_cfg.head_dim * (cfg.batch / dims.dp) * model_cfg.num_heads / (dims.t * dims.u)
    total = 0.0
    for layer in range(model_cfg.num_layers):
        if hasattr(model_cfg, "is_attention") and not model_cfg.is_attention(layer):
            continue  # a linear layer: plain JAX, counted by the compiler
        W = model_cfg.sliding_window if model_cfg.is_sliding(layer) else None
        pairs = S * (S + 1) / 2 if W is None or W >= S else W * (W + 1) / 2 + (S - W) * W
        total += per_pair * pairs / dims.c
    return total


def _plan_mesh(cfg: TrainConfig, topology: str):
    from jax_cp import plan

    return plan.topology_mesh(topology, cp_colossal=cfg.cp_colossal, cp_ulysses=cfg.cp_ulysses, tp=cfg.tp,
                              dp=cfg.dp, axis_types=AxisType.Auto)


def _plan_main(cfg: TrainConfig) -> None:
    from jax_cp import plan

    a = plan_train_step(cfg)
    plan_mesh = _plan_mesh(cfg, cfg.plan)
    mesh, dims = " ".join(f"{k}={v}" for k, v in plan_mesh.shape.items()), jax_cp.mesh_dims(plan_mesh)
    chip = plan.chip_for(cfg.plan)
    source = f" (--init-from {cfg.init_from}: its config.json, no weights read)" if cfg.init_from else ""
    print(f"jax_cp plan: one training step of {cfg.model_name}{source} on {cfg.plan} ({chip.device_kind}), "
          f"mesh {mesh}\nB={cfg.batch} S={cfg.seq_len} dtype={cfg.dtype} fsdp={_fsdp_words(cfg, dims)} "
          f"remat={planned_remat(a.label) or False} "
          f"kernel={cfg.kernel} kv_exchange={cfg.kv_exchange} overlap_chunks={cfg.overlap_chunks} "
          f"fused_qkv_chunks={cfg.fused_qkv_chunks}\n"
          f"flags: {' '.join(xla_flags_for(cfg, chip.name))}\n")
    print(plan.format_programs([a], grouped=True))


def _fsdp_words(cfg: TrainConfig, dims) -> str:
    fsdp, why = fsdp_choice(cfg, dims)
    return f"{cfg.fsdp_axes if fsdp else 'off'} ({why})"


def train(cfg: TrainConfig, s: Setup) -> dict:
    """Runs the training loop; returns the summary (also written to ``OUT/summary.json``)."""
    t0 = time.perf_counter()
    main_process = jax.process_index() == 0
    cfg, remat_why = resolve_remat(cfg, lambda c: _step_fits(c, s.mesh))
    if main_process and cfg.remat:
        print(f"remat: {cfg.remat_policy} ({remat_why})", file=sys.stderr)
    out = Path(cfg.out)
    model_cfg = model_config(cfg)
    tx, schedule = make_optimizer(cfg)
    with jax.set_mesh(s.mesh):
        graphdef, state = nnx.split(nnx.jit(_init_fn(cfg, s.mesh, tx))())
    if cfg.init_from:  # the checkpoint's weights, each in its parameter's sharding (--resume restores over them)
        model, opt = nnx.merge(graphdef, state)
        hf.read_params(model, cfg.init_from)
        state = nnx.state((model, opt))
    shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step = _train_step_fn(graphdef)

    def eval_step(state, batch, linear_pieces=None):
        model, _ = nnx.merge(graphdef, state)
        return next_token_loss(_use(model, linear_pieces=linear_pieces), batch)

    train_step = jax.jit(train_step, out_shardings=(shardings, None), donate_argnums=0,
                         static_argnames=("kv_exchange", "linear_pieces"))  # one program per value
    eval_step = jax.jit(eval_step, static_argnames="linear_pieces")

    mngr = _manager(cfg) if (cfg.checkpoint_every or cfg.resume) else None
    start = 0
    if cfg.resume:
        with jax.set_mesh(s.mesh):
            start = _restore(mngr, state, cfg)
        if main_process:
            print(f"resuming from step {start} of {cfg.ckpt_dir}" if start else
                  f"--resume: no checkpoint in {cfg.ckpt_dir} yet; starting at step 0", file=sys.stderr)
    if start >= cfg.steps:
        mngr.close()
        if main_process:
            print(f"--resume: the checkpoint in {cfg.ckpt_dir} is at step {start} >= --steps={cfg.steps}; "
                  "nothing to do.")
        return {"start_step": start, "steps": cfg.steps, "losses": {}}

    def evaluate(state):
        losses = []
        for i in range(cfg.eval_batches):
            batch, balance = global_batch(s, s.eval_windows, i, cfg.batch)
            pieces = linear_pieces(model_cfg, balance["slots"], cfg.seq_len, dims)
            losses.append(eval_step(state, batch, linear_pieces=pieces))
        num = sum(float(l) * float(c) for l, c in losses)
        return num / max(sum(float(c) for _, c in losses), 1.0)

    fh = None
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        fh = open(out / "metrics.jsonl", "a" if cfg.resume else "w")
    dims = jax_cp.mesh_dims(s.mesh)
    _log(fh, {"event": "start", "step": start, "processes": jax.process_count(), "devices": jax.device_count(),
              "mesh": dataclasses.asdict(dims), "config": dataclasses.asdict(cfg), "kv_exchange": s.exchange_note})
    tokens_per_step = cfg.batch * cfg.seq_len
    losses, eval_loss, compile_s, timed_s, n_timed, balances, exchanges = {}, None, 0.0, 0.0, 0, [], {}
    cap = _ExchangeCap()
    bar = tqdm(total=cfg.steps, initial=start, disable=not (main_process and cfg.progress), dynamic_ncols=True,
               mininterval=1.0, file=sys.stderr, desc=f"train {cfg.model_name}")
    with jax.set_mesh(s.mesh):
        for step in range(start + 1, cfg.steps + 1):
            t_step = time.perf_counter()
            batch, balance = global_batch(s, s.train_windows, step - 1, cfg.batch)
            pieces = linear_pieces(model_cfg, balance.pop("slots"), cfg.seq_len, dims)
            exchange, programs = cap(balance.pop("kv_exchange")), train_step._cache_size()
            state, metrics = train_step(state, batch, kv_exchange=exchange, linear_pieces=pieces)
            loss = float(metrics["loss"])
            now = time.perf_counter()
            if train_step._cache_size() > programs:  # it compiled (the first step, a new exchange's first)
                compile_s += now - t_step  # left out of the throughput
            else:
                timed_s, n_timed = timed_s + now - t_step, n_timed + 1
            losses[step] = loss
            tps = tokens_per_step * n_timed / timed_s if timed_s else None
            name = cfg.kv_exchange if exchange is None else str(exchange)
            exchanges[name] = exchanges.get(name, 0) + 1
            record = {"event": "train", "step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                      "lr": float(schedule(step - 1)), "step_s": now - t_step, "tokens_per_s": tps, **balance,
                      "kv_exchange": name, **({} if pieces is None else {"linear_pieces": pieces})}
            _log(fh, record)
            balances.append(balance)
            bar.set_postfix({"loss": f"{loss:.3f}", "tok_s": f"{tps or 0:.0f}", **_balance_postfix(balance)},
                            refresh=False)
            bar.update(1)
            if cfg.eval_batches and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
                eval_loss = evaluate(state)
                _log(fh, {"event": "eval", "step": step, "eval_loss": eval_loss})
                bar.write(f"step {step}: eval loss {eval_loss:.4f}") if main_process and cfg.progress else None
            # On a pod, SIGTERM (a preemption notice) reaches every process at the same step: save, stop.
            preempted = cfg.checkpoint_every > 0 and jax.process_count() > 1 and mngr.reached_preemption(step)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps or preempted):
                _save(mngr, step, state, cfg)
                _log(fh, {"event": "checkpoint", "step": step})
            if preempted:
                _log(fh, {"event": "preempted", "step": step})
                break
            if cfg.debug_step_sleep:
                time.sleep(cfg.debug_step_sleep)
    bar.close()
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    if cfg.init_from:  # the fine-tuned model in the checkpoint's layout (and its tokenizer), by every process
        with jax.set_mesh(s.mesh):
            hf.save(nnx.merge(graphdef, state)[0], out / "hf", hf.finetune_config(cfg.init_from, cfg.rope_scaling)[1],
                    copy_from=cfg.init_from)
    last = max(losses)
    summary = {
        "model": cfg.model, "mesh": dataclasses.asdict(dims), "processes": jax.process_count(),
        "devices": jax.device_count(), "platform": jax.default_backend(), "start_step": start,
        "steps": last, "preempted": last < cfg.steps, "first_loss": losses[start + 1], "last_loss": losses[last],
        "eval_loss": eval_loss,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * n_timed / timed_s if n_timed else None,
        "compile_s": compile_s, "wall_s": time.perf_counter() - t0, "balance": s.balance,
        "step_compiles": train_step._cache_size(),  # one per K/V exchange used: more would mean a retrace
        "kv_exchange": s.exchange_note, "kv_exchange_steps": exchanges, "fsdp": _fsdp_words(cfg, dims),
        **{f"{k}_mean": _mean([b[k] for b in balances]) for k in ("imbalance", "imbalance_dual_chunk")},
        "losses": losses,
    }
    _log(fh, {"event": "end", **{k: v for k, v in summary.items() if k != "losses"}})
    if main_process:
        fh.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        plot_losses(out / "metrics.jsonl", out / "loss.png")
    return summary


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _balance_postfix(balance: dict) -> dict:
    """Progress-bar fields: the slowest CP rank's attention work / mean, this order (and dual-chunk's)."""
    dual = balance["imbalance_dual_chunk"]
    return {"imbalance": f"{balance['imbalance']:.3f}" + ("" if dual is None else f" (dual-chunk {dual:.3f})")}


def _balance_line(summary: dict) -> str:
    """One line: the mean over the run of the slowest CP rank's attention work over the mean."""
    dual = summary.get("imbalance_dual_chunk_mean")
    return (f"attention work of the slowest CP rank / mean, over steps {summary['start_step'] + 1}-"
            f"{summary['steps']}: {summary['imbalance_mean']:.4f} ({summary['balance'] or 'natural order'})"
            + ("" if dual is None else f", dual-chunk order {dual:.4f}"))


def _exchange_line(summary: dict) -> str:
    """One line: the K/V exchange the steps ran, and on how many steps each value (one compiled step each)."""
    steps = ", ".join(f"{name} {n}" for name, n in summary["kv_exchange_steps"].items())
    return f"K/V exchange: {summary['kv_exchange']}; steps per value: {steps}"


def read_metrics(path) -> tuple[dict[int, float], dict[int, float]]:
    """Train and eval losses by step from a JSONL log; a resumed step keeps its latest value."""
    train, evals = {}, {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "train":
            train[rec["step"]] = rec["loss"]
        elif rec["event"] == "eval":
            evals[rec["step"]] = rec["eval_loss"]
    return train, evals


def plot_losses(metrics_path, png_path) -> None:
    # A bare Figure (no pyplot): renders off-screen without changing the process's backend.
    from matplotlib.figure import Figure

    train, evals = read_metrics(metrics_path)
    fig = Figure(figsize=(6, 3.5), dpi=120)
    ax = fig.subplots()
    ax.plot(list(train), list(train.values()), lw=1, label="train")
    if evals:
        ax.plot(list(evals), list(evals.values()), "o-", ms=3, label="held-out")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"{png_path.parent.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)


def run(cfg: TrainConfig, devices=None) -> dict:
    """Trains in this process (JAX already initialised) on ``devices``; returns the summary."""
    return train(cfg, setup(cfg, devices=devices))


def main(argv=None) -> None:
    cfg = parse_args(argv)
    if cfg.plan is not None:
        try:
            _plan_main(cfg)
        except ValueError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            raise SystemExit(2) from None
        return
    try:
        init_jax(cfg)
        prepared = setup(cfg)
    except ValueError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        raise SystemExit(2) from None
    try:
        summary = train(cfg, prepared)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        raise SystemExit(2) from None
    if summary.get("preempted"):
        raise SystemExit(f"preempted after step {summary['steps']}; the checkpoint is saved, rerun with --resume.")
    if jax.process_index() == 0 and summary["losses"]:
        print(f"trained {cfg.model_name} steps {summary['start_step'] + 1}-{cfg.steps} on {summary['devices']} "
              f"{summary['platform']} devices: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
              + (f"eval {summary['eval_loss']:.3f}, " if summary["eval_loss"] is not None else "")
              + f"{summary['tokens_per_s'] or float('nan'):.0f} tokens/s, "
              f"{summary['wall_s']:.0f} s (compile {summary['compile_s']:.0f} s, the step compiled "
              f"{summary['step_compiles']} time(s)); logs in {cfg.out}")
        print(_balance_line(summary))
        print(_exchange_line(summary))
        print(f"fsdp: {summary['fsdp']}")


if __name__ == "__main__":
    main()
