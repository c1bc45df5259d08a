"""Inference: CP prefill into a KV cache sharded along the sequence, and decode steps that read it.

The cache of one layer (``init_cache``): ``cached_key [B, L, Kc, d]``, ``cached_value [B, L, Kc, dv]``,
``cached_positions [B, L]`` (each slot's token position; ``EMPTY`` where none, and for prompt tokens that
decode must not see: padding and the documents of a packed prompt before its last), ``cache_index [B]``
(each sequence's next position), ``cache_slots []`` (slots written) and ``cache_window []`` (the
prefill's left window, ``NO_WINDOW`` for none: decode steps use it, so they cannot differ). K/V and
positions are sharded ``P(dp, (cp_colossal, cp_ulysses), tp)``: a device holds ``L / (c*u)`` slots
of its tp rank's ``Kc / t`` kv heads (``Kc = lcm(num_kv_heads, tp)``: the kv heads, repeated only
when tp exceeds them, so a rank holds the heads its query heads read).

Ownership: global slot ``g`` lives on CP rank ``g % n`` (``n = c*u``) at local slot ``g // n``.
``prefill_prompt`` writes each device's own prompt tokens (the training layout, load-balanced or not) into
its first ``S / n`` slots, so the prompt costs no extra communication and is spread evenly; decode
tokens then go round-robin, token ``g`` to rank ``g % n``, so every device keeps ``1/n`` of the
sequence however long decoding runs. Because each slot stores its token's position, the masks
(causal, window, padding) need no layout rule.

A decode step (``decode_step``): the new tokens ``x [B, T, D]`` are replicated over the CP axes;
every device projects them (its tp heads), the owner writes the new K/V into its slot, every device
attends its cache shard (``attend_cache``: one dense masked pass with the log-sum-exp; ``T`` query rows,
so the scores are small next to the cache, and nothing copies the cache: no loop carries it and the
contractions read it in place), and a ``pmax`` of the log-sum-exps and one ``psum`` of the rescaled partial outputs over
the CP axes merges them (both ``[B, T, H]``-sized); then the output projection and the tp psum. The cache is updated in place (``dynamic_update_slice``),
so a jitted step with the cache donated holds it once.
Letters: B batch, S prompt, T new tokens, L cache length, D model width, H heads, K kv heads, d head dim.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_cp._body import attention_shard, shard_call
from jax_cp._layer import compute_specs, layer_call
from jax_cp._masks import normalize_window, visible
from jax_cp._mesh import CP, DP, TP, mesh_dims, place, seq_chunk
from jax_cp._platform import target_platform
from jax_cp._projection import LinearProjections, local_kv, per_token, project
from jax_cp._softmax import NEG, acc_dtype, fold_sinks
from jax_cp._spec import Layout, lcm

__all__ = ["CACHE_FIELDS", "EMPTY", "NO_WINDOW", "CacheLayout", "cache_layout", "check_inference", "refuse_split", "decode_positions",
           "decode_step", "infer", "init_cache", "prefill_prompt"]

EMPTY = 2**30  # the position of an empty slot: after every query, so causality hides it
NO_WINDOW = -1  # cache_window when the prefill had no window
CACHE_FIELDS = ("cached_key", "cached_value", "cached_positions", "cache_index", "cache_slots", "cache_window")
X_DECODE = P(DP, None, None)  # a decode step's [B, T, D]: replicated over the CP axes and tp


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How one layer's cache lands on a mesh: ``heads`` (Kc, global kv heads stored) and ``step``, the
    stride from the layer's expanded kv heads (``Layout.kv_expanded``) to the stored ones."""

    heads: int
    step: int
    kv_sharded: bool

    def specs(self) -> dict[str, P]:
        kv = P(DP, CP, TP, None)
        return {"cached_key": kv, "cached_value": kv, "cached_positions": P(DP, CP), "cache_index": P(DP),
                "cache_slots": P(), "cache_window": P()}

    def write_prefill(self, kept, cache_pos_BS, ck, cv, cpos):
        """Inside ``shard_map``: this device's prompt K/V (seq layout, expanded heads, per chunk) into its
        first slots, at ``cache_pos_BS`` (the whole prompt's, replicated over CP; ``EMPTY`` where decode
        must not see a token: ``decode_positions``)."""
        k, v = (jnp.concatenate([kv[j] for kv in kept], axis=2)[:, :, ::self.step] for j in (0, 1))
        pos = seq_chunk(cache_pos_BS, CP)
        put = lambda buf, new: lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), 0, axis=1)
        return put(ck, k), put(cv, v), put(jnp.full_like(cpos, EMPTY), pos)


