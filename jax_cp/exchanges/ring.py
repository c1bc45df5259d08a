"""``Ring``: K/V rotate over ``cp_colossal``, queries stay, memory O(S/c) per device.

Each of the ``c`` steps (a loop, so only one remote chunk is live) attends the
local queries to the K/V chunk in hand (the blockwise kernel, or splash / pallas_gpu; fully masked steps
cost no block work), continuing the running online softmax, while ``lax.ppermute``
already moves the next chunk (issued before the step's compute so the
scheduler can overlap them). The ``custom_vjp`` backward rotates K/V the other way,
with their float32 dK/dV accumulators travelling alongside; the chunk at home
is attended last, so every accumulator completes on its owner and no transfer
follows the last step's compute.
Letters: B batch, T local sequence (S/c), H local query heads, K local kv heads, d head dim.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp import _softmax
from jax_cp import kernels as _kernels
from jax_cp._masks import normalize_window
from jax_cp._mesh import COLOSSAL, after, seq_chunk
from jax_cp._remat import name_attention_residuals
from jax_cp._vma import vary_as
from jax_cp.kernels import _blockwise as bw
from jax_cp.kernels import _splash as sp
from jax_cp.exchanges._base import KVExchange, Meta, register

__all__ = ["Ring", "ring_attention", "splash_ring_attention"]


def _shift(tree, axis_name: str, c: int, step: int = 1):
    """Every device passes ``tree`` to rank ``i + step`` on the ring."""
    return lax.ppermute(tree, axis_name, [(i, (i + step) % c) for i in range(c)])


def _loop(attend, home, axis_name):
    """Runs ``carry = attend(carry, kv, ahead)`` over the ring's chunks, the chunk at home first;
    ``ahead``: how many places before this device's own chunk the one in hand sits (its owner is
    rank ``own - ahead``, ``own`` this device's rank; 0 at home, negative for later chunks)."""
    c = lax.axis_size(axis_name)
    own = lax.axis_index(axis_name)

    def step(i, state):  # step s = i + 1 holds the chunk of rank own - s
        carry, kv = state
        nxt = _shift(kv, axis_name, c)  # issued first: in flight while this chunk is attended
        return attend(carry, kv, _ahead(own, i + 1, c)), nxt

    if c == 1:
        return attend(None, home, 0)
    nxt = _shift(home, axis_name, c)
    carry = attend(None, home, 0)  # step 0: the chunk at home
    carry, kv = lax.fori_loop(0, c - 2, step, (carry, nxt))  # one step at a time: O(S/c) live
    return attend(carry, kv, _ahead(own, c - 1, c))  # the last chunk needs no onward shift


def _ahead(own, s, c):
    """``own - owner`` of the chunk from rank ``own - s`` (mod c), as ``_loop`` and ``_backward_ring``
    hand it to their steps."""
    return own - (own - s) % c


def _home(k, v, pos, seg, kv_seg, kv_pos, span=None, kv_span=None):
    """The chunk that travels: K, V and the keys' positions and segment ids (the chunk's own tokens
    as keys: ``kv_pos``/``kv_seg`` where given, cross attention or key padding, else the queries'),
    and their span ids when given."""
    spans = () if span is None else (span if kv_span is None else kv_span,)
    return k, v, pos if kv_pos is None else kv_pos, seg if kv_seg is None else kv_seg, *spans


def _keys(kv):
    """The blockwise metadata of a travelling chunk (``_home``'s tuple)."""
    return bw.Meta(kv[2], kv[3], None, kv[4] if len(kv) > 4 else None)


