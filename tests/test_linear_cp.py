"""The linear-attention layers on the mesh equal the one-device recurrence (forward and every gradient,
float32): packed rows whose documents cross ranks, in the natural order, the dual-chunk order
(``load_balance.balanced(fn, mesh)``) and a dispatch plan's (``balanced(fn, plan)``), over
``cp_colossal``, ``cp_ulysses``, ``tp`` and ``dp``, on Auto and Explicit meshes; the convolution's halo
the same way; a mesh that does not fit is a ValueError.
"""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_cp
from conftest import needs_devices
from jax_cp import linear
from linear_data import conv_args, cotangent, gdn_args, packed, ssd_args
from util import assert_close, fwd_and_vjp

F32 = jnp.float32
POS, SEG = packed(rows=((5, 40, 19), (30, 27, 7)))  # S = 64: documents cross every rank boundary
B, S = POS.shape
H, DK, DV = 4, 8, 8


def _mesh(c, u, t, dp=1, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax_cp.make_mesh(cp_colossal=c, cp_ulysses=u, tp=t, dp=dp, devices=jax.devices()[:c * u * t * dp],
                            axis_types=kind)


def _in_order(layer, order, mesh):
    """``f(*seq_args, *other_args)``: the layer run on the tokens in ``order`` (the rows' own positions and
    segment ids travel with them), its output back in natural order."""
    def on_tokens(tree, *rest, positions):
        *seq, pos, seg = tree
        return layer(*seq, *rest, mesh=mesh, positions=pos, segment_ids=seg)

    def f(n_seq, *args):
        tree = (*args[:n_seq], jnp.asarray(POS), jnp.asarray(SEG))
        if order == "natural":
            return on_tokens(tree, *args[n_seq:], positions=None)
        by = mesh if order == "dual-chunk" else jax_cp.load_balance.plan(SEG, mesh, positions=POS)
        return jax_cp.load_balance.balanced(on_tokens, by)(tree, *args[n_seq:])
    return f


def _compare(fast, ref, args, what):
    out = ref(*args)
    ct = cotangent(out)
    got, grads = fwd_and_vjp(fast, args, ct)
    want, r_grads = fwd_and_vjp(ref, args, ct)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, F32, f"output {what}")
    for i, (a, b) in enumerate(zip(grads, r_grads)):
        assert float(jnp.abs(b).max()) > 0, f"input {i} does not reach the output ({what})"
        assert_close(a, b, F32, f"grad {i} {what}")


@functools.cache
def _gdn_args(per_channel=False):
    return gdn_args(B, S, H, DK, DV, per_channel=per_channel)


CASES = [((8, 1, 1, 1), "natural"), ((8, 1, 1, 1), "dispatch"), ((4, 2, 1, 1), "dual-chunk"),
         ((2, 2, 2, 1), "dispatch"), ((1, 4, 1, 1), "natural"), ((2, 4, 1, 1), "dual-chunk"),
         ((2, 1, 2, 2), "dispatch"), ((4, 1, 1, 2), "natural")]


@needs_devices(8)
@pytest.mark.parametrize("cut,order", CASES, ids=[f"{'x'.join(map(str, c))}-{o}" for c, o in CASES])
def test_gated_delta_on_the_mesh_equals_the_recurrence(cut, order):
    mesh = _mesh(*cut)
    layer = functools.partial(linear.gated_delta_rule, chunk_size=8, return_state=True)
    fast = lambda q, k, v, g, beta, x0: _in_order(  # noqa: E731
        lambda *a, **kw: layer(*a[:5], initial_state=a[5], **kw), order, mesh)(5, q, k, v, g, beta, x0)
    ref = lambda q, k, v, g, beta, x0: linear.reference.gated_delta_rule(  # noqa: E731
        q, k, v, g, beta, positions=POS, segment_ids=SEG, initial_state=x0, return_state=True)
    _compare(fast, ref, _gdn_args(), f"{cut} {order}")


