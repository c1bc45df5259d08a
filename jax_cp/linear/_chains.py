"""State passing: each rank folds its chunks into state maps, one exchange over ``cp_colossal``
(an all-gather's result, sent as an all-to-all) hands every run the state of its predecessors in
document order, and each rank adds what that state contributes.

Per rank (inside ``shard_map``), for the chunk parts of :mod:`jax_cp.linear._chunk`:

1. a scan over the local chunks carries the state a run would have if every ``CUT`` run started
   from zero (``S``), and the map ``Phi`` from the state the current ``CUT`` run received to now
   (where the host knows there is no ``CUT``, the state alone: ``_local_scan_uncut``);
2. each exported slot's ``(Phi, S)`` at its tail token goes to every rank (the only collective);
3. meanwhile, the outputs that need no incoming state are computed (the chunk's own ``o_intra``,
   ``q_eff S^T``, and the local factor ``q_eff Phi^T`` of what the incoming state adds);
4. every rank composes the gathered maps in document order (a scan over the slots, sorted by
   segment id and position, restarting where a slot does not continue the one before it), so each
   ``CUT`` slot learns its incoming state ``X``, and the row's final state is read off its slot;
5. each chunk's open run starts from ``S + X Phi`` (``X`` the state its ``CUT`` slot received),
   and the tokens of a ``CUT`` run inside a chunk add ``q_eff X^T``.

Maps act on states from the right: ``X A`` (a matrix ``[k, k]``, or ``[1, 1]``: a scalar).
Letters: B batch, H heads, N chunks, C chunk length, L = N*C, P slots per rank, k key dim,
v value dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_cp._vma import vary_as
from jax_cp.exchanges.all_to_all import spread_kv
from jax_cp.linear._chunk import Intra, decayed, k_bar_at as _k_bar, maps_at, select
from jax_cp.linear._topology import CONT, CUT, START, Topology

__all__ = ["pass_states"]


def _apply(X, A):
    """``X A``: a matrix product, or a scalar map (``A [.., 1, 1]``). In full float32 (``HIGHEST``): a
    state is multiplied by chunk after chunk's map, and an accelerator's default matmul precision
    (bfloat16 passes on TPU, TF32 on GPU) would round the state it carries at every step."""
    return X * A if A.shape[-2:] == (1, 1) else jnp.matmul(X, A, precision=lax.Precision.HIGHEST)


def _where(flag_B, a, b):
    """``a`` where ``flag [B]`` (or ``[B, M]``) else ``b``, over trailing axes ``[B, H, (M,) ...]``."""
    f = flag_B.reshape(flag_B.shape[:1] + (1,) + flag_B.shape[1:] + (1,) * (jnp.ndim(a) - flag_B.ndim - 1))
    return jnp.where(f, a, b)


def _front(a):
    """``[B, H, N, ...]`` (or ``[B, N]``) -> chunks first, as a scan reads them."""
    return None if a is None else jnp.moveaxis(a, 2 if a.ndim > 2 else 1, 0)


def _local_scan(intra: Intra, kind_BNC, x0, eye):
    """The states entering every chunk, ``(S_in, Phi_in)`` ``[B, H, N, ...]``: ``CUT`` runs from zero."""
    B, H, N, C, _ = intra.q_eff.shape
    a_end, b_end = maps_at(intra, jnp.full((B, N), C - 1, jnp.int32))
    head_last = intra.runs.head[..., C - 1]
    kind_last = jnp.take_along_axis(kind_BNC, head_last[..., None], axis=-1)[..., 0]
    xs = (kind_BNC[..., 0], kind_last, head_last == 0, a_end, b_end)
    xs = tuple(_front(a) for a in xs)

    def body(carry, x):
        S, Phi = carry
        kind0, kind_last, last_first, a, b = x
        S_in = _where(kind0 == CONT, S, _where(kind0 == START, x0, 0.0))
        Phi_in = _where(kind0 == CONT, Phi, _where(kind0 == CUT, eye, 0.0))
        S_last = _where(last_first, S_in, _where(kind_last == START, x0, 0.0))
        Phi_last = _where(last_first, Phi_in, _where(kind_last == CUT, eye, 0.0))
        return (_apply(S_last, a) + b, _apply(Phi_last, a)), (S_in, Phi_in)

    zero_phi = jnp.zeros((B, H) + a_end.shape[-2:], jnp.float32)
    eye = jnp.broadcast_to(eye, zero_phi.shape)
    init = tuple(vary_as(x, b_end, x0) for x in (jnp.zeros_like(b_end[:, :, 0]), zero_phi))
    _, (S_in, Phi_in) = lax.scan(body, init, xs)
    return jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(Phi_in, 0, 2)


def _local_scan_uncut(intra: Intra, kind_BNC, x0):
    """``S_in [B, H, N, ...]`` when no token is ``CUT`` (every run starts from ``x0`` or continues the
    token before it): the state alone is carried, and the delta rule's chunk update is
    flash-linear-attention's ``S d + (W_v - W_k S^T)^T K_bar`` (no ``[k, k]`` map is formed; the kept
    part ``S d`` stays exact at any matmul precision)."""
    B, H, N, C, _ = intra.q_eff.shape
    k_bar, decay = _k_bar(intra, jnp.full((B, N), C - 1, jnp.int32))
    flags = (kind_BNC[..., 0] == CONT, intra.runs.head[..., C - 1] == 0)
    floats = (intra.w_v, intra.w_k, k_bar, decay, x0)
    return _state_scan(*(vary_as(a, *floats) for a in floats), *flags)


@jax.custom_vjp
def _state_scan(w_v, w_k, k_bar, decay, x0, cont_BN, last_first_BN):
    """The scan of :func:`_local_scan_uncut`, chunk by chunk: ``S_in = S`` where the chunk's first token
    continues (``cont``) else ``x0``; the chunk's last run starts from ``S0 = S_in`` (``last_first``) or
    ``x0``; ``u = W_v - W_k S0^T`` and the next ``S = S0 d + u^T K_bar``. Its own VJP saves ``S_in`` and
    ``u`` per chunk, not each step's broadcast flags and ``S0``."""
    return _state_scan_fwd(w_v, w_k, k_bar, decay, x0, cont_BN, last_first_BN)[0]