def _forward(q, home, pos, seg, span, axis_name, spec):
    qm = bw.Meta(pos, seg, None, span)  # the chunk's tokens as queries; as keys they travel in ``home``

    def attend(carry, kv, _):  # continues the running softmax: no second output buffer
        out = bw.forward(q, kv[0], kv[1], qm, _keys(kv), spec, state=None if carry is None else carry[:2])
        if spec.max_logits and carry is not None:  # (o, lse, the rows' largest logit so far)
            out = (*out[:2], jnp.maximum(carry[2], out[2]))
        return out

    return _loop(attend, home, axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _ring(q, k, v, pos, seg, kv_seg, kv_pos, span, kv_span, sinks, axis_name, spec):
    return _ring_fwd(q, k, v, pos, seg, kv_seg, kv_pos, span, kv_span, sinks, axis_name, spec)[0]


def _ring_fwd(q, k, v, pos, seg, kv_seg, kv_pos, span, kv_span, sinks, axis_name, spec):
    # The sinks join the softmax once, after the last chunk (not once per step or device).
    home = _home(k, v, pos, seg, kv_seg, kv_pos, span, kv_span)
    o, lse, *row_max = _forward(q, home, pos, seg, span, axis_name, spec)
    o, lse = _softmax.fold_sinks(o, lse, sinks)
    o, lse = name_attention_residuals(o.astype(q.dtype), lse)
    return bw.outputs(spec, o, lse, row_max), (q, k, v, pos, seg, kv_seg, kv_pos, span, kv_span, o, lse, sinks)


def _ring_bwd(axis_name, spec, res, do):
    q, k, v, pos, seg, kv_seg, kv_pos, span, kv_span, o, lse, sinks = res
    do, delta = bw.output_cotangent(spec, do, o)
    c = lax.axis_size(axis_name)
    qm = bw.Meta(pos, seg, None, span)

    def grads(kv, _, dq=None):  # dq accumulates in place
        return bw.backward(q, kv[0], kv[1], do, lse, delta, qm, _keys(kv), spec, dq=dq)

    home = _home(k, v, pos, seg, kv_seg, kv_pos, span, kv_span)
    if c == 1:
        dq, dk, dv = grads(home, 0)
    else:
        dq, (dk, dv) = _backward_ring(grads, home, do, axis_name, c)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None, None,
            _softmax.sinks_grad(sinks, lse, delta))


def _backward_ring(grads, home, do, axis_name, c):
    """dq and the home chunk's completed (dK, dV): remote chunks first, the home chunk last."""
    # The ring turns the other way round (else XLA merges the first transfers with
    # the forward's and keeps those chunks alive until here), and the chunk at
    # home comes last: at step s device r holds chunk r+1+s, so the float32 dK/dV
    # accumulator of a chunk travels with it and completes on its owner at the
    # final step, with no return hop after the last compute.
    own = lax.axis_index(axis_name)

    def attend(dq, acc, kv, ahead):
        # The accumulator in hand travels while this chunk's gradients are computed;
        # the barrier holds the next step's compute until the sum is done, so XLA
        # cannot run every step's compute first and leave the transfers in a row.
        recv = _shift(acc, axis_name, c, -1)
        dq, dk_s, dv_s = grads(kv, ahead, dq)
        return lax.optimization_barrier((dq, (recv[0] + dk_s, recv[1] + dv_s)))

    def step(i, state):  # a remote chunk (rank own + 1 + i), the next one already on its way
        dq, acc, kv = state
        nxt = _shift(kv, axis_name, c, -1)
        return *attend(dq, acc, kv, _ahead(own, -1 - i, c)), nxt

    # The first transfer waits for the output cotangent: it depends on forward residuals
    # only, and XLA would hoist it into the forward pass, keeping a K/V chunk alive there
    # and taking collective slots from the forward's own exchanges.
    kv = _shift(lax.optimization_barrier((home, do))[0], axis_name, c, -1)
    if c == 2:
        dq, dk, dv = grads(kv, _ahead(own, -1, c))  # the one remote chunk starts its accumulator
        acc = (dk, dv)
    else:
        # Step 0 runs in the loop, with an empty accumulator (zeros travel once): peeled, its
        # onward K/V transfer was scheduled after its kernels, with nothing inside.
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads, kv, 0))
        dq0, dk0, dv0 = (vary_as(z, kv, do) for z in zeros)
        dq, acc, kv = lax.fori_loop(0, c - 2, step, (dq0, (dk0, dv0), kv))
        dq, acc = attend(dq, acc, kv, _ahead(own, 1 - c, c))  # the last remote chunk: nothing further to fetch
    # Own chunk, tied to the last remote step's sums: its kernels need nothing that travels, and
    # XLA hoisted them to the start, leaving the last accumulator's transfer with nothing inside.
    home = lax.optimization_barrier((home, acc))[0]
    return attend(dq, acc, home, 0)  # its accumulator arrives complete


