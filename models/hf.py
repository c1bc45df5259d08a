"""Hugging Face checkpoints on a CP mesh: ``config.json`` + ``model*.safetensors`` <-> ``models.llama.Llama``.

``load(path, mesh)`` reads every parameter straight into an array already sharded on ``mesh``: each
process reads, with safetensors' ``get_slice``, only the slices its devices hold (a slice that several
of its devices share is read once), so a process's host memory and bytes read follow its shard.
``save(model, path, hf_config)`` writes the same layout back (``model.safetensors``, or numbered files
and ``model.safetensors.index.json``; with several processes each writes its own files), and
``load(save(...))`` is exact. Families and name mapping: ``models.families``. Tokenizers:
``load_tokenizer`` (the ``tokenizers`` package). Letters: D model width, N heads, d head dim.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cp

from models import families
from models.families import Tensor, config_from_hf, config_to_hf, family_of
from models.llama import Llama, LlamaConfig

__all__ = ["Reader", "corpus_options", "eos_token_id", "extend_context", "finetune_config", "load", "load_tokenizer",
           "read_config", "read_params", "save", "tensor_shapes"]

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
ITEMSIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}  # safetensors' floating dtypes
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; the model computes them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def read_config(path) -> dict:
    """The ``config.json`` of checkpoint folder ``path``."""
    f = Path(path) / CONFIG
    if not f.is_file():
        raise ValueError(f"{path}: no {CONFIG}; a Hugging Face checkpoint folder holds config.json and "
                         "model*.safetensors.")
    return json.loads(f.read_text())


class Reader:
    """Tensor slices of a checkpoint folder by name, through ``safe_open(...).get_slice(name)[...]``.

    ``bytes_read`` counts the bytes of every slice read (for measuring that a process reads its share).
    """

    def __init__(self, path):
        from safetensors import safe_open

        self.path, self.bytes_read, self._open = Path(path), 0, safe_open
        index = self.path / INDEX
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(self.path / SINGLE, framework="np") as f:
                self.files = {name: SINGLE for name in f.keys()}
        else:
            raise ValueError(f"{path}: no {SINGLE} or {INDEX}.")
        self._handles = {}

    def _slice(self, name):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(self.path / file, framework="np").__enter__()
        return self._handles[file].get_slice(name)

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def itemsize(self, name) -> int:
        """Bytes per element of tensor ``name`` in its file."""
        return ITEMSIZES[self._slice(name).get_dtype()]

    def read(self, name, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` (basic slices only), counted in ``bytes_read``."""
        block = self._slice(name)[index]
        self.bytes_read += block.nbytes
        return block

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles = {}


def _stored_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint shape of a model parameter of ``shape``."""
    if t.layout == "T":
        return shape[::-1]
    if t.layout == "heads_out":  # [D, N, d] <- [N*d, D]
        return (shape[1] * shape[2], shape[0])
    if t.layout == "heads_in":  # [N, d, D] <- [D, N*d]
        return (shape[2], shape[0] * shape[1])
    return shape


def read_block(reader: Reader, t: Tensor, index: tuple[slice, ...], shape) -> np.ndarray:
    """The model-layout block ``param[index]`` of tensor ``t`` (float32), reading only the rows it needs."""
    idx = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    if t.layout == "T":
        block = reader.read(t.name, idx[::-1]).T
    elif t.layout == "heads_out":
        (sD, sN, sd), d = idx, shape[2]
        rows = reader.read(t.name, (slice(sN.start * d, sN.stop * d), sD))
        block = rows.reshape(sN.stop - sN.start, d, -1)[:, sd, :].transpose(2, 0, 1)
    elif t.layout == "heads_in":
        (sN, sd, sD), d = idx, shape[1]
        cols = reader.read(t.name, (sD, slice(sN.start * d, sN.stop * d)))
        block = cols.reshape(-1, sN.stop - sN.start, d)[:, :, sd].transpose(1, 2, 0)
    else:
        block = reader.read(t.name, idx)
    block = np.asarray(block, np.float32)
    if t.offset:
        block = block + np.float32(t.offset)
    return block * np.float32(t.scale) if t.scale != 1.0 else block


def _check_names(reader: Reader, expected: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Every expected tensor present with its shape; nothing else but ignorable buffers."""
    for name, shape in expected.items():
        if name not in reader.files:
            raise ValueError(f"{reader.path}: tensor {name!r} is missing (expected shape {list(shape)}).")
        if reader.shape(name) != shape:
            raise ValueError(f"{reader.path}: tensor {name!r} has shape {list(reader.shape(name))}, expected "
                             f"{list(shape)} from config.json; the config and the weights do not match.")
    extra = sorted(n for n in reader.files if n not in expected and not n.endswith(IGNORED)
                   and not (tied and n == "lm_head.weight"))
    if extra:
        raise ValueError(f"{reader.path}: tensor {extra[0]!r} (and {len(extra) - 1} more) is not part of the "
                         f"model config.json describes; {len(expected)} tensors expected.")