def _state_scan_fwd(w_v, w_k, k_bar, decay, x0, cont_BN, last_first_BN):
    def body(S, x):
        w_v, w_k, k_bar, decay, cont, last_first = x
        S_in = _where(cont, S, x0)
        S0 = _where(last_first, S_in, x0)
        u = w_v if w_k is None else w_v - jnp.einsum("...ck,...vk->...cv", w_k, S0)
        return decayed(S0, decay) + jnp.einsum("...cv,...ck->...vk", u, k_bar), (S_in, None if w_k is None else u)

    xs = tuple(_front(a) for a in (w_v, w_k, k_bar, decay, cont_BN, last_first_BN))
    _, (S_in, u) = lax.scan(body, vary_as(jnp.zeros_like(x0), w_v, x0), xs)
    res = (S_in, xs[0] if w_k is None else u) + xs[1:] + (x0,)  # chunks first, as the backward scan reads them
    return jnp.moveaxis(S_in, 0, 2), res


def _state_scan_bwd(res, g_in):
    S_in, u, w_k, k_bar, decay, cont, last_first, x0 = res

    def body(carry, x):
        g_next, g_x0 = carry  # the cotangents of the chunk's outgoing state and of x0 so far
        S_in, u, w_k, k_bar, decay, cont, last_first, g = x
        S0 = _where(last_first, S_in, x0)
        g_u = jnp.einsum("...ck,...vk->...cv", k_bar, g_next)
        prod = g_next * S0
        g_decay = prod.sum(-2) if decay.shape[-1] > 1 else prod.sum((-2, -1))[..., None]
        g0 = decayed(g_next, decay)
        g_w_k = None
        if w_k is not None:  # u = W_v - W_k S0^T
            g0 = g0 - jnp.einsum("...cv,...ck->...vk", g_u, w_k)
            g_w_k = -jnp.einsum("...cv,...vk->...ck", g_u, S0)
        g = g + _where(last_first, g0, 0.0)
        g_x0 = g_x0 + _where(~last_first, g0, 0.0) + _where(~cont, g, 0.0)
        return (_where(cont, g, 0.0), g_x0), (g_u, g_w_k, jnp.einsum("...cv,...vk->...ck", u, g_next), g_decay)

    zero = vary_as(jnp.zeros_like(x0), g_in, x0)
    xs = (S_in, u, w_k, k_bar, decay, cont, last_first, _front(g_in))
    (_, g_x0), grads = lax.scan(body, (zero, zero), xs, reverse=True)
    return (*(None if a is None else jnp.moveaxis(a, 0, 2) for a in grads), g_x0, None, None)