_ring.defvjp(_ring_fwd, _ring_bwd)


# --- The same ring with the TPU splash kernel in every step ------------------------------------
# The chunk is prepared once (head-major, padded, keys sorted: ``_splash.ring_prepare``) and
# travels prepared; each step's splash call returns its log-sum-exp, merged across steps; the
# backward runs splash's backward kernels per chunk with the merged output and log-sum-exp.


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _splash_ring(qx, qm, home, sinks, axis_name, step):
    return _splash_ring_fwd(qx, qm, home, sinks, axis_name, step)[0]


def _splash_ring_fwd(qx, qm, home, sinks, axis_name, step):
    o, lse = _loop(lambda carry, kv, ahead: sp.ring_forward_step(step, qx, qm, kv, carry, ahead), home, axis_name)
    o, lse = name_attention_residuals(*sp.finish(o, lse, sinks, qx.dtype))  # sinks once, after the last chunk
    return o, (qx, qm, home, o, lse, sinks)


def _splash_ring_bwd(axis_name, step, res, do):
    qx, qm, home, o, lse, sinks = res
    c = lax.axis_size(axis_name)

    def grads(kv, ahead, dq=None):
        return sp.ring_backward_step(step, qx, qm, kv, o, lse, do, dq, ahead)

    if c == 1:
        dq, dk, dv = grads(home, 0)
    else:
        dq, (dk, dv) = _backward_ring(grads, home, do, axis_name, c)
    k, v = home[0], home[1]
    none = (None,) * (len(home) - 2)
    return (dq.astype(qx.dtype), jax.tree.map(lambda _: None, qm), (dk.astype(k.dtype), dv.astype(v.dtype), *none),
            sp.sinks_cotangent(sinks, lse, o, do))


_splash_ring.defvjp(_splash_ring_fwd, _splash_ring_bwd)


def splash_ring_attention(q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT=None, *, axis_name: str, is_causal=False,
                          local_window_size=None, scale=None, logits_soft_cap=None, sinks=None, kv_seg_BT=None,
                          kv_pos_BT=None, interpret: bool = False, natural_positions: bool = False, span_BT=None,
                          kv_span_BT=None):
    """As :func:`ring_attention` with the splash kernel in every step (windows over chunks of at most
    ``_splash.MAX_WINDOW_KEYS`` keys).

    ``interpret=True`` runs the Pallas kernels in interpret mode (any backend; for tests).
    ``natural_positions=True``: the caller states that ``pos_BT`` is this device's chunk of
    ``arange(S)`` (the ring's chunks in device order, no segment ids, no window); each step's mask is
    then known when traced (``_splash.ring_prepare``'s ``natural``): no sort at run time.
    ``span_BT`` / ``kv_span_BT``: bidirectional span ids (travelling with the keys; each causal step
    then runs a second splash call for the keys after a query in its span)."""
    T = q_BTHd.shape[1]
    window = normalize_window(local_window_size)
    reason = sp.splash_unsupported_reason(window=window, kv_len=k_BTKd.shape[1], is_causal=is_causal,
                                          spans=span_BT is not None)
    if reason:
        raise ValueError(f"kernel='splash' cannot run this ring: {reason}; use kernel='blockwise' (or 'auto').")
    qx, qm, home, step = sp.ring_prepare(q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT, scale=scale,
                                         is_causal=is_causal, interpret=interpret,
                                         soft_cap=_softmax.check_soft_cap(logits_soft_cap), kv_seg_BT=kv_seg_BT,
                                         kv_pos_BT=kv_pos_BT, window=window, natural=natural_positions,
                                         span_BT=span_BT, kv_span_BT=kv_span_BT)
    # The masks come from positions and segment ids, the same in every layer: tied to this layer's queries
    # (data, ``_mesh.after``), or the TPU compiler computes every step's masks once, before the layers, and
    # keeps them all live through the step (``[c - 2, B, H, T, d]`` predicates: 15.5 GiB a chip at 4M on 64).
    tie = lambda tree: jax.tree.map(lambda a: after(a, qx), tree)
    qm, home = tie(qm), (*home[:2], *tie(home[2:]))
    sinks = _softmax.varying_sinks(sinks, q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT)
    o = _splash_ring(qx, qm, home, sinks, axis_name, step)
    return jnp.swapaxes(o[:, :, :T], 1, 2)