def tensor_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint with this ``config.json`` holds, and its shape (nothing allocated)."""
    cfg = config_from_hf(hf_config)
    mesh = jax_cp.make_mesh(devices=jax.devices()[:1], axis_types=AxisType.Auto)
    table = families.tensors(cfg, family_of(hf_config), hf_config)
    abstract = nnx.eval_shape(lambda: Llama(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    return {table[p].name: _stored_shape(table[p], v.shape) for p, v in _params(abstract)}


def _params(model_or_abstract):
    """``(path, nnx.Param)`` of every parameter, paths as ``models.families.tensors`` keys."""
    return [(tuple(path), var) for path, var in nnx.to_flat_state(nnx.state(model_or_abstract, nnx.Param))]


def _sharding(var, mesh) -> NamedSharding:
    return NamedSharding(mesh, P(*var.get_metadata()["out_sharding"]))


def load(path, mesh, *, reader: Reader | None = None, **model_kw) -> tuple[Llama, dict]:
    """The checkpoint in folder ``path`` as a ``Llama`` on ``mesh``, and its ``config.json``.

    Args:
        path: a folder with ``config.json`` and ``model.safetensors`` (or ``model-*.safetensors`` and
            ``model.safetensors.index.json``).
        mesh: the mesh (``jax_cp.make_mesh``); every process of a multi-process run calls ``load``.
        reader: a ``Reader`` of ``path`` (to read its ``bytes_read`` afterwards); default: a new one.
        **model_kw: ``Llama``'s options (``dtype``, ``fsdp``, ``kernel``, ...).

    Returns:
        ``(model, config)``: parameters float32, each sharded as ``Llama`` places it; ``config`` is
        the ``config.json`` dict (``save`` writes it back).

    Raises:
        ValueError: an unsupported architecture or config value (the key named), a missing,
            unexpected or mis-shaped tensor (the tensor named).
    """
    hf = read_config(path)
    cfg = config_from_hf(hf)
    abstract = nnx.eval_shape(lambda: Llama(cfg, mesh=mesh, rngs=nnx.Rngs(0), **model_kw))
    graphdef, state = nnx.split(abstract)
    values = _read_values(path, hf, cfg, _params(abstract), mesh, reader)
    pure = {}
    for p, value in values.items():
        node = pure
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = value
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), hf


def read_params(model: Llama, path, *, reader: Reader | None = None) -> dict:
    """Sets ``model``'s parameters (in place, each keeping its sharding) from the checkpoint in ``path``.

    ``model.cfg`` may differ from the checkpoint's in what leaves the tensors alone (e.g. its RoPE:
    ``extend_context``). Returns the checkpoint's ``config.json``.

    Raises:
        ValueError: as ``load``.
    """
    hf = read_config(path)
    params = _params(model)
    values = _read_values(path, hf, model.cfg, params, model.mesh, reader)
    for p, var in params:
        var.value = values[p]
    return hf


def _read_values(path, hf: dict, cfg, params, mesh, reader: Reader | None) -> dict:
    """Every parameter of ``params`` (``_params``) read from the checkpoint, sharded as it is."""
    table = families.tensors(cfg, family_of(hf), hf)
    reader = reader or Reader(path)
    try:
        _check_names(reader, {table[p].name: _stored_shape(table[p], v.shape) for p, v in params},
                     cfg.tie_embeddings)
        return {p: _read_param(reader, table[p], v.shape, _sharding(v, mesh)) for p, v in params}
    finally:
        reader.close()


def _read_param(reader: Reader, t: Tensor, shape, sharding) -> jax.Array:
    """One parameter as a global array, each distinct shard of this process's devices read once."""
    cache = {}

    def shard(index):
        key = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
        key_hash = tuple((s.start, s.stop) for s in key)
        if key_hash not in cache:
            cache[key_hash] = read_block(reader, t, key, shape)
        return cache[key_hash]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _host_value(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly multi-process) array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _to_stored(t: Tensor, value: np.ndarray) -> np.ndarray:
    """The checkpoint layout of a model parameter's value (``read_block``'s inverse)."""
    value = np.asarray(value, np.float32)
    if t.scale != 1.0:
        value = value / np.float32(t.scale)
    if t.offset:
        value = value - np.float32(t.offset)
    if t.layout == "T":
        return value.T
    if t.layout == "heads_out":
        return value.transpose(1, 2, 0).reshape(-1, value.shape[0])
    if t.layout == "heads_in":
        return value.transpose(2, 0, 1).reshape(value.shape[2], -1)
    return value