def cache_layout(spec, mesh) -> CacheLayout:
    dims = mesh_dims(mesh)
    layout = spec.layout(dims)
    heads = lcm(spec.num_kv_heads, dims.t)
    return CacheLayout(heads=heads, step=layout.kv_expanded // heads, kv_sharded=layout.kv_sharded)


def init_cache(spec, mesh, batch: int, max_length: int, dtype) -> dict[str, jax.Array]:
    """One layer's empty cache (``CACHE_FIELDS``), created already sharded."""
    dims = mesh_dims(mesh)
    for name, value in (("batch", batch), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int.")
    if max_length % dims.cp:
        raise ValueError(f"max_length={max_length} is not divisible by cp_colossal*cp_ulysses={dims.cp}; the cache "
                         f"is split evenly over them: use a multiple, e.g. {-(-max_length // dims.cp) * dims.cp}.")
    if batch % dims.dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dims.dp}; use a batch that is a multiple of dp.")
    cl = cache_layout(spec, mesh)
    specs = cl.specs()
    shapes = {"cached_key": ((batch, max_length, cl.heads, spec.head_dim), dtype, 0),
              "cached_value": ((batch, max_length, cl.heads, spec.v_head_dim), dtype, 0),
              "cached_positions": ((batch, max_length), jnp.int32, EMPTY),
              "cache_index": ((batch,), jnp.int32, 0), "cache_slots": ((), jnp.int32, 0),
              "cache_window": ((), jnp.int32, NO_WINDOW)}
    return {name: jax.jit(partial(jnp.full, shape, fill, dtype), out_shardings=NamedSharding(mesh, specs[name]))()
            for name, (shape, dtype, fill) in shapes.items()}


def check_cache(cache: dict, spec, batch: int) -> int:
    """The cache's length ``L``; ``ValueError`` when it is missing or made for another batch."""
    if cache is None or any(cache.get(name) is None for name in CACHE_FIELDS):
        raise ValueError("decode needs a cache: call init_cache(batch_size, max_length) on the module first "
                         "(Linen: init with decode=True on a [batch, max_length, D] input).")
    B, L = cache["cached_positions"].shape
    if B != batch:
        raise ValueError(f"the input's batch={batch} does not match the cache's batch={B}; init_cache again with "
                         f"batch_size={batch}, or pass {B} sequences.")
    return L


def _prefill_shard(params, x_BSD, meta, *cache_args, spec, layout, dtype, cache: CacheLayout):
    projections = LinearProjections.build(params, x_BSD, meta.pos, spec=spec, layout=layout, dtype=dtype)
    y, kept = attention_shard(projections, meta, spec=spec, keep_kv=True)
    return y, cache.write_prefill(kept, *cache_args)


def decode_positions(pos_BS, segment_ids_BS=None, lengths_B=None):
    """What decode keeps of a prompt: ``(cache_pos [B, S], next_B [B])``.

    Decode continues each row's last document: the real tokens (index below ``lengths``, as jax.nn
    counts lengths; segment id >= 0) of the row's largest segment id (packing numbers documents in
    order; without segment ids the whole row is one document). Every other prompt token is stored at
    ``EMPTY`` (never seen by a decode step); ``next_B`` is one past the largest position kept, the
    first decode token's position.
    """
    keep = jnp.ones(pos_BS.shape, bool) if lengths_B is None else _real(lengths_B, pos_BS.shape[1])
    if segment_ids_BS is not None:
        seg = jnp.where(keep, segment_ids_BS, -1)
        keep = (seg >= 0) & (seg == seg.max(axis=1, keepdims=True))
    return jnp.where(keep, pos_BS, EMPTY), jnp.where(keep, pos_BS, -1).max(axis=1).astype(jnp.int32) + 1


def prefill_prompt(params: dict, x_BSD, cache: dict, *, mesh, spec, dtype=None, positions=None, segment_ids=None,
                   lengths=None, local_window_size=None, span_ids=None):
    """Runs the prompt ``x [B, S, D]`` through the layer (``_layer.layer_call``: any exchange, kernel,
    positions and segment ids) and writes what decode needs into ``cache`` (from slot 0: a prefill
    starts the cache afresh): the K/V and positions of each row's last document
    (``decode_positions``), its next position, and the window. ``span_ids``: the prompt's
    bidirectional spans (a prefix, an image); the tokens decode generates carry span 0, so decode
    continues causally. Returns ``(y, cache)``."""
    L = check_cache(cache, spec, getattr(x_BSD, "shape", (None,))[0])  # before the layer's own checks
    if lengths is not None:  # right padding by index: a document of its own that no real token sees
        segment_ids, span_ids = _pad_by_length(lengths, x_BSD.shape[:2], segment_ids, span_ids)
    call = layer_call(params, x_BSD, mesh=mesh, spec=spec, dtype=dtype, positions=positions,
                      segment_ids=segment_ids, local_window_size=local_window_size, span_ids=span_ids)
    B, S = call.batch, call.seq_len
    if S > L:
        raise ValueError(f"the prompt's seq_len={S} is longer than the cache's max_length={L}; init_cache with "
                         f"max_length >= {S} (plus the tokens to decode).")
    lengths = _check_lengths(lengths, B, S)
    cache_pos, next_B = decode_positions(call.meta.pos, call.meta.seg, lengths)  # as the layer checked them
    if not isinstance(next_B, jax.core.Tracer) and int(next_B.min()) < 1:
        rows = np.flatnonzero(np.asarray(next_B) < 1).tolist()
        raise ValueError(f"prompt rows {rows} have no real token (every segment id is negative or every position "
                         f"is at or past its length): each row needs one to decode from; check segment_ids/lengths.")
    cl = cache_layout(call.spec, mesh)
    specs = cl.specs()
    names = ("cached_key", "cached_value", "cached_positions")
    args = call.args + [place(cache_pos, mesh, P(DP, None))] + [place(cache[n], mesh, specs[n]) for n in names]
    in_specs = tuple(call.in_specs) + (P(DP, None),) + tuple(specs[n] for n in names)
    fn = partial(_prefill_shard, **call.kwargs, cache=cl)
    y, written = shard_call(fn, mesh, in_specs, (call.out_specs, tuple(specs[n] for n in names)), args)
    new = dict(zip(names, written))
    new["cache_index"] = place(next_B, mesh, specs["cache_index"])
    new["cache_slots"] = jnp.asarray(S, jnp.int32)
    new["cache_window"] = jnp.asarray(_left_window(call.spec.local_window_size), jnp.int32)
    return y, new


def _left_window(local_window_size) -> int:
    """The part of a window a causal decode step uses (its keys all come before it)."""
    window = normalize_window(local_window_size)
    return NO_WINDOW if window is None else window[0]


def _real(lengths_B, seq_len: int):
    """``[B, S]``: the token's index is below its row's length (jax.nn's rule: lengths count indices)."""
    return jnp.arange(seq_len, dtype=jnp.int32)[None] < lengths_B[:, None]


def _pad_by_length(lengths, shape: tuple, segment_ids, span_ids):
    """The prompt's padding (index at or past ``lengths``) as negative segment ids and span 0: padding
    is never seen, whatever positions it carries (pads often repeat the last real position)."""
    B, S = shape
    real = _real(_check_lengths(lengths, B, S), S)
    seg = jnp.zeros((B, S), jnp.int32) if segment_ids is None else jnp.broadcast_to(jnp.asarray(segment_ids), (B, S))
    spans = None if span_ids is None else jnp.where(real, jnp.broadcast_to(jnp.asarray(span_ids), (B, S)), 0)
    return jnp.where(real, seg, -1), spans


def _check_lengths(lengths, batch: int, seq_len: int):
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths (shape={lengths.shape}, dtype={lengths.dtype}) must be integers of shape "
                         f"(batch,)=({batch},): each prompt's number of real tokens (the rest is padding).")
    if not isinstance(lengths, jax.core.Tracer) and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"lengths={lengths.tolist()} must lie in [1, seq_len={seq_len}].")
    return lengths.astype(jnp.int32)