_state_scan.defvjp(_state_scan_fwd, _state_scan_bwd)


def _tails(intra: Intra, kind_BNC, S_in, Phi_in, topo: Topology, x0, eye):
    """Each exported slot's ``(Phi, S)`` after its tail token, ``[B, H, P, ...]`` (zero if unused)."""
    C = intra.q_eff.shape[3]
    chunk, tau = topo.tail_tok // C, topo.tail_tok % C
    a, b = maps_at(select(intra, chunk), tau)
    take = lambda x: jnp.take_along_axis(x, chunk[:, None, :, None, None], axis=2)  # noqa: E731
    rows = jnp.take_along_axis(intra.runs.head, chunk[..., None], axis=1)  # [B, P, C]
    head = jnp.take_along_axis(rows, tau[..., None], axis=-1)[..., 0]  # [B, P]
    kind = jnp.take_along_axis(kind_BNC.reshape(kind_BNC.shape[0], -1), chunk * C + head, axis=1)
    S0 = _where(head == 0, take(S_in), _where(kind == START, x0[:, :, None], 0.0))
    Phi_head = jnp.zeros(a.shape, jnp.float32) if Phi_in is None else take(Phi_in)  # None: no run receives
    Phi0 = _where(head == 0, Phi_head, _where(kind == CUT, jnp.broadcast_to(eye, a.shape), 0.0))
    ok = topo.tail_ok
    return _where(ok, _apply(Phi0, a), 0.0), _where(ok, _apply(S0, a) + b, 0.0)


def _gather_slots(phi_t, s_t, axis: str):
    """Every rank's exported ``(Phi, S)``, ``[B, H, c*P, ...]`` in rank order: one all-to-all of ``c``
    copies (``spread_kv``; asynchronous on every TPU generation, where an all-gather is only on v5e),
    whose backward is the inverse all-to-all and a float32 sum of the copies."""
    B, H, P = phi_t.shape[:3]
    flat = jnp.concatenate([phi_t.reshape(B, H, P, -1), s_t.reshape(B, H, P, -1)], axis=-1)
    got = spread_kv(jnp.moveaxis(flat, 2, 1)[:, :, None], axis)  # [B, c*P, 1, H, F]
    got = jnp.moveaxis(got[:, :, 0], 1, 2)
    n = phi_t.shape[-2] * phi_t.shape[-1]
    return (got[..., :n].reshape(got.shape[:3] + phi_t.shape[3:]),
            got[..., n:].reshape(got.shape[:3] + s_t.shape[3:]))


def _chain(phi_all, s_all, topo: Topology):
    """The state after every global slot ``[B, H, c*P, v, k]``: the gathered maps composed in document order."""
    order = topo.order[:, None, :, None, None]
    a, b = (jnp.moveaxis(jnp.take_along_axis(x, order, axis=2), 2, 0) for x in (phi_all, s_all))

    def body(prev, x):
        linked, a, b = x
        S = _apply(_where(linked, prev, 0.0), a) + b
        return S, S

    _, S = lax.scan(body, vary_as(jnp.zeros_like(b[0]), a, b), (jnp.moveaxis(topo.linked, 1, 0), a, b))
    inverse = jnp.argsort(topo.order, axis=-1)[:, None, :, None, None]
    return jnp.take_along_axis(jnp.moveaxis(S, 0, 2), inverse, axis=2)


def _received(S_all, topo: Topology):
    """``X [B, H, P + 1, v, k]``: the state each local ``CUT`` slot receives; row ``P`` is zero."""
    feed = topo.cut_feed
    X = jnp.take_along_axis(S_all, jnp.maximum(feed, 0)[:, None, :, None, None], axis=2)
    X = _where(feed >= 0, X, 0.0)
    return jnp.concatenate([X, jnp.zeros_like(X[:, :, :1])], axis=2)