@needs_devices(8)
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_per_channel_gates_on_auto_and_explicit_meshes(explicit):
    """Inputs sharded as the mesh's sequence (on an Explicit mesh: typed so) into the dual-chunk order."""
    mesh = _mesh(2, 2, 2, explicit=explicit)
    seq = jax.sharding.NamedSharding(mesh, jax.P("dp", ("cp_colossal", "cp_ulysses")))
    layer = functools.partial(linear.gated_delta_rule, chunk_size=8)

    def fast(*args):
        args = [jax.sharding.reshard(a, seq) if explicit else jax.lax.with_sharding_constraint(a, seq) for a in args]
        return _in_order(layer, "dual-chunk", mesh)(5, *args)

    ref = lambda q, k, v, g, beta: linear.reference.gated_delta_rule(  # noqa: E731
        q, k, v, g, beta, positions=POS, segment_ids=SEG)
    _compare(fast, ref, _gdn_args(per_channel=True)[:5], f"explicit={explicit}")


SSD_CASES = [((4, 2, 1, 1), "dispatch"), ((2, 2, 2, 1), "dual-chunk"), ((8, 1, 1, 1), "natural")]


@needs_devices(8)
@pytest.mark.parametrize("cut,order", SSD_CASES, ids=[f"{'x'.join(map(str, c))}-{o}" for c, o in SSD_CASES])
def test_mamba2_on_the_mesh_equals_the_recurrence(cut, order):
    mesh = _mesh(*cut)
    x, dt, A, b, c, D, x0 = ssd_args(B, S, 4, 4, 8, 1)  # one group: repeated to the tp*cp_ulysses heads
    layer = lambda x, dt, b, c, A, D, x0, **kw: linear.mamba2_ssd(  # noqa: E731
        x, dt, A, b, c, D_H=D, initial_state=x0, chunk_size=8, return_state=True, **kw)
    fast = lambda x, dt, A, b, c, D, x0: _in_order(layer, order, mesh)(4, x, dt, b, c, A, D, x0)  # noqa: E731
    ref = lambda x, dt, A, b, c, D, x0: linear.reference.mamba2_ssd(  # noqa: E731
        x, dt, A, b, c, D_H=D, positions=POS, segment_ids=SEG, initial_state=x0, return_state=True)
    _compare(fast, ref, (x, dt, A, b, c, D, x0), f"{cut} {order}")


CONV_CASES = [((8, 1, 1, 1), "dispatch"), ((2, 2, 2, 1), "dual-chunk"), ((1, 4, 2, 1), "natural")]


@needs_devices(8)
@pytest.mark.parametrize("cut,order", CONV_CASES, ids=[f"{'x'.join(map(str, c))}-{o}" for c, o in CONV_CASES])
def test_conv_halo_on_the_mesh_equals_the_recurrence(cut, order):
    """Width 4 over 8 tokens per device, and a dispatch plan's 2-token runs: halos that span several runs."""
    mesh = _mesh(*cut)
    x, w, bias, x0 = conv_args(B, S, 4, 4)
    layer = lambda x, w, bias, x0, **kw: linear.causal_conv1d(  # noqa: E731
        x, w, bias_C=bias, initial_state=x0, return_state=True, **kw)
    fast = lambda x, w, bias, x0: _in_order(layer, order, mesh)(1, x, w, bias, x0)  # noqa: E731
    ref = lambda x, w, bias, x0: linear.reference.causal_conv1d(  # noqa: E731
        x, w, bias_C=bias, positions=POS, segment_ids=SEG, initial_state=x0, return_state=True)
    _compare(fast, ref, (x, w, bias, x0), f"{cut} {order}")