def _put(buf, new, local, mine):
    """Writes ``new [B, 1, ...]`` at local slot ``local`` of ``buf [B, L/n, ...]`` where ``mine`` (this
    device owns the slot), in place: a scatter whose index is out of bounds elsewhere, so it drops
    (nothing reads the old slot, which would make XLA copy the buffer)."""
    slot = jnp.where(mine, local, buf.shape[1])
    return buf.at[:, slot].set(new[:, 0].astype(buf.dtype), mode="drop")


def _new_tokens(params, x_BTD, pos_BT, spec, cl: CacheLayout, dims, dtype):
    """q ``[B, T, H/t, d]`` and the cache's k, v ``[B, T, Kc/t, d]`` of the new tokens (QK-norm, RoPE)."""
    w = params  # this device's compute-layout parameters
    kv_layout = Layout(dims, cl.heads, cl.kv_sharded)
    local = lambda name, axis: None if name not in w else local_kv(w[name], kv_layout, axis)
    x = x_BTD.astype(dtype)
    q = per_token(project(x, w["q_kernel"], w.get("q_bias"), dtype), w.get("q_norm"), pos_BT, spec.rope_theta)
    k = project(x, local("k_kernel", 1), local("k_bias", 0), dtype)
    k = per_token(k, w.get("k_norm"), pos_BT, spec.rope_theta)
    return q, k, project(x, local("v_kernel", 1), local("v_bias", 0), dtype)