def _shards(names_sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most ``max_bytes`` (a larger tensor alone), in order."""
    files, size = [[]], 0
    for name, n in names_sizes:
        if files[-1] and size + n > max_bytes:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += n
    return files


def save(model: Llama, path, hf_config: dict | None = None, *, family: str | None = None, dtype=jnp.float32,
         max_shard_bytes: int = 5 * 2**30, copy_from=None) -> Path:
    """Writes ``model`` to folder ``path`` in the Hugging Face layout (``config.json`` + safetensors).

    Every process calls it. Tensors are gathered one at a time; each file is written by one process
    (file ``i`` by process ``i mod processes``), the index and ``config.json`` by process 0.

    Args:
        model: the model.
        path: the folder (created).
        hf_config: the ``config.json`` it was loaded with (its other keys are kept), or None.
        family: ``models.families.FAMILIES`` name (default: ``hf_config``'s family, else ``"llama"``).
        dtype: the stored dtype (``jnp.bfloat16`` halves the files; float32 keeps every bit).
        max_shard_bytes: the largest file; more tensors go to numbered files with an index.
        copy_from: a checkpoint folder whose tokenizer files (``TOKENIZER_FILES``) are copied along.

    Returns:
        The folder.

    Raises:
        ValueError: the model's config has no ``config.json`` form in ``family``.
    """
    fam = families.FAMILIES[family] if family else (family_of(hf_config) if hf_config else families.FAMILIES["llama"])
    hf = config_to_hf(model.cfg, fam, hf_config) | {"torch_dtype": jnp.dtype(dtype).name}
    table = families.tensors(model.cfg, fam, hf)
    params = dict(_params(model))
    order = sorted(table, key=lambda p: table[p].name)
    dt = jnp.dtype(dtype)
    groups = _shards([(table[p].name, int(np.prod(params[p].shape)) * dt.itemsize) for p in order],
                     max_shard_bytes)
    names = [_file_name(i, len(groups)) for i in range(len(groups))]
    out, me, n_proc = Path(path), jax.process_index(), jax.process_count()
    out.mkdir(parents=True, exist_ok=True)
    by_name = {table[p].name: p for p in order}
    for i, group in enumerate(groups):
        arrays = {}
        for name in group:
            value = _to_stored(table[by_name[name]], _host_value(params[by_name[name]][...]))
            if i % n_proc == me:
                arrays[name] = np.ascontiguousarray(value.astype(dt))
        if arrays:
            from safetensors.numpy import save_file

            save_file(arrays, out / names[i], metadata={"format": "pt"})
    if me == 0:
        _write_meta(out, hf, groups, names, params, by_name, dt, copy_from)
    if n_proc > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"models.hf.save {out}")
    return out


def _file_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_meta(out: Path, hf: dict, groups, names, params, by_name, dt, copy_from) -> None:
    """``config.json``, the index (for more than one file) and the copied tokenizer files."""
    (out / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if len(groups) > 1:
        total = sum(int(np.prod(params[by_name[n]].shape)) * dt.itemsize for g in groups for n in g)
        index = {"metadata": {"total_size": total}, "weight_map": {n: names[i] for i, g in enumerate(groups) for n in g}}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES if copy_from else ():
        src = Path(copy_from) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)


def extend_context(hf_config: dict, scaling: str) -> tuple[LlamaConfig, dict]:
    """The checkpoint's ``LlamaConfig`` with its (global layers') RoPE stretched for a longer context,
    and its ``config.json`` saying so.

    Args:
        hf_config: the checkpoint's ``config.json``.
        scaling: ``"linear:F"`` (every frequency / F, on top of the checkpoint's own scaling) or
            ``"llama3:F"`` (Llama 3.1's bands, ``original_max_position_embeddings`` = the checkpoint's
            ``max_position_embeddings``); the context grows F times.

    Raises:
        ValueError: ``scaling`` is malformed, or ``llama3`` over a checkpoint already scaled.
    """
    kind, _, factor = scaling.partition(":")
    try:
        factor = float(factor)
    except ValueError:
        factor = 0.0
    if kind not in ("linear", "llama3") or not factor >= 1:
        raise ValueError(f"--rope-scaling {scaling!r} must be linear:FACTOR or llama3:FACTOR with FACTOR >= 1, "
                         "e.g. linear:4.")
    cfg = config_from_hf(hf_config)
    rope, trained = cfg.rope_theta, int(hf_config.get("max_position_embeddings") or 0)
    if isinstance(rope, jax_cp.RoPE) and rope.llama3:
        raise ValueError(f"--rope-scaling {scaling}: the checkpoint's RoPE is already Llama 3 scaled ({rope}); "
                         "fine-tune it at up to its factor times original_max_position_embeddings as it is.")
    if kind == "llama3" and (isinstance(rope, jax_cp.RoPE) or not trained):
        raise ValueError(f"--rope-scaling {scaling}: the checkpoint's RoPE is {rope} with max_position_embeddings="
                         f"{trained or None}; llama3 scaling starts from an unscaled RoPE and a known context "
                         "(use linear:FACTOR).")
    if kind == "linear":
        theta, old = (rope.theta, rope) if isinstance(rope, jax_cp.RoPE) else (rope, jax_cp.RoPE(theta=rope))
        new = dataclasses.replace(old, theta=theta, factor=old.factor * factor)
    else:
        new = jax_cp.RoPE(theta=rope, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=trained)
    cfg = dataclasses.replace(cfg, rope_theta=new)
    out = dict(hf_config) | ({"max_position_embeddings": int(trained * factor)} if trained else {})
    return cfg, config_to_hf(cfg, family_of(hf_config), out)


def finetune_config(path, rope_scaling: str | None = None) -> tuple[LlamaConfig, dict]:
    """The model config to fine-tune checkpoint ``path`` with (``extend_context``'s where ``rope_scaling``),
    and the ``config.json`` to save the result with."""
    hf = read_config(path)
    return extend_context(hf, rope_scaling) if rope_scaling else (config_from_hf(hf), hf)


def corpus_options(path) -> dict:
    """``models.data.load_corpus``'s ``tokenizer`` and ``eod`` for checkpoint ``path`` (``{}`` for None:
    bytes)."""
    if path is None:
        return {}
    eos = eos_token_id(read_config(path))
    if eos is None:
        raise ValueError(f"{path}/config.json has no eos_token_id, which ends every training document; add it.")
    return dict(tokenizer=load_tokenizer(path), eod=int(eos))


def eos_token_id(hf_config: dict) -> int | None:
    """The end-of-sequence token of a ``config.json`` (the first, where it lists several)."""
    eos = hf_config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos


def load_tokenizer(path):
    """The ``tokenizers.Tokenizer`` of a checkpoint folder's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise ValueError(f"{path}: no tokenizer.json (the tokenizers package's format; save one with "
                         "Tokenizer.save or transformers' save_pretrained).")
    return Tokenizer.from_file(str(f))