@needs_devices(8)
def test_state_bytes_do_not_grow_with_the_sequence():
    """The layer's one collective moves the slots' maps (an all-to-all of ``c`` copies: per rank, 2 slots
    x 2 heads x (4*4 + 4*4) floats): the same operands for 4x the tokens. Operands are compared by dtype
    and element count (how XLA lays out the unit dimensions differs between releases)."""
    mesh = _mesh(4, 1, 1, dp=2)

    def collectives(S):
        q, k, v, g, beta, _ = gdn_args(2, S, 2, 4, 4)
        f = jax.jit(lambda *a: linear.gated_delta_rule(*a, mesh=mesh, chunk_size=8, max_pieces=2))
        text = f.lower(q, k, v, g, beta).compile().as_text()
        found = re.findall(r"= (\(?\w+\[[\d,]*\][^=]*?) (all-gather|all-reduce|all-to-all|collective-permute)\(",
                           text)
        operands = lambda shape: [(dt, math.prod(int(n) for n in dims.split(",") if n))
                                  for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", re.sub(r"\{[^}]*\}", "", shape))]
        return [(operands(shape), kind) for shape, kind in found]

    assert collectives(64) == collectives(256) == [([("f32", 2 * 2 * 32)] * 4, "all-to-all")]


@needs_devices(8)
def test_a_mesh_that_does_not_fit_is_a_value_error():
    q, k, v, g, beta, _ = gdn_args(2, 64, 4, 4, 4)
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by tp\*cp_ulysses=2\*4=8"):
        linear.gated_delta_rule(q, k, v, g, beta, mesh=_mesh(1, 4, 2))
    with pytest.raises(ValueError, match=r"seq_len=60 is not divisible by cp_colossal\*cp_ulysses=8"):
        linear.gated_delta_rule(*(a[:, :60] for a in (q, k, v, g, beta)), mesh=_mesh(8, 1, 1))
    with pytest.raises(ValueError, match=r"batch=2 is not divisible by dp=4"):
        linear.gated_delta_rule(q, k, v, g, beta, mesh=_mesh(2, 1, 1, dp=4))
    x, w, _, _ = conv_args(2, 64, 6, 4)
    with pytest.raises(ValueError, match=r"channels=6 is not divisible by tp=4: each device holds whole channels"):
        linear.causal_conv1d(x, w, mesh=_mesh(2, 1, 4))
    xs, dt, A, b, c, _, _ = ssd_args(2, 64, 4, 4, 4, 2)
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by tp\*cp_ulysses=8\*1=8"):
        linear.mamba2_ssd(xs, dt, A, b, c, mesh=_mesh(1, 1, 8))