def ring_attention(
    q_BTHd, k_BTKd, v_BTKd, pos_BT, seg_BT=None, *, axis_name: str, is_causal=False, local_window_size=None,
    scale=None, block_q: int | None = None, block_kv: int | None = None, logits_soft_cap=None, sinks=None,
    return_max_logits: bool = False, return_residual: bool = False, kv_seg_BT=None, kv_pos_BT=None,
    kernel=_kernels.BLOCKWISE, span_BT=None, kv_span_BT=None,
):
    """Attention of this device's chunk to every chunk on the ``axis_name`` ring (inside ``shard_map``).

    Inputs are the device's contiguous chunk (queries, keys, values, their global
    positions and segment ids); returns ``o [B, T, H, d]``. ``c = 1`` is plain
    blockwise attention. ``sinks [H]`` (this device's query heads) join the softmax once, after
    the last step. ``return_max_logits=True``: ``(o, max_logits [H])``, the device's queries'
    largest visible logit per head over every step (``-inf`` if none); ``return_residual=True``
    appends the merged log-sum-exp ``[B, T, H]`` (differentiable). ``kv_seg_BT``: the chunk's
    segment ids as keys, when they differ from ``seg_BT`` (its queries'; padding stated per side).
    Cross attention: ``k, v [B, S, K, d]`` are the device's chunk of other tokens (any length ``S``)
    at positions ``kv_pos_BT [B, S]`` (with ``kv_seg_BT`` when segments are given).
    ``kernel``: a kernel whose steps merge log-sum-exps by blockwise's algorithm (``BLOCKWISE``, or
    ``PALLAS_GPU``: each step as the fused Pallas GPU kernel), a value or its name.
    """
    spec = bw.make_spec(q_BTHd.shape[-1], is_causal=is_causal, local_window_size=local_window_size,
                        scale=scale, block_q=block_q, block_kv=block_kv, logits_soft_cap=logits_soft_cap,
                        return_max_logits=return_max_logits, return_residual=return_residual,
                        fused=_kernels.resolve(kernel).fused)
    pos = jnp.asarray(pos_BT, jnp.int32)
    seg, kv_seg, kv_pos, span, kv_span = (None if a is None else jnp.asarray(a, jnp.int32)
                                          for a in (seg_BT, kv_seg_BT, kv_pos_BT, span_BT, kv_span_BT))
    sinks = _softmax.varying_sinks(sinks, q_BTHd, k_BTKd, v_BTKd, pos, seg)
    return _ring(q_BTHd, k_BTKd, v_BTKd, pos, seg, kv_seg, kv_pos, span, kv_span, sinks, axis_name, spec)