def attend_cache(q_BTHd, k_BSKd, v_BSKd, q_pos_BT, k_pos_BS, spec, form: str | None = None, window_left=None):
    """``(o [B, T, H, dv], lse [B, T, H])`` of the queries over one cache shard (causal, window, soft cap,
    empty slots hidden), in the inputs' ``acc_dtype`` (float32; float64 for float64). Dense: ``T`` rows,
    so the scores are small next to the cache.
    ``window_left`` (an int32 scalar, may be traced: the cache's ``cache_window``; negative for none)
    hides keys more than that many positions before the query, besides ``spec``'s window.

    Both contractions read K and V where they lie, never a copy: ``form="dot"`` (TPU, GPU: the
    compiler feeds the matmul from the cache's own layout; the TPU schedule's temporaries stay below
    one layer's keys) or ``"reduce"`` (CPU, where a dot would lay the cache out anew: fused
    multiply-reductions instead). ``None``: by the target platform."""
    form = form or ("reduce" if target_platform() == "cpu" else "dot")
    B, T, H, d = q_BTHd.shape
    K = k_BSKd.shape[2]
    scale = d**-0.5 if spec.scale is None else spec.scale
    acc = acc_dtype(jnp.result_type(q_BTHd, k_BSKd, v_BSKd))
    q = q_BTHd.reshape(B, T, K, H // K, d)
    if form == "dot":
        s = jnp.einsum("btkgd,bskd->bskgt", q.astype(k_BSKd.dtype), k_BSKd, preferred_element_type=acc)
    else:
        q = q.astype(acc)
        s = jnp.stack([(q[:, None, t] * k_BSKd[:, :, :, None].astype(acc)).sum(-1) for t in range(T)], -1)
    s = s * scale  # [B, S, K, G, T]
    if spec.logits_soft_cap is not None:
        s = spec.logits_soft_cap * jnp.tanh(s / spec.logits_soft_cap)
    mask = visible(q_pos_BT, k_pos_BS, is_causal=True, window=spec.local_window_size)  # [B, T, S]
    if window_left is not None:
        mask &= (window_left < 0) | (k_pos_BS[:, None, :] >= q_pos_BT[:, :, None] - window_left)
    mask = jnp.moveaxis(mask, 1, 2)[:, :, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)  # 0 where hidden
    total = p.sum(1)  # [B, K, G, T]
    if form == "dot":
        o = jnp.einsum("bskgt,bskd->bkgtd", p.astype(v_BSKd.dtype), v_BSKd, preferred_element_type=acc)
    else:
        o = (p[..., None] * v_BSKd[:, :, :, None, None].astype(acc)).sum(1)  # [B, K, G, T, dv]
    o = o / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m[:, 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return jnp.moveaxis(o, 3, 1).reshape(B, T, H, -1), jnp.moveaxis(lse, 3, 1).reshape(B, T, H)


def merge_partials(o_BTHd, lse_BTH, axes):
    """Attention over keys split across ``axes``: each device's ``(o, lse)`` -> the whole softmax's
    (``acc_dtype``: float32, float64 for float64), replicated over ``axes``: a ``pmax`` of the log-sum-exps,
    then one ``psum`` of the rescaled outputs with their weights (both ``[B, T, H]``-sized: small next to
    the cache)."""
    acc = acc_dtype(jnp.result_type(o_BTHd, lse_BTH))
    lse_BTH = lse_BTH.astype(acc)
    m = lax.pmax(jnp.where(jnp.isfinite(lse_BTH), lse_BTH, NEG), axes)
    w = jnp.exp(jnp.where(jnp.isfinite(lse_BTH), lse_BTH - m, -jnp.inf))  # 0 where a device's keys are all hidden
    both = lax.psum(jnp.concatenate([w[..., None] * o_BTHd.astype(acc), w[..., None]], axis=-1), axes)
    o, total = both[..., :-1], both[..., -1]
    safe = jnp.where(total > 0, total, 1.0)
    return o / safe[..., None], jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


def _cp_rank():
    """This device's index along the sequence axis ``(cp_colossal, cp_ulysses)``, colossal-major."""
    idx = 0
    for name in CP:
        idx = idx * lax.axis_size(name) + lax.axis_index(name)
    return idx


def _decode_shard(params, x_BTD, ck, cv, cpos, index_B, slots, window, *, spec, dims, dtype, cl: CacheLayout,
                  checks: tuple = ()):
    T, n = x_BTD.shape[1], dims.cp
    for failed, message in checks:  # on every device, before any collective: all stop together, none waits
        jax.debug.callback(partial(_stop_if, message=message), failed(slots, window), slots, window)
    pos_BT = index_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    q, k, v = _new_tokens(params, x_BTD, pos_BT, spec, cl, dims, dtype)
    rank = _cp_rank()
    for t in range(T):  # token slots + t goes to rank (slots + t) % n, local slot (slots + t) // n
        g = slots + t
        mine, local = g % n == rank, g // n
        ck, cv = _put(ck, k[:, t:t + 1], local, mine), _put(cv, v[:, t:t + 1], local, mine)
        cpos = _put(cpos, pos_BT[:, t:t + 1], local, mine)
    # The attention reads the written buffers, never a fused re-run of the write (XLA would copy the cache).
    ck, cv, cpos = (lax.optimization_barrier(a) for a in (ck, cv, cpos))
    o, lse = attend_cache(q, ck, cv, pos_BT, cpos, spec, window_left=window)
    o, lse = merge_partials(o, lse, CP)
    o, _ = fold_sinks(o, lse, params.get("sinks"))
    y = lax.psum(jnp.einsum("bthe,hed->btd", o.astype(dtype), params["o_kernel"].astype(dtype)), TP)
    if "o_bias" in params:
        y = y + params["o_bias"][None, None]
    y = jnp.where(slots + T > cpos.shape[1] * n, jnp.nan, y)  # past max_length: never a plausible output
    return y.astype(dtype), (ck, cv, cpos)


def _stop_if(failed, slots, window, *, message) -> None:
    """A ``jax.debug.callback`` target on every device of a jitted step: raises ``ValueError(message(slots,
    window))`` when ``failed``. Every device stops at the same point, before any collective (a device that
    went on would wait for the stopped ones forever); the step then fails with a ``JaxRuntimeError``
    carrying the message, which ``_arm_stops`` keeps JAX from printing again per device and at exit."""
    if bool(np.any(failed)):
        error = ValueError(message(int(slots), int(window)))
        error.jax_cp_stop = True
        _STOPS.add(str(error))
        raise error


_STOPS: set[str] = set()  # the messages of the jitted steps that stopped (``_stop_if``)


class _QuietStops(logging.Filter):
    """Drops JAX's log of each device's stopping callback: the step's error carries the message once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record.exc_info[1] if record.exc_info else None, "jax_cp_stop", False)


@functools.cache
def _arm_stops() -> None:
    """Once, when a step with run-time checks is first traced: JAX's callback logger drops the stops'
    records, and ``_forget_stops`` runs at exit (before JAX's own exit hooks, registered earlier)."""
    logging.getLogger(jax.debug.callback.__module__).addFilter(_QuietStops())
    atexit.register(_forget_stops)


def _forget_stops() -> None:
    """At exit: a stopped step failed where its outputs were read; JAX's exit hooks would raise that
    failure again ("Exception ignored in atexit callback"). Waits for every dispatched effect and forgets
    a stop (JAX 0.10 keeps a failure it has raised: a finished effect on every device replaces it); any
    other failure is left to JAX to report."""
    try:
        jax.effects_barrier()
        return
    except Exception as error:  # a JaxRuntimeError, or a group of them
        failure = error
    ours = any(message in str(failure) for message in _STOPS)
    try:
        jax.effects_barrier()  # newer JAX (0.12) forgot the failure as it raised it
    except Exception:
        if ours:
            _finish_effects()
        return  # kept: JAX's exit hooks report a failure not ours
    if not ours:
        raise failure


def _finish_effects() -> None:
    """Runs an empty callback on every local device, so each device's last effect is a finished one."""
    mesh = Mesh(np.array(jax.local_devices()), ("devices",))
    done = jax.shard_map(lambda: (jax.debug.callback(lambda: None), jnp.zeros(()))[1], mesh=mesh, in_specs=(),
                         out_specs=P())
    jax.jit(done)().block_until_ready()
    jax.effects_barrier()


def _step_checks(cache: dict, T: int, L: int, n: int, local_window_size) -> tuple:
    """What a decode step refuses: overfilling the cache, a window other than the prefill's. A concrete
    cache (an eager call) is checked here: a ``ValueError`` before anything runs. A traced one (under
    ``jit``) gives ``(failed, message)`` pairs of functions of ``(slots, window)`` that every device checks
    when the step runs (``_stop_if``)."""
    slots, window = cache["cache_slots"], cache["cache_window"]
    overflow = partial(_overflow_message, T=T, L=L, n=n)
    checks = []
    if isinstance(slots, jax.core.Tracer):
        checks.append((lambda slots, window: slots + T > L, overflow))
    elif int(slots) + T > L:
        raise ValueError(overflow(int(slots), None))
    if local_window_size is not None:
        wanted, differs = _left_window(local_window_size), partial(_window_message, local_window_size)
        if isinstance(window, jax.core.Tracer):
            checks.append((lambda slots, window: window != wanted, differs))
        elif int(window) != wanted:
            raise ValueError(differs(None, int(window)))
    if checks:
        _arm_stops()
    return tuple(checks)


def _overflow_message(slots: int, window, *, T: int, L: int, n: int) -> str:
    """The overfilling step's message: the tokens asked for, ``max_length``, the slots written, the fix."""
    del window
    need = -(-(slots + T) // n) * n
    return (f"decoding {T} more token(s) would overfill the cache: {slots} of its max_length={L} slots are "
            f"already written; init_cache with max_length >= {need} (the prompt and every token to decode, a "
            f"multiple of cp_colossal*cp_ulysses={n}).")


def _window_message(local_window_size, slots, window: int) -> str:
    """The message of a decode step whose window differs from the prefill's (``window``)."""
    del slots
    used = None if window == NO_WINDOW else window
    return (f"local_window_size={local_window_size!r} differs from the window the prefill used ({used}); decode "
            "steps attend with the prefill's window (cache_window): pass the same, or none.")


def decode_step(params: dict, x_BTD, cache: dict, *, mesh, spec, dtype, local_window_size=None):
    """One decode step of ``T`` new tokens per sequence ``x [B, T, D]`` at positions ``cache_index[b] + t``.

    Returns ``(y [B, T, out_features], cache)`` with the new tokens' K/V written and ``cache_index``
    advanced by ``T``. The window is the prefill's (``cache_window``); ``local_window_size``, if given,
    must equal it. ``ValueError`` when the input is not ``[B, T, D]``, the cache is missing, of another
    batch, would overfill, or the window differs. Under ``jit`` (a traced cache) the last two are
    checked when the step runs: every device stops before its first collective and the step fails with
    one ``JaxRuntimeError`` carrying the ``ValueError``'s message, where its outputs are read (printed
    once: not per device, not again at exit); an overflowing step writes nothing and its outputs are
    NaN besides.
    """
    if getattr(x_BTD, "ndim", None) != 3 or x_BTD.shape[-1] != spec.in_features:
        raise ValueError(f"a decode step's input has shape={getattr(x_BTD, 'shape', None)}; it must be (batch, "
                         f"new_tokens, in_features={spec.in_features}).")
    B, T = x_BTD.shape[:2]
    L = check_cache(cache, spec, B)
    cl, dims, param_specs = cache_layout(spec, mesh), mesh_dims(mesh), compute_specs(spec, mesh)
    checks = _step_checks(cache, T, L, dims.cp, local_window_size)
    specs = cl.specs()
    names = CACHE_FIELDS
    params = {k: place(params[k], mesh, param_specs[k]) for k in param_specs}
    args = [params, place(x_BTD, mesh, X_DECODE)] + [place(cache[n], mesh, specs[n]) for n in names]
    in_specs = (param_specs, X_DECODE) + tuple(specs[n] for n in names)
    fn = partial(_decode_shard, spec=spec.replace(local_window_size=None), dims=dims, dtype=jnp.dtype(dtype), cl=cl,
                 checks=checks)
    y, written = shard_call(fn, mesh, in_specs, (X_DECODE, tuple(specs[n] for n in names[:3])), args)
    new = dict(zip(names[:3], written))
    new["cache_index"] = cache["cache_index"] + T
    new["cache_slots"] = cache["cache_slots"] + T
    new["cache_window"] = cache["cache_window"]
    return y, new


def refuse_split(split_over_tp: bool, prefill: bool, decode: bool) -> None:
    if split_over_tp and (prefill or decode):
        raise ValueError(f"split_over_tp=True is for training calls; prefill={prefill}, decode={decode} take "
                         "inputs_q whole over tp: pass split_over_tp=False.")


def check_inference(spec, kv_x: tuple, prefill: bool, *, kv_positions=None, kv_segment_ids=None, segment_ids=None,
                    span_ids=None, kv_span_ids=None):
    """What prefill and decode serve: self-attention (the cache holds the layer's own tokens); every
    argument they cannot honour is refused, never ignored."""
    mode = "prefill=True" if prefill else "decode=True"
    if kv_x or kv_positions is not None or kv_segment_ids is not None or kv_span_ids is not None:
        raise ValueError(f"{mode} caches the layer's own keys (self-attention); cross attention (inputs_k/inputs_v/"
                         "inputs_kv, kv_positions, kv_segment_ids) has no decode path: run it without decode.")
    if not prefill and segment_ids is not None:
        raise ValueError("decode=True continues each row's last document of the prompt (the prefill's largest "
                         "segment id): pass segment_ids to the prefill call (prefill=True) only.")
    if not prefill and span_ids is not None:
        raise ValueError("decode=True generates tokens outside every span (span id 0: causal); pass span_ids to the "
                         "prefill call (prefill=True) only.")
    if spec.record_max_logits:
        raise ValueError(f"{mode} does not record max logits (a training statistic); build the inference model "
                         "with record_max_logits=False.")


def infer(params, x, cache, *, mesh, spec, dtype, prefill, positions, lengths, local_window_size, segment_ids=None,
          span_ids=None):
    """``prefill_prompt`` or one ``decode_step``: the inference call of the NNX and Linen modules."""
    if prefill:
        return prefill_prompt(params, x, cache, mesh=mesh, spec=spec, dtype=dtype, positions=positions,
                              segment_ids=segment_ids, lengths=lengths, local_window_size=local_window_size,
                              span_ids=span_ids)
    if positions is not None or lengths is not None:
        raise ValueError("decode steps take their positions from the cache (cache_index); pass positions/lengths "
                         "to the prefill call (prefill=True) only.")
    return decode_step(params, x, cache, mesh=mesh, spec=spec, dtype=dtype or getattr(x, "dtype", jnp.float32),
                       local_window_size=local_window_size)