@needs_devices(8)
def test_the_slots_counted_on_the_host_are_the_ones_the_mesh_needs():
    """Tokens in a random order on 4 colossal ranks: the host's count of state slots suffices on the
    mesh (the result is the recurrence's, not NaN) and one fewer is refused before anything runs."""
    mesh = _mesh(4, 1, 1, dp=2)
    perm = np.stack([np.random.RandomState(10 + b).permutation(S) for b in range(B)])
    take = lambda a: jnp.take_along_axis(jnp.asarray(a), perm.reshape(perm.shape + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
    q, k, v, g, beta, x0 = _gdn_args()
    args, pos, seg = [take(a) for a in (q, k, v, g, beta)], take(POS), take(SEG)
    need = linear._cp.needed_pieces(np.asarray(pos), np.asarray(seg), 4)
    assert need > 2, need  # the random order cuts documents on every rank
    got = linear.gated_delta_rule(*args, mesh=mesh, positions=pos, segment_ids=seg, chunk_size=8, max_pieces=need)
    assert_close(got, take(linear.reference.gated_delta_rule(q, k, v, g, beta, positions=POS, segment_ids=SEG)),
                 F32, "random order")
    with pytest.raises(ValueError, match=rf"max_pieces={need - 1} is too few .* pass max_pieces={need} or more"):
        linear.gated_delta_rule(*args, mesh=mesh, positions=pos, segment_ids=seg, chunk_size=8, max_pieces=need - 1)
    # Without max_pieces the host's count sizes the slots (rounded up to a power of two): the same result.
    dflt = linear.gated_delta_rule(*args, mesh=mesh, positions=pos, segment_ids=seg, chunk_size=8)
    assert_close(dflt, got, F32, "random order, slots sized on the host")
    assert linear._cp.placed_meta(pos, seg, B, S, mesh, linear._cp.layout(mesh, B, S, 2, 8, None),
                                  sized=True)[2].pieces == 1 << (need - 1).bit_length()


@needs_devices(8)
def test_the_default_slots_follow_the_order_known_on_the_host():
    """Without max_pieces: one slot per rank for the natural order (default metadata), even under a
    caller's jit, as for NumPy metadata closed over there (two for the dual-chunk order); traced
    metadata keep min(S/c, 16); the precision of the state products is HIGHEST."""
    mesh = _mesh(4, 1, 1, dp=2)
    q, k, v, g, beta, _ = gdn_args(2, 64, 2, 4, 4)

    def slots(**kw):
        text = jax.jit(lambda *a: linear.gated_delta_rule(*a, mesh=mesh, chunk_size=8, **kw)).lower(
            q, k, v, g, beta).as_text()
        return {int(m) for m in re.findall(r"all_to_all.*?tensor<1x(\d+)x4x1x2x32xf32>", text)}, text

    natural, text = slots()
    assert natural == {1}, natural
    assert "HIGHEST" in text  # the state products (jax_cp.linear._chains._apply)
    assert slots(max_pieces=3)[0] == {3}
    assert slots(positions=np.arange(64))[0] == {1}
    assert slots(positions=np.asarray(jax_cp.load_balance.positions(64, mesh)))[0] == {2}
    traced = jax.jit(lambda pos, *a: linear.gated_delta_rule(*a, mesh=mesh, chunk_size=8, positions=pos)).lower(
        jnp.arange(64, dtype=jnp.int32), q, k, v, g, beta).as_text()
    assert {int(m) for m in re.findall(r"all_to_all.*?tensor<1x(\d+)x4x1x2x32xf32>", traced)} == {16}


@needs_devices(8)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_documents_that_stay_on_their_rank_carry_only_the_state(per_channel):
    """Rows whose documents never cross a rank (one row ends its last document on rank 2, then pads):
    the host finds no cut, the layer carries only the state (no maps), only the final state's slot
    travels, and output, final state and gradients equal the recurrence; traced metadata (the general
    path with its maps) give the same."""
    pos, seg = packed(rows=((16, 10, 6, 16, 16), (16, 16, 8, 8)), pad=(0, 16))
    seg[1, -16:] = -1
    mesh = _mesh(4, 1, 1, dp=2)
    lay = linear._cp.layout(mesh, B, S, H, 8, None)
    assert not linear._cp.placed_meta(pos, seg, B, S, mesh, lay, sized=True)[2].cuts
    layer = lambda q, k, v, g, beta, x0, **kw: linear.gated_delta_rule(  # noqa: E731
        q, k, v, g, beta, initial_state=x0, chunk_size=8, return_state=True, **kw)
    fast = lambda *a: layer(*a, mesh=mesh, positions=pos, segment_ids=seg)  # noqa: E731
    ref = lambda *a: linear.reference.gated_delta_rule(*a[:5], positions=pos, segment_ids=seg,  # noqa: E731
                                                       initial_state=a[5], return_state=True)
    args = _gdn_args(per_channel)
    _compare(fast, ref, args, "uncut rows")
    traced = jax.jit(lambda p, s, *a: layer(*a, mesh=mesh, positions=p, segment_ids=s, max_pieces=2))(
        jnp.asarray(pos), jnp.asarray(seg), *args)
    for a, b in zip(traced, fast(*args)):
        assert_close(a, b, F32, "traced metadata, general path")