def _mid_cuts(intra: Intra, kind_of_head, gov_BNC, X, topo: Topology):
    """``q_eff X^T`` for the tokens of ``CUT`` runs that start inside a chunk, ``[B, H, N, C, v]``."""
    B, H, N, C, _ = intra.q_eff.shape
    P = topo.cut_tok.shape[1]
    chunk = topo.cut_tok // C  # [B, P]
    q = jnp.take_along_axis(intra.q_eff, chunk[:, None, :, None, None], axis=2)  # [B, H, P, C, k]
    mine = (jnp.take_along_axis(gov_BNC, chunk[..., None], axis=1) == jnp.arange(P)[None, :, None]) & (
        jnp.take_along_axis((intra.runs.run > 0) & (kind_of_head == CUT), chunk[..., None], axis=1))
    corr = jnp.einsum("bhpck,bhpvk->bhpcv", q * mine[:, None, ..., None], X[:, :, :P])
    return jnp.einsum("bpn,bhpcv->bhncv", (chunk[..., None] == jnp.arange(N)[None, None]).astype(corr.dtype), corr)


def pass_states(intra: Intra, topo: Topology, x0, axis, *, cuts: bool = True, initial: bool = True):
    """Outputs ``[B, H, N, C, v]`` and the row's final state ``[B, H, v, k]`` of one rank's chunks.

    Args:
        intra: the chunk parts (:func:`jax_cp.linear._chunk.gdn_intra` or ``ssd_intra``).
        topo: this rank's :class:`Topology`.
        x0: ``[B, H, v, k]`` the state every document starts from (zeros for none).
        axis: the ``cp_colossal`` axis name, or ``None`` on one device.
        cuts: ``False`` where the host knows no token is ``CUT``: only the state is carried (no maps
            ``Phi``; about half the FLOPs of the delta rule), and no state travels on one device.
        initial: ``False`` where ``x0`` is zero (no initial state given): the runs that start inside a
            chunk from it add nothing, and their product with it is skipped.

    Returns:
        ``(o, final)``: NaN in rows whose layout needs more slots than the topology has.
    """
    B, H, N, C, _ = intra.q_eff.shape
    kind = topo.kind.reshape(B, N, C)
    eye = jnp.eye(intra.w_k.shape[-1] if intra.w_k is not None else 1, dtype=jnp.float32)
    if cuts:
        S_in, Phi_in = _local_scan(intra, kind, x0, eye)
    else:
        S_in, Phi_in = _local_scan_uncut(intra, kind, x0), None
    phi_t, s_t = _tails(intra, kind, S_in, Phi_in, topo, x0, eye)
    if axis is not None:  # the one exchange: every rank's exported maps
        phi_t, s_t = _gather_slots(phi_t, s_t, axis)
    # While the maps travel: everything that needs no incoming state. A chunk's open run starts from
    # S_in + X0 Phi_in (X0 the state its CUT slot receives), so its tokens' q_eff S^T splits into the
    # local q_eff S_in^T and (q_eff Phi_in^T) X0^T, whose first factor is local too.
    m0 = (intra.runs.run == 0)[:, None, ..., None]
    kind_of_head = jnp.take_along_axis(kind, intra.runs.head, axis=-1)
    q0 = intra.q_eff * m0
    o = intra.o_intra + jnp.einsum("bhnck,bhnvk->bhncv", q0, S_in)
    if initial:  # the runs that start inside a chunk, from x0
        start_mid = ((intra.runs.run > 0) & (kind_of_head == START))[:, None, ..., None]
        o = o + jnp.einsum("bhnck,bhvk->bhncv", intra.q_eff * start_mid, x0)
    if not cuts:  # every state is local: the slots only carry the final state
        return _where(topo.ok, o, jnp.nan), _where(topo.ok, _final(_chain(phi_t, s_t, topo), topo), jnp.nan)
    q_phi = q0 * Phi_in if Phi_in.shape[-2:] == (1, 1) else jnp.einsum("bhnck,bhnjk->bhncj", q0, Phi_in)
    # Then what the received states add.
    S_all = _chain(phi_t, s_t, topo)
    X = _received(S_all, topo)
    gov = topo.gov.reshape(B, N, C)
    X0 = jnp.take_along_axis(X, gov[..., 0][:, None, :, None, None], axis=2)  # [B, H, N, v, k]
    o = o + jnp.einsum("bhncj,bhnvj->bhncv", q_phi, X0) + _mid_cuts(intra, kind_of_head, gov, X, topo)
    return _where(topo.ok, o, jnp.nan), _where(topo.ok, _final(S_all, topo), jnp.nan)


def _final(S_all, topo: Topology):
    """The row's final state ``[B, H, v, k]``: its slot's (zero if the row has no document)."""
    final = jnp.take_along_axis(S_all, jnp.maximum(topo.final, 0)[:, None, None, None, None], axis=2)[:, :, 0]
    return _where(topo.final >= 0, final, 0.0)