@register
class Ring(KVExchange):
    """K/V pass around the ``cp_colossal`` ring (``lax.ppermute``), one chunk live at a time."""

    name = "ring"
    ties_chunks = False  # the tie hides less of the ring's schedule (benchmarks/RESULTS.md)

    def check_kernel(self, kernel) -> None:
        if kernel != _kernels.AUTO and not _kernels.resolve(kernel).merges_lse:
            raise ValueError(f"kernel={kernel!r} cannot run kv_exchange='ring', whose steps merge log-sum-exps "
                             "(the blockwise, splash and pallas_gpu kernels return them); use kernel='auto', "
                             "'blockwise', 'splash' or 'pallas_gpu' (or kv_exchange='all_gather').")

    def keys_per_call(self, seq_len, c):
        return seq_len // c  # one ring step: the chunk that travels

    def step_kernel(self, chosen):
        if chosen.merges_lse:
            return chosen, ""
        return chosen.ring_step(), f"the ring's steps merge log-sum-exps, which {chosen.label or chosen} does not return"

    def kernel(self, spec, q_BTHd, k_BTKd, has_segments: bool, spans: bool = False):
        """The kernel each ring step runs (``k_BTKd``: the chunk that travels): ``auto`` is splash on
        TPU when the call is expressible there (windows over chunks of at most
        ``_splash.MAX_WINDOW_KEYS`` keys, no max-logit statistic), pallas_gpu on GPU, blockwise
        otherwise; an explicit choice that cannot serve raises."""
        chosen = _kernels.select_kernel(spec.kernel, platform=_kernels.target_platform(), is_causal=spec.is_causal,
                                        window=normalize_window(spec.local_window_size), has_segments=has_segments,
                                        dtype=q_BTHd.dtype, head_dim=q_BTHd.shape[-1],
                                        soft_cap=spec.logits_soft_cap is not None,
                                        max_logits=spec.record_max_logits, residual=spec.return_residual,
                                        kv_len=k_BTKd.shape[1], spans=spans)
        return self.step_kernel(chosen)[0]

    def attend(self, q_BTHd, k_BTKd, v_BTKd, meta: Meta, spec, sinks=None):
        pos, seg = seq_chunk(meta.pos, (COLOSSAL,)), seq_chunk(meta.seg, (COLOSSAL,))
        kv_seg, kv_pos = seq_chunk(meta.kv_seg, (COLOSSAL,)), seq_chunk(meta.kv_pos, (COLOSSAL,))
        step = self.kernel(spec, q_BTHd, k_BTKd, seg is not None, meta.span is not None)
        span, kv_span = seq_chunk(meta.span, (COLOSSAL,)), seq_chunk(meta.kv_span, (COLOSSAL,))
        if step == _kernels.SPLASH:
            natural = meta.natural and normalize_window(spec.local_window_size) is None and span is None
            return splash_ring_attention(q_BTHd, k_BTKd, v_BTKd, pos, seg, axis_name=COLOSSAL,
                                         is_causal=spec.is_causal, local_window_size=spec.local_window_size,
                                         scale=spec.scale,
                                         logits_soft_cap=spec.logits_soft_cap, sinks=sinks, kv_seg_BT=kv_seg,
                                         kv_pos_BT=kv_pos, interpret=_kernels.target_platform() != "tpu",
                                         natural_positions=natural, span_BT=span, kv_span_BT=kv_span)
        return ring_attention(q_BTHd, k_BTKd, v_BTKd, pos, seg, axis_name=COLOSSAL, is_causal=spec.is_causal,
                              local_window_size=spec.local_window_size, scale=spec.scale, block_q=spec.block_q,
                              block_kv=spec.block_kv, logits_soft_cap=spec.logits_soft_cap, sinks=sinks,
                              return_max_logits=spec.record_max_logits, return_residual=spec.return_residual,
                              kv_seg_BT=kv_seg, kv_pos_BT=kv_pos, kernel=step,
                              span_BT=span, kv_span_BT=kv_span)
