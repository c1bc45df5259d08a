"""The pod planner: HLO schedule parser, flags, chips, reports on a small TPU topology, auto choice, CLI.

TPU programs are compiled ahead of time with the libtpu wheel's compiler
(``v5e:2x4``, a tiny layer); no TPU is needed.
"""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cp
from jax_cp import plan
from jax_cp.plan import _hlo

pytest.importorskip("libtpu", reason="the planner compiles with the libtpu wheel's TPU compiler")

TOPO = "v5e:2x4"
SMALL = dict(topology=TOPO, model="tiny", seq_len=512, batch=1)
PLAIN = dict(kv_exchange="all_gather", overlap_chunks=1, fused_qkv_chunks=0)  # not "auto": the layouts as stated

# Mesh (dp=1, cp_colossal=2, cp_ulysses=2, tp=2): device i sits at unravel_index(i, (1, 2, 2, 2)).
HLO = """HloModule jit_step, is_scheduled=true

%fused_matmul (p0: bf16[8,16], p1: bf16[16,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,16]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%ag_start_comp (p0.1: bf16[4,16]) -> (bf16[4,16], bf16[8,16], u32[]) {
  %p0.1 = bf16[4,16]{1,0} parameter(0)
  %all-gather.1 = bf16[8,16]{1,0} all-gather(%p0.1), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  ROOT %custom-call.1 = (bf16[4,16]{1,0}, bf16[8,16]{1,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.7 (p0.2: bf16[4,16], p1.2: bf16[8,16], p2.2: bf16[8,16], p3.2: bf16[16,16]) -> (bf16[8,16], bf16[4,16], bf16[8,16]) {
  %p0.2 = bf16[4,16]{1,0} parameter(0)
  %p1.2 = bf16[8,16]{1,0} parameter(1)
  %p2.2 = bf16[8,16]{1,0} parameter(2)
  %p3.2 = bf16[16,16]{1,0} parameter(3)
  %convolution.2 = bf16[8,16]{1,0} convolution(%p2.2, %p3.2), dim_labels=bf_io->bf
  %all-gather.2 = bf16[8,16]{1,0} all-gather(%p0.2), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  ROOT %tuple.2 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}, bf16[8,16]{1,0}) tuple(%convolution.2, %p0.2, %all-gather.2)
}

%ag_done_comp (p0.3: bf16[4,16], p1.3: bf16[8,16]) -> bf16[8,16] {
  %p0.3 = bf16[4,16]{1,0} parameter(0)
  %p1.3 = bf16[8,16]{1,0} parameter(1)
  %all-gather.3 = bf16[8,16]{1,0} all-gather(%p0.3), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  ROOT %custom-call.3 = bf16[8,16]{1,0} custom-call(%p0.3, %p1.3, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16], s: bf16[4,16], g: f32[8,16]) -> (f32[4,16], f32[8,16], bf16[8,16], bf16[8,16]) {
  %x = bf16[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %w = bf16[16,16]{1,0} parameter(1), metadata={op_name="w"}
  %s = bf16[4,16]{1,0} parameter(2)
  %g = f32[8,16]{1,0} parameter(3)
  %all-to-all-start = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) all-to-all-start(%x), channel_id=2, replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/all_to_all"}
  %fusion.1 = bf16[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul, backend_config={"note":"{\"a\": 1,
}}, metadata={op_name="jit(step)/jvp()/dot_general"}
  %all-to-all-done = bf16[8,16]{1,0} all-to-all-done(%all-to-all-start), metadata={op_name="jit(step)/jvp()/shard_map/all_to_all"}
  %all-to-all-start.1 = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[], u32[]) all-to-all-start(%fusion.1), channel_id=3, replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/shard_map/all_to_all"}
  %all-to-all-done.1 = bf16[8,16]{1,0} all-to-all-done(%all-to-all-start.1)
  %fusion.4 = bf16[8,16]{1,0} fusion(%all-to-all-done.1, %w), kind=kOutput, calls=%fused_matmul
  %async-collective-start = (bf16[4,16]{1,0}, bf16[8,16]{1,0}, u32[]) fusion(%s), kind=kCustom, calls=%ag_start_comp
  %get-tuple-element.1 = bf16[4,16]{1,0} get-tuple-element(%async-collective-start), index=0
  %get-tuple-element.2 = bf16[8,16]{1,0} get-tuple-element(%async-collective-start), index=1
  %fusion.2 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}, bf16[8,16]{1,0}) fusion(%get-tuple-element.1, %get-tuple-element.2, %all-to-all-done, %w), kind=kOutput, calls=%async_collective_fusion.7
  %get-tuple-element.3 = bf16[4,16]{1,0} get-tuple-element(%fusion.2), index=1
  %get-tuple-element.4 = bf16[8,16]{1,0} get-tuple-element(%fusion.2), index=2
  %async-collective-done = bf16[8,16]{1,0} fusion(%get-tuple-element.3, %get-tuple-element.4), kind=kCustom, calls=%ag_done_comp
  %reduce-scatter.1 = f32[4,16]{1,0} reduce-scatter(%g), channel_id=4, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/shard_map/reduce_scatter"}
  %all-reduce.1 = f32[8,16]{1,0} all-reduce(%g), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %fusion.3 = bf16[8,16]{1,0} fusion(%async-collective-done, %w), kind=kOutput, calls=%fused_matmul
  ROOT %tuple = (f32[4,16]{1,0}, f32[8,16]{1,0}, bf16[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%reduce-scatter.1, %all-reduce.1, %fusion.3, %fusion.4)
}
"""
MESH = dict(mesh_shape=(1, 2, 2, 2), axis_names=("dp", "cp_colossal", "cp_ulysses", "tp"))


def test_parser_on_hand_written_hlo():
    """Async all-to-all, TPU async collective fusion, sync collectives, a multi-line instruction."""
    s = plan.analyze_schedule(HLO, **MESH)
    got = {c.name: c for c in s.collectives}
    assert list(got) == ["all-to-all-start", "all-to-all-start.1", "async-collective-start", "reduce-scatter.1",
                         "all-reduce.1"]
    a2a, a2a_bwd, ag, rs, ar = got.values()
    # A matmul fusion between start and done: hidden. Nothing between: exposed.
    assert (a2a.kind, a2a.axes, a2a.bytes, a2a.phase, a2a.overlapped) == (
        "all-to-all", ("cp_ulysses",), 8 * 16 * 2, "fwd", True)
    assert a2a.compute_inside == ("fusion.1",)
    assert (a2a_bwd.axes, a2a_bwd.phase, a2a_bwd.is_async, a2a_bwd.overlapped) == (("cp_ulysses",), "bwd", True, False)
    # TPU async collective fusion: start/continuation/done fusions, a convolution in the continuation.
    assert (ag.kind, ag.axes, ag.bytes, ag.is_async, ag.overlapped, ag.compute_inside) == (
        "all-gather", ("cp_colossal",), 8 * 16 * 2, True, True, ("fusion.2",))
    # A collective left in the entry computation is synchronous; transpose(...) marks backward.
    assert (rs.kind, rs.axes, rs.bytes, rs.phase, rs.is_async) == ("reduce-scatter", ("cp_colossal",), 8 * 16 * 4, "bwd", False)
    # A reduction no matmul consumes (a parameter gradient) is not a CP exchange.
    assert ar.axes == ("cp_colossal", "cp_ulysses", "tp") and not ar.feeds_compute and not s.is_cp(ar)
    assert not rs.feeds_compute and not s.is_cp(rs) and ag.feeds_compute and s.is_cp(ag)
    # FLOPs of the compute inside, from the shapes: one [8,16] x [16,16] matmul each.
    assert a2a.flops_inside == ag.flops_inside == 2 * 8 * 16 * 16 and a2a_bwd.flops_inside == 0
    # Transfer time covered: 128 wire bytes at 1 MB/s = 128 us each, the matmul 4.1 us at 1 GFLOP/s.
    assert s.time_covered("fwd", flops_per_s=1e9, bytes_per_s=1e6) == pytest.approx(4096 / 1e9 / 128e-6)
    assert s.time_covered("fwd", flops_per_s=1e9, bytes_per_s=1e12) == 1.0  # a short enough transfer is covered
    assert s.time_covered("bwd", flops_per_s=1e9, bytes_per_s=1e12) == 0.0  # nothing inside the backward one
    # HBM bytes inside: fusion.1 reads x and w and writes its result (256 + 512 + 256); the collective
    # fusion's continuation reads what it uses (its unused operand not at all) and writes its tuple.
    assert (a2a.bytes_inside, ag.bytes_inside, a2a_bwd.bytes_inside) == (1024, 128 + 256 + 512 + 640, 0)
    # With an HBM rate, the ops inside take their roofline: the larger of FLOP time and byte time.
    assert s.time_covered("fwd", flops_per_s=1e9, bytes_per_s=1e6, hbm_bytes_per_s=1e8) == pytest.approx(
        (1024 + 1536) / 1e8 / 2 / 128e-6)  # 10.2 and 15.4 us of HBM time, above the matmuls' 4.1 us
    assert s.time_covered("fwd", flops_per_s=1e9, bytes_per_s=1e6, hbm_bytes_per_s=1e12) == pytest.approx(
        4096 / 1e9 / 128e-6)  # fast HBM: the FLOPs bound it again
    assert s.time_covered("bwd", flops_per_s=1e9, bytes_per_s=1e6, hbm_bytes_per_s=1e3) == 0.0  # not overlapped
    # Overlap fraction = overlapped bytes / all CP bytes, per phase.
    assert s.overlap_fraction("fwd") == 1.0
    assert s.overlap_fraction("bwd") == 0.0
    assert s.overlap_fraction() == pytest.approx((256 + 256) / (256 + 256 + 256))


# The same kinds of ops as the scheduled HLO reads under jax 0.12 (jaxlib 0.12.0.1, libtpu 0.0.52): named-mesh replica
# groups (`mesh[...] {axes}`) and `%name#k` operands for tuple elements instead of get-tuple-element instructions.
HLO_MESH = """HloModule jit_step, is_scheduled=true

%fused_matmul (p0: bf16[8,16], p1: bf16[16,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,16]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%split (p0.5: bf16[8,16]) -> (bf16[8,16], bf16[4,16]) {
  %p0.5 = bf16[8,16]{1,0} parameter(0)
  %slice.5 = bf16[4,16]{1,0} slice(%p0.5), slice={[0:4], [0:16]}
  ROOT %tuple.5 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}) tuple(%p0.5, %slice.5)
}

%async_computation (param_0: bf16[8,16]) -> bf16[8,16] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  ROOT %all_to_all.1 = bf16[8,16]{1,0} all-to-all(%param_0), channel_id=1, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'cp_ulysses'}, dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/shard_map/all_to_all" stack_frame_id=7}
}

%async_computation.1 (param_0.1: bf16[8,16]) -> bf16[8,16] {
  %param_0.1 = bf16[8,16]{1,0} parameter(0)
  ROOT %all_to_all.2 = bf16[8,16]{1,0} all-to-all(%param_0.1), channel_id=2, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'cp_colossal','cp_ulysses'}, dimensions={0}
}

%ag_start_comp (p0.1: bf16[4,16]) -> (bf16[4,16], bf16[8,16], u32[]) {
  %p0.1 = bf16[4,16]{1,0} parameter(0)
  %all-gather.1 = bf16[8,16]{1,0} all-gather(%p0.1), channel_id=4, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'cp_colossal'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  ROOT %custom-call.1 = (bf16[4,16]{1,0}, bf16[8,16]{1,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.7 (p0.2: bf16[4,16], p1.2: bf16[8,16], p2.2: bf16[8,16], p3.2: bf16[16,16]) -> (bf16[8,16], bf16[4,16], bf16[8,16]) {
  %p0.2 = bf16[4,16]{1,0} parameter(0)
  %p1.2 = bf16[8,16]{1,0} parameter(1)
  %p2.2 = bf16[8,16]{1,0} parameter(2)
  %p3.2 = bf16[16,16]{1,0} parameter(3)
  %convolution.2 = bf16[8,16]{1,0} convolution(%p2.2, %p3.2), dim_labels=bf_io->bf
  %all-gather.2 = bf16[8,16]{1,0} all-gather(%p0.2), channel_id=4, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'cp_colossal'}, dimensions={0}, use_global_device_ids=true
  ROOT %tuple.2 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}, bf16[8,16]{1,0}) tuple(%convolution.2, %p0.2, %all-gather.2)
}

%ag_done_comp (p0.3: bf16[4,16], p1.3: bf16[8,16]) -> bf16[8,16] {
  %p0.3 = bf16[4,16]{1,0} parameter(0)
  %p1.3 = bf16[8,16]{1,0} parameter(1)
  %all-gather.3 = bf16[8,16]{1,0} all-gather(%p0.3), channel_id=4, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'cp_colossal'}, dimensions={0}, use_global_device_ids=true
  ROOT %custom-call.3 = bf16[8,16]{1,0} custom-call(%p0.3, %p1.3, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16], s: bf16[4,16]) -> (bf16[8,16], bf16[8,16], bf16[8,16], bf16[8,16], bf16[8,16]) {
  %x = bf16[8,16]{1,0} parameter(0), metadata={op_name="x"}
  %w = bf16[16,16]{1,0} parameter(1), metadata={op_name="w"}
  %s = bf16[4,16]{1,0} parameter(2)
  %all-to-all-start = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) async-start(%x), calls=%async_computation
  %convolution_fusion = bf16[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul, metadata={op_name="jit(step)/jvp()/dot_general"}
  %all-to-all-done = bf16[8,16]{1,0} async-done(%all-to-all-start)
  %split_fusion = (bf16[8,16]{1,0}, bf16[4,16]{1,0}) fusion(%convolution_fusion), kind=kLoop, calls=%split
  %all-to-all-start.1 = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) async-start(%split_fusion#0), calls=%async_computation.1, metadata={op_name="jit(step)/jvp()/shard_map/all_to_all" stack_frame_id=9}
  %all-to-all-done.1 = bf16[8,16]{1,0} async-done(%all-to-all-start.1), metadata={op_name="jit(step)/jvp()/shard_map/all_to_all" stack_frame_id=9}
  %all_gather.3 = bf16[8,16]{1,0} all-gather(%split_fusion#1), channel_id=3, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'dp','cp_colossal'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  %async-collective-start = (bf16[4,16]{1,0}, bf16[8,16]{1,0}, u32[]) fusion(%s), kind=kCustom, calls=%ag_start_comp
  %fusion.2 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}, bf16[8,16]{1,0}) fusion(%async-collective-start#0, %async-collective-start#1, %all-to-all-done, %w), kind=kOutput, calls=%async_collective_fusion.7
  %async-collective-done = bf16[8,16]{1,0} fusion(%fusion.2#1, %fusion.2#2), kind=kCustom, calls=%ag_done_comp
  %psum.4 = bf16[8,16]{1,0} all-reduce(%all-to-all-done.1), channel_id=5, replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'tp'}, use_global_device_ids=true, to_apply=%add
  %split_fusion.2 = (bf16[8,16]{1,0}, bf16[4,16]{1,0}) fusion(%psum.4), kind=kLoop, calls=%split
  %fusion.3 = bf16[8,16]{1,0} fusion(%all_gather.3, %w), kind=kOutput, calls=%fused_matmul
  %fusion.4 = bf16[8,16]{1,0} fusion(%split_fusion.2#0, %w), kind=kOutput, calls=%fused_matmul
  %fusion.5 = bf16[8,16]{1,0} fusion(%async-collective-done, %w), kind=kOutput, calls=%fused_matmul
  ROOT %tuple = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, bf16[8,16]{1,0}, bf16[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%fusion.2#0, %fusion.3, %fusion.4, %fusion.5, %all-to-all-done)
}
"""


# A ring-style loop: a permute carried into the next trip with a matmul inside, five trips (fori_loop's
# condition form), and one exposed permute of the same bytes in the entry computation.
HLO_LOOP = """HloModule jit_ring, is_scheduled=true

%fused_matmul (p0: bf16[8,16], p1: bf16[16,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,16]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%cond (c: (s32[], bf16[8,16], bf16[16,16])) -> pred[] {
  %c = (s32[], bf16[8,16]{1,0}, bf16[16,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %five), direction=LT
}

%body (b: (s32[], bf16[8,16], bf16[16,16])) -> (s32[], bf16[8,16], bf16[16,16]) {
  %b = (s32[], bf16[8,16]{1,0}, bf16[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %kv = bf16[8,16]{1,0} get-tuple-element(%b), index=1
  %w = bf16[16,16]{1,0} get-tuple-element(%b), index=2
  %collective-permute-start = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) collective-permute-start(%kv), channel_id=1, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}, metadata={op_name="jit(ring)/jvp()/shard_map/ppermute"}
  %fusion = bf16[8,16]{1,0} fusion(%kv, %w), kind=kOutput, calls=%fused_matmul
  %collective-permute-done = bf16[8,16]{1,0} collective-permute-done(%collective-permute-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,16]{1,0}, bf16[16,16]{1,0}) tuple(%next, %collective-permute-done, %w)
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16]) -> bf16[8,16] {
  %x = bf16[8,16]{1,0} parameter(0)
  %w.0 = bf16[16,16]{1,0} parameter(1)
  %collective-permute-start.1 = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}, metadata={op_name="jit(ring)/jvp()/shard_map/ppermute"}
  %collective-permute-done.1 = bf16[8,16]{1,0} collective-permute-done(%collective-permute-start.1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,16]{1,0}, bf16[16,16]{1,0}) tuple(%zero, %collective-permute-done.1, %w.0)
  %while = (s32[], bf16[8,16]{1,0}, bf16[16,16]{1,0}) while(%init), condition=%cond, body=%body
  %out = bf16[8,16]{1,0} get-tuple-element(%while), index=1
  ROOT %fusion.9 = bf16[8,16]{1,0} fusion(%out, %w.0), kind=kOutput, calls=%fused_matmul
}
"""


def test_parser_counts_loop_transfers_per_trip():
    """A transfer a loop carries into its next trip feeds that trip's matmul: a CP transfer, counted once per
    trip in the overlap fraction (5 hidden trips against 1 exposed transfer); HBM bytes of the body's other
    trips are what a cost analysis counting the body once leaves out."""
    from jax_cp.plan._hlo import loop_bytes

    s = plan.analyze_schedule(HLO_LOOP, **MESH)
    loop, entry = s.collectives
    assert (loop.in_loop, loop.iterations, loop.overlapped, loop.axes) == (True, 5, True, ("cp_colossal",))
    assert s.is_cp(loop) and s.is_cp(entry) and not entry.overlapped
    assert s.overlap_fraction("fwd") == pytest.approx(5 / 6)
    # One trip: the permute start reads its 256 B operand and writes 256 B (its tuple: both buffers); the
    # fusion reads 256 + 512 B and writes 256 B; the counter add 12 B. Four more trips than the one counted.
    assert loop_bytes(HLO_LOOP) == 4 * (512 + (256 + 512 + 256) + 12)


# A scan's body as the TPU compiler writes it (libtpu, jax 0.10: a step's row written into the carried
# f32[1024,128] output buffer, the input row read out of the stacked inputs), eight trips: a plain
# dynamic-update-slice, a fusion rooted in one (through a bitcast, beside a second output in a tuple) that
# reads its input row with a dynamic-slice, an elementwise fusion, and two updates not in place.
HLO_SCAN = """HloModule jit_scan, is_scheduled=true

%fused_add (p0: f32[4,128], p1: f32[4,128]) -> f32[4,128] {
  %p0 = f32[4,128]{1,0} parameter(0)
  %p1 = f32[4,128]{1,0} parameter(1)
  ROOT %add.1 = f32[4,128]{1,0} add(%p0, %p1)
}

%fused_step (param_0: f32[1024,128], param_1: s32[], param_2: f32[1024,128], param_3: f32[4,128]) -> (f32[1024,128], f32[4,128]) {
  %param_0 = f32[1024,128]{1,0} parameter(0)
  %param_2 = f32[1024,128]{1,0} parameter(2)
  %param_1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %dynamic-slice.1 = f32[4,128]{1,0} dynamic-slice(%param_2, %param_1, %zero.1), dynamic_slice_sizes={4,128}
  %param_3 = f32[4,128]{1,0} parameter(3)
  %add.2 = f32[4,128]{1,0} add(%dynamic-slice.1, %param_3)
  %tanh.1 = f32[4,128]{1,0} tanh(%add.2)
  %bitcast.1 = f32[1,4,128]{2,1,0} bitcast(%tanh.1)
  %bitcast.2 = f32[1,4,128]{2,1,0} bitcast(%param_0)
  %dynamic-update-slice.1 = f32[1,1024,128]{2,1,0} dynamic-update-slice(%bitcast.2, %bitcast.1, %zero.1, %param_1, %zero.1)
  %bitcast.3 = f32[1024,128]{1,0} bitcast(%dynamic-update-slice.1)
  ROOT %tuple.1 = (f32[1024,128]{1,0}, f32[4,128]{1,0}) tuple(%bitcast.3, %tanh.1)
}

%fused_fresh (param_0.1: f32[4,128], param_1.1: s32[]) -> f32[1024,128] {
  %param_0.1 = f32[4,128]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero.2 = s32[] constant(0)
  %zeros = f32[] constant(0)
  %broadcast.1 = f32[1024,128]{1,0} broadcast(%zeros), dimensions={}
  ROOT %dynamic-update-slice.2 = f32[1024,128]{1,0} dynamic-update-slice(%broadcast.1, %param_0.1, %param_1.1, %zero.2)
}

%fused_scaled (param_0.2: f32[1024,128], param_1.2: f32[4,128], param_2.2: s32[]) -> f32[1024,128] {
  %param_0.2 = f32[1024,128]{1,0} parameter(0)
  %param_1.2 = f32[4,128]{1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %zero.3 = s32[] constant(0)
  %dynamic-update-slice.3 = f32[1024,128]{1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %zero.3)
  ROOT %negate.1 = f32[1024,128]{1,0} negate(%dynamic-update-slice.3)
}

%cond (c: (s32[], f32[1024,128], f32[1024,128], f32[4,128], f32[1024,128])) -> pred[] {
  %c = (s32[], f32[1024,128]{1,0}, f32[1024,128]{1,0}, f32[4,128]{1,0}, f32[1024,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c), index=0
  %eight = s32[] constant(8)
  ROOT %lt = pred[] compare(%i.1, %eight), direction=LT
}

%body (b: (s32[], f32[1024,128], f32[1024,128], f32[4,128], f32[1024,128])) -> (s32[], f32[1024,128], f32[1024,128], f32[4,128], f32[1024,128]) {
  %b = (s32[], f32[1024,128]{1,0}, f32[1024,128]{1,0}, f32[4,128]{1,0}, f32[1024,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %ys = f32[1024,128]{1,0} get-tuple-element(%b), index=1
  %xs = f32[1024,128]{1,0} get-tuple-element(%b), index=2
  %h = f32[4,128]{1,0} get-tuple-element(%b), index=3
  %zs = f32[1024,128]{1,0} get-tuple-element(%b), index=4
  %zero = s32[] constant(0)
  %plain = f32[1024,128]{1,0} dynamic-update-slice(%zs, %h, %i, %zero)
  %step = (f32[1024,128]{1,0}, f32[4,128]{1,0}) fusion(%ys, %i, %xs, %h), kind=kLoop, calls=%fused_step
  %ys.1 = f32[1024,128]{1,0} get-tuple-element(%step), index=0
  %h.1 = f32[4,128]{1,0} get-tuple-element(%step), index=1
  %sum = f32[4,128]{1,0} fusion(%h.1, %h), kind=kLoop, calls=%fused_add
  %fresh = f32[1024,128]{1,0} fusion(%sum, %i), kind=kLoop, calls=%fused_fresh
  %scaled = f32[1024,128]{1,0} fusion(%fresh, %sum, %i), kind=kLoop, calls=%fused_scaled
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024,128]{1,0}, f32[1024,128]{1,0}, f32[4,128]{1,0}, f32[1024,128]{1,0}) tuple(%next, %ys.1, %xs, %sum, %plain)
}

ENTRY %main (xs.0: f32[1024,128]) -> f32[1024,128] {
  %xs.0 = f32[1024,128]{1,0} parameter(0)
  %zero.0 = s32[] constant(0)
  %z = f32[] constant(0)
  %ys.0 = f32[1024,128]{1,0} broadcast(%z), dimensions={}
  %h.0 = f32[4,128]{1,0} broadcast(%z), dimensions={}
  %init = (s32[], f32[1024,128]{1,0}, f32[1024,128]{1,0}, f32[4,128]{1,0}, f32[1024,128]{1,0}) tuple(%zero.0, %ys.0, %xs.0, %h.0, %ys.0)
  %while = (s32[], f32[1024,128]{1,0}, f32[1024,128]{1,0}, f32[4,128]{1,0}, f32[1024,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024,128]{1,0} get-tuple-element(%while), index=1
}
"""


def test_loop_bytes_count_in_place_updates_and_slices_by_what_they_touch():
    """A dynamic-update-slice writes its update into its buffer in place (a scan's output, per trip): it
    reads and writes the update's bytes, not the buffer's; a slice reads its result's bytes of its operand.
    An update into a buffer the fusion makes itself (a broadcast), or one read whole after it, is not."""
    from jax_cp.plan._hlo import _Module, instr_bytes, loop_bytes

    mod = _Module(HLO_SCAN)
    got = {i.name: instr_bytes(mod, "body", i) for i in mod.comps["body"]}
    row, buffer = 4 * 128 * 4, 1024 * 128 * 4  # the f32[4,128] update, the f32[1024,128] buffer
    # Plain: reads and writes the update, reads its two s32 indices; the buffer is untouched.
    assert got["plain"] == 2 * row + 2 * 4
    # Fusion rooted (through bitcasts, in a tuple) in the update of its parameter 0: its index, its input row
    # (a dynamic-slice of xs) and h read; the row written into ys and its second output h.1 written.
    assert got["step"] == (4 + row + row) + (row + row)
    # Elementwise: both operands read and its result written, as before.
    assert got["sum"] == 3 * row
    # An update into a broadcast is the whole buffer written; one negated after is the buffer read and written.
    assert got["fresh"] == row + 4 + buffer
    assert got["scaled"] == buffer + row + 4 + buffer
    assert loop_bytes(HLO_SCAN) == 7 * sum(got.values())  # seven trips more than the one counted


# Splash kernel calls as libtpu 0.0.52 schedules them: named after the kernel, or, vmapped over a device's
# batch rows (a loop over them), ``closed_call`` with the kernel in its op_name and metadata over lines.
HLO_KERNELS = """HloModule jit_train_step, is_scheduled=true

%row_body (p: (s32[], bf16[1,1024,16])) -> (s32[], bf16[1,1024,16]) {
  %p = (s32[], bf16[1,1024,16]{2,1,0}) parameter(0)
  %q.1 = bf16[1,1024,16]{2,1,0} get-tuple-element(%p), index=1
  %closed_call.177 = (f32[512,128]{1,0}, bf16[1,1024,16]{2,1,0}) custom-call(%q.1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="jit(train_step)/jvp()/shard_map/vmap()/static_sparsity_splash/jit(_splash_attention)/splash_mqa_fwd_segmented_residuals/splash_mqa_fwd_segmented_residuals/while/body/closed_call/pallas_call" stack_frame_id=918}, backend_config={"custom_call_config":{"body":"TUzvUgFN"}}
  %closed_call.178 = bf16[1,1024,16]{2,1,0} custom-call(%q.1), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/my_pallas_kernel/pallas_call"}
  ROOT %t = (s32[], bf16[1,1024,16]{2,1,0}) tuple(%p, %closed_call.177)
}

ENTRY %main (q: bf16[1,1024,16]) -> bf16[1,1024,16] {
  %q = bf16[1,1024,16]{2,1,0} parameter(0)
  %splash_mha_dq_no_residuals.3 = bf16[1,1024,16]{2,1,0} custom-call(%q), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/transpose(jvp())/splash_mha_dq_no_residuals/pallas_call"}
  ROOT %splash_mha_dkv_no_residuals.4 = bf16[1,1024,16]{2,1,0} custom-call(%q), custom_call_target="tpu_custom_call"
}
"""


def test_kernel_calls_named_and_vmapped():
    """The report's kernel that ran: splash calls named after the kernel and vmapped ones (a
    ``closed_call`` whose op_name names it) count once each; another Pallas kernel does not."""
    from jax_cp.plan._analyze import kernel_calls

    assert dict(kernel_calls(HLO_KERNELS)) == {"splash_mqa_fwd": 1, "splash_mha_dq": 1, "splash_mha_dkv": 1}


def test_parser_on_hand_written_hlo_jax_0_12_form():
    """Named-mesh replica groups, async-start calling the collective's computation, `%name#k` operands."""
    s = plan.analyze_schedule(HLO_MESH, **MESH)
    got = {c.name: c for c in s.collectives}
    assert list(got) == ["all-to-all-start", "all-to-all-start.1", "all_gather.3", "async-collective-start", "psum.4"]
    a2a, a2a_1, ag_sync, ag, ar = got.values()
    # async-start -> %async_computation holding the all-to-all and its mesh-form groups; a convolution fusion
    # before the done: overlapped. Phase from the inner op's metadata (the async-start has none).
    assert (a2a.kind, a2a.axes, a2a.group_size, a2a.bytes, a2a.phase, a2a.is_async, a2a.overlapped) == (
        "all-to-all", ("cp_ulysses",), 2, 8 * 16 * 2, "bwd", True, True)
    assert a2a.compute_inside == ("convolution_fusion",) and a2a.feeds_compute
    # Two group axes; phase from the async-start's metadata (the inner op has none); nothing before the done.
    assert (a2a_1.kind, a2a_1.axes, a2a_1.group_size, a2a_1.phase, a2a_1.is_async, a2a_1.overlapped) == (
        "all-to-all", ("cp_colossal", "cp_ulysses"), 4, "fwd", True, False)
    # A size-1 axis (dp) in the group adds nothing; bytes of `%split_fusion#1` are its element's, not the tuple's.
    assert (ag_sync.kind, ag_sync.axes, ag_sync.bytes, ag_sync.is_async) == ("all-gather", ("cp_colossal",), 256, False)
    # TPU async collective fusion chained through `#k` operands (no get-tuple-element).
    assert (ag.kind, ag.axes, ag.bytes, ag.is_async, ag.overlapped, ag.compute_inside) == (
        "all-gather", ("cp_colossal",), 8 * 16 * 2, True, True, ("fusion.2",))
    # The all-reduce's result reaches a matmul only through `%split_fusion.2#0`.
    assert ar.axes == ("tp",) and ar.feeds_compute and not s.is_cp(ar)
    assert s.overlap_fraction("fwd") == pytest.approx(256 / (256 + 256 + 256))
    assert s.overlap_fraction("bwd") == 1.0


# v5p with --xla_tpu_enable_sparse_core_collective_offload_all_gather (libtpu 0.0.52, trimmed): an operand-less
# async-start on the "sparsecore" thread whose computation reaches the all-gather through a custom-call's
# called_computations; the data arrives by async-update; computations close with "}, execution_thread=...".
HLO_SPARSECORE = """HloModule jit_step, is_scheduled=true

%called_computation.1 (param_0.578: bf16[4,16]) -> bf16[8,16] {
  %param_0.578 = bf16[4,16]{1,0} parameter(0)
  ROOT %all-gather.3 = bf16[8,16]{1,0} all-gather(%param_0.578), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}, execution_thread="sparsecore"

%async_computation.1 (param_0.577: bf16[4,16]) -> bf16[8,16] {
  %param_0.577 = bf16[4,16]{1,0} parameter(0)
  ROOT %custom-call.4 = bf16[8,16]{1,0} custom-call(%param_0.577), custom_call_target="TODO(b/522284627)", called_computations={%called_computation.1}
}, execution_thread="sparsecore"

%fused_matmul (p0: bf16[8,16], p1: bf16[16,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[8,16]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[8,16], w: bf16[16,16], k: bf16[4,16]) -> (bf16[8,16], bf16[8,16]) {
  %x = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,16]{1,0} parameter(1)
  %k = bf16[4,16]{1,0} parameter(2)
  %all-gather.2.call-start = ((), (), (s32[8]{0}, /*index=1*/s32[4]{0})) async-start(), async_execution_thread="sparsecore", calls=%async_computation.1, metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  %all-gather.2.call-update = ((bf16[4,16]{1,0}), bf16[8,16]{1,0}, (s32[8]{0}, s32[4]{0})) async-update(%all-gather.2.call-start, %k)
  %fusion.1 = bf16[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul
  %all-gather.2.call-done = bf16[8,16]{1,0} async-done(%all-gather.2.call-update), metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  %fusion.2 = bf16[8,16]{1,0} fusion(%all-gather.2.call-done, %w), kind=kOutput, calls=%fused_matmul
  ROOT %tuple = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%fusion.1, %fusion.2)
}
"""


HLO_ARS = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%all-reduce-scatter.clone.1 (input.7: f32[16,16]) -> f32[8,16] {
  %input.7 = f32[16,16]{1,0} parameter(0)
  %all-reduce.358 = f32[16,16]{1,0} all-reduce(%input.7), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/shard_map/reduce_scatter"}
  %partition-id.94 = u32[] partition-id()
  %constant.1 = u32[] constant(0)
  ROOT %dynamic-slice.1618 = f32[8,16]{1,0} dynamic-slice(%all-reduce.358, %partition-id.94, %constant.1), dynamic_slice_sizes={8,16}
}

ENTRY %main (g: f32[16,16]) -> f32[8,16] {
  %g = f32[16,16]{1,0} parameter(0)
  ROOT %fusion.1667 = f32[8,16]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.clone.1
}
"""


def test_parser_reads_the_all_reduce_scatter_fusion_as_a_reduce_scatter():
    """TPU's ``all-reduce-scatter`` fusion (an all-reduce and a slice of it, what XLA makes of a gradient's
    reduce-scatter) moves a reduce-scatter's bytes, not an all-reduce's twice as many."""
    (c,) = plan.analyze_schedule(HLO_ARS, **MESH).collectives
    assert (c.kind, c.axes, c.bytes, c.phase, c.is_async) == ("reduce-scatter", ("cp_colossal",), 16 * 16 * 4,
                                                              "bwd", False)
    assert c.wire_bytes == 16 * 16 * 4 / 2  # (n - 1) / n of the input over n = 2, where an all-reduce sends 2x
    plain = plan.analyze_schedule(HLO_ARS.replace("all-reduce-scatter.clone.1", "fused_sum"), **MESH).collectives
    assert plain[0].kind == "all-reduce" and plain[0].wire_bytes == 2 * c.wire_bytes


def test_parser_sparsecore_offloaded_all_gather():
    s = plan.analyze_schedule(HLO_SPARSECORE, **MESH)
    (ag,) = s.collectives  # one collective: the inner all-gather is not counted again as synchronous
    assert (ag.kind, ag.axes, ag.bytes, ag.phase, ag.is_async, ag.overlapped, ag.compute_inside) == (
        "all-gather", ("cp_colossal",), 8 * 16 * 2, "fwd", True, True, ("fusion.1",))
    assert ag.feeds_compute and s.overlap_fraction("fwd") == 1.0


def test_parser_sparsecore_transfer_begins_at_the_update():
    # The same program with the matmul scheduled between the operand-less start and the update that
    # brings the data in: the transfer cannot have begun under it, so nothing is inside.
    update = "  %all-gather.2.call-update = ((bf16[4,16]{1,0}), bf16[8,16]{1,0}, (s32[8]{0}, s32[4]{0})) async-update(%all-gather.2.call-start, %k)\n"
    matmul = "  %fusion.1 = bf16[8,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul\n"
    assert update + matmul in HLO_SPARSECORE
    (ag,) = plan.analyze_schedule(HLO_SPARSECORE.replace(update + matmul, matmul + update), **MESH).collectives
    assert (ag.kind, ag.is_async, ag.compute_inside, ag.overlapped) == ("all-gather", True, (), False)


def test_parser_mesh_replica_groups():
    groups = _hlo._groups
    assert groups("replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("replica_groups=mesh['a'=2,'b'=4] {'a'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Sub-axes: 'a':(p)k is the size-k factor of a below its major size-p factor.
    assert groups("replica_groups=mesh['a'=8] {'a':(1)2}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("replica_groups=mesh['a'=8] {'a':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # An explicit device order (iota-with-transpose or a list).
    assert groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'b'}") == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,1,0,2) {'b'}") == [[3, 1], [0, 2]]
    assert _hlo._axes(groups("replica_groups=mesh['dp'=1,'cp_colossal'=2,'cp_ulysses'=2,'tp'=2] {'dp','tp'}"),
                      (1, 2, 2, 2), MESH["axis_names"]) == ("tp",)


def test_parser_iota_replica_groups_and_shapes():
    groups = _hlo._groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}")
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _hlo._axes(groups, (1, 2, 2, 2), MESH["axis_names"]) == ("cp_ulysses",)
    assert _hlo.array_bytes("(bf16[2,3]{1,0:T(8,128)(2,1)}, f32[4], u32[])") == 12 + 16 + 4
    with pytest.raises(ValueError, match="no ENTRY computation"):
        plan.analyze_schedule("HloModule m\n", **MESH)
    with pytest.raises(ValueError, match="differ in length"):
        plan.analyze_schedule(HLO, mesh_shape=(2, 4), axis_names=("dp",))


def test_recommended_flags():
    tpu = plan.recommended_xla_flags("tpu")
    assert "--xla_tpu_enable_async_all_to_all=true" in tpu
    fusion = "--xla_tpu_enable_async_collective_fusion=true"  # libtpu refuses it on chips other than v5e
    assert fusion not in tpu and fusion in plan.recommended_xla_flags("tpu", chip="v5e")
    v5p = plan.recommended_xla_flags("tpu", chip="v5p")
    assert "--xla_tpu_enable_all_experimental_scheduler_features=true" in v5p
    assert "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true" in v5p and fusion not in v5p
    # gradient sums and tp sums: offloaded to the SparseCores on v5p, continued in matmuls on v5e
    offload = "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
    fuse = "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true"
    assert offload in v5p and fuse in plan.recommended_xla_flags("tpu", chip="v5e")
    assert offload not in tpu and fuse not in tpu and fuse not in v5p
    # FSDP on v5p: the gradient reduce-scatters and two-axis weight gathers offloaded too (v5p only)
    scatter = "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true"
    assert scatter in plan.recommended_xla_flags("tpu", chip="v5p", fsdp=True) and scatter not in v5p
    assert plan.recommended_xla_flags("tpu", chip="v5e", fsdp=True) == plan.recommended_xla_flags("tpu", chip="v5e")
    assert plan.compiler_options(("--a=true", "--b=FALSE", "--c=12", "--d=x")) == dict(a=True, b=False, c=12, d="x")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in plan.recommended_xla_flags("gpu")
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_all_to_all=false --my_flag=1"}
    value = plan.apply_recommended_flags("tpu", environ=env)
    assert value.startswith("--xla_tpu_enable_async_all_to_all=false --my_flag=1 ")  # the user's choice wins
    assert value.count("xla_tpu_enable_async_all_to_all") == 1 and "--xla_enable_async_all_gather=true" in value
    with pytest.raises(ValueError, match="platform='cuda' must be one of"):
        plan.recommended_xla_flags("cuda")


def test_gpu_flags_are_known_to_xla():
    """XLA aborts on unknown XLA_FLAGS; the GPU flags parse in this jaxlib (the TPU ones in libtpu, below)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(plan.recommended_xla_flags("gpu")))
    out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_chips():
    assert plan.chip_for("v5e:4x4").bf16_flops == 197e12
    assert plan.chip_for("v5p:4x4x4").device_hbm_bytes == 95 * 2**30
    assert plan.chip_for("v4:2x2x1").device_flops == 275e12 / 2  # JAX shows the two v4 cores as devices
    ironwood = plan.chip_for("tpu7x:4x4x4")  # two TensorCores a chip, each a JAX device
    assert ironwood.device_kind == "TPU7x" and ironwood.device_hbm_bytes == 96 * 2**30
    assert ironwood.device_flops == 2307e12 / 2 and ironwood.device_ici_bandwidth == 600e9
    with pytest.raises(ValueError, match="unknown chip 'v9z'"):
        plan.chip_for("v9z:2x2")


# One report per strategy, shared by the tests below (each compiles the layer and the baseline once).
LAYOUTS = {"ulysses": (1, 4, 2), "all_gather": (4, 1, 2), "hybrid": (2, 2, 2)}
_REPORTS = {}


def report(name):
    if name not in _REPORTS:
        c, u, t = LAYOUTS[name]
        _REPORTS[name] = plan.analyze(cp_colossal=c, cp_ulysses=u, tp=t, **SMALL, **PLAIN)
    return _REPORTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_report_memory_collectives_overlap(name):
    r = report(name)
    assert r.mesh_shape == dict(zip(("dp", "cp_colossal", "cp_ulysses", "tp"), (1, *LAYOUTS[name])))
    for a in (r.analysis, r.baseline):
        m = a.memory
        assert min(m.arguments, m.outputs, m.total) > 0 and m.temporaries >= 0
        assert m.fits and m.budget == 16 * 2**30
        assert a.flops > 0 and a.estimate.step_s > 0
        cp = a.schedule.select()
        assert cp, "a CP layout must have CP collectives"
        kinds_axes = {(c.kind, c.axes) for c in cp}
        if name == "ulysses":  # no K/V exchange: nothing over cp_colossal
            assert all(c.axes == ("cp_ulysses",) for c in cp)
            assert ("all-to-all", ("cp_ulysses",)) in kinds_axes
        if name == "all_gather":  # forward: the gather only; backward: dK/dV blocks by all-to-all, no reduce-scatter
            assert not any(c.kind == "all-to-all" for c in a.schedule.select("fwd"))
            assert ("all-gather", ("cp_colossal",)) in kinds_axes
            assert {(c.kind, c.axes) for c in a.schedule.select("bwd")} == {("all-to-all", ("cp_colossal",))}
        assert not any(c.kind == "reduce-scatter" for c in cp)
        if name == "hybrid":
            assert {("all-to-all", ("cp_ulysses",)), ("all-gather", ("cp_colossal",))} <= kinds_axes
        assert {c.phase for c in cp} == {"fwd", "bwd"}
        for phase in ("fwd", "bwd"):
            sel = a.schedule.select(phase)
            expected = sum(c.bytes for c in sel if c.overlapped) / sum(c.bytes for c in sel)
            assert a.overlap(phase) == pytest.approx(expected)
            assert 0.0 <= a.overlap(phase) <= 1.0
    text = str(r)
    for needle in ("memory: total (peak)", "overlap fraction fwd", "overlap fraction bwd", "ESTIMATED step time",
                   "naive fused QKV", "cp_ulysses" if name != "all_gather" else "cp_colossal"):
        assert needle in text


def test_all_to_all_exchange_is_all_async_on_tpu():
    """kv_exchange='all_to_all' on a hybrid mesh: every CP collective of the layer, forward and
    backward, is an asynchronous all-to-all in the TPU schedule (no all-gather, no reduce-scatter);
    K/V cross both CP axes in one all-to-all, Q and the output over cp_ulysses."""
    r = plan.analyze(cp_colossal=2, cp_ulysses=2, tp=2, kv_exchange="all_to_all", baseline=False, **SMALL)
    cp = r.analysis.schedule.select()
    both = ("cp_colossal", "cp_ulysses")
    assert {(c.kind, c.axes) for c in cp} == {("all-to-all", both), ("all-to-all", ("cp_ulysses",))}
    assert all(c.is_async for c in cp)
    assert {c.phase for c in cp if c.axes == both} == {"fwd", "bwd"}


def test_linear_state_exchange_is_hidden_on_tpu():
    """A gated delta layer over cp_colossal = 8 (forward + backward, S = 8K): its one state exchange each
    way is an asynchronous all-to-all of ``c`` copies of each rank's slot (``Phi`` and ``S``, float32 per
    head), and the chunk work scheduled inside covers its whole transfer time at its roofline."""
    mesh = plan.topology_mesh(TOPO, cp_colossal=8)
    seq = NamedSharding(mesh, P("dp", ("cp_colossal", "cp_ulysses")))
    H, d = 2, 64
    layer = lambda *a: jax_cp.linear.gated_delta_rule(*a, mesh=mesh, chunk_size=64)  # noqa: E731
    step = jax.grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4))
    args = [jax.ShapeDtypeStruct((1, 8192, H, d), jnp.bfloat16, sharding=seq) for _ in range(3)]
    args += [jax.ShapeDtypeStruct((1, 8192, H), jnp.float32, sharding=seq)] * 2
    a = plan.analyze_program(step, args, topology=TOPO, mesh=mesh)
    cp = a.schedule.select()
    assert [(c.phase, c.kind, c.axes, c.bytes) for c in cp] == [
        (ph, "all-to-all", ("cp_colossal",), 8 * H * (d * d + d * d) * 4) for ph in ("fwd", "bwd")]
    assert all(c.is_async and c.overlapped for c in cp)
    assert a.covered("fwd") >= 0.9 and a.covered("bwd") >= 0.9, a.time_covered


def test_v5p_compiles_default_positions():
    """libtpu 0.0.52 aborts the whole process (a megacore check failure) compiling this v5p layer
    when the default ``arange`` positions are folded into the kernel's block bounds; the layer keeps
    its metadata behind an optimization barrier. In a subprocess, so a regression fails this test
    instead of killing the test run."""
    code = ("from jax_cp import plan; r = plan.analyze(topology='v5p:2x2x1', model='tiny', seq_len=8192, batch=4, "
            "cp_colossal=2, cp_ulysses=2, baseline=False, kernel='blockwise'); "
            "print('memory', r.analysis.memory.total)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Check failed" not in out.stderr, out.stderr[-3000:]
    assert int(out.stdout.split("memory")[1]) > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(topology="v9z:2x2"), "unknown chip 'v9z'"),
    (dict(topology="v5e:3x3"), "not a TPU topology libtpu knows"),
    (dict(model="gpt-17"), "model='gpt-17' is unknown"),
    (dict(cp_ulysses=3), r"cp_colossal\*cp_ulysses\*tp=1\*3\*1=3 does not divide the topology's 8 devices"),
    (dict(cp_ulysses=0), "cp_ulysses=0 must be a positive integer"),
    (dict(cp_ulysses=2, batch=3), "batch=3 is not divisible by dp=4"),
    (dict(cp_ulysses=1, tp=8, overlap_chunks=2), r"overlap_chunks=2 does not divide the 1 query heads per device \(num_heads=8, tp\*cp_ulysses=8\)"),
    (dict(strategy="greedy"), "strategy='greedy' must be one of"),
    (dict(cp_ulysses=1, cp_colossal=8, kv_exchange="carrier_pigeon"), "kv_exchange='carrier_pigeon' must be one of"),
])
def test_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan.analyze(**{**SMALL, "cp_ulysses": 8, **kwargs})


def test_analyze_program_finds_collectives_in_loop_bodies():
    """Any program: a ring-style permute inside a loop is found, marked in_loop, its bytes per iteration."""
    mesh = jax_cp.make_mesh(cp_colossal=8, devices=plan.get_topology(TOPO).devices)
    perm = [(j, (j + 1) % 8) for j in range(8)]

    def shard(x_SD):
        return lax.fori_loop(0, 5, lambda i, a: jnp.tanh(a @ a.T) @ a + lax.ppermute(a, "cp_colossal", perm), x_SD)

    f = jax.shard_map(shard, mesh=mesh, in_specs=P("cp_colossal"), out_specs=P("cp_colossal"), check_vma=False)
    x = jax.ShapeDtypeStruct((8 * 256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("cp_colossal")))
    a = plan.analyze_program(f, (x,), topology=TOPO, mesh=mesh, label="loop")
    (c,) = a.schedule.collectives
    assert (c.kind, c.axes, c.in_loop, c.is_async, c.bytes) == ("collective-permute", ("cp_colossal",), True, True,
                                                                256 * 256 * 2)
    assert a.memory.total > 0 and a.flops > 0
    # Carried into the next trip, where the matmul consumes it: a CP transfer, counted once per trip.
    assert c.iterations == 5 and a.schedule.is_cp(c)
    assert a.overlap("fwd") == (1.0 if c.overlapped else 0.0)


def test_auto_strategy_chooses_and_explains():
    r = plan.analyze(strategy="auto", candidates=1, **SMALL)
    m = r.mesh_shape
    assert m["dp"] * m["cp_colossal"] * m["cp_ulysses"] * m["tp"] == 8
    assert r.layer.kv_exchange in plan.kv_exchanges() and r.layer.overlap_chunks in (1, 2)
    assert any(x.startswith("chosen: ") for x in r.reasons) and any("compiled (" in x for x in r.reasons)
    assert r.analysis.memory.fits and r.baseline is not None
    assert "strategy=auto:" in str(r)
    with pytest.raises(ValueError, match="no compiled layout fits memory_budget=1024 bytes"):
        plan.analyze(strategy="auto", candidates=1, memory_budget=1024, baseline=False, kernel="blockwise", **SMALL)


def test_analyze_program_counts_a_layers_flops_from_its_shape():
    """``analyze_program(..., layer=shape)`` estimates a layer as ``analyze`` does (splash's FLOPs counted
    from the shapes); without ``layer`` the compiler's count gives the kernels none."""
    r = plan.analyze(**SMALL, cp_ulysses=4, tp=2, kernel="splash", baseline=False)
    mesh = plan.topology_mesh(TOPO, cp_ulysses=4, tp=2)
    fn, args = plan.cp_layer(r.layer, mesh)
    with_layer = plan.analyze_program(fn, args, topology=TOPO, mesh=mesh, layer=r.layer)
    bare = plan.analyze_program(fn, args, topology=TOPO, mesh=mesh)
    assert with_layer.executed_flops == r.analysis.executed_flops and with_layer.executed_flops > bare.flops
    assert with_layer.estimate.compute_s == pytest.approx(r.analysis.estimate.compute_s)
    assert bare.executed_flops is None and bare.estimate.compute_s < with_layer.estimate.compute_s


def test_layer_flops_count_the_mask_and_the_recompute():
    """Shape-counted FLOPs (the compiler counts loop bodies once and splash not at all)."""
    from jax_cp.plan._auto import layer_flops

    shape = plan.LayerShape(batch=2, seq_len=1024, d_model=256, num_heads=8, num_kv_heads=8, head_dim=32,
                            is_causal=False, overlap_chunks=1, fused_qkv_chunks=0, kv_exchange="ring")
    c, u, t, dp = 4, 2, 1, 1
    tokens = 2 * 1024 / (c * u)
    proj = 2 * tokens * 256 * (8 + 16) * 32 + 2 * tokens * 8 * 32 * 256
    per_pair = 4 * 2 * (8 / u) * 32
    T = 1024 / c
    model, executed = layer_flops(shape, c, u, t, dp, splash=True)
    assert model == pytest.approx(3 * (proj + per_pair * T * 1024))  # every pair of the chunk's queries
    assert executed == pytest.approx(3 * proj + per_pair * T * 1024 * 4.5)  # splash's backward: 7 matmuls / 2
    assert layer_flops(shape, c, u, t, dp, splash=False)[1] == pytest.approx(3 * proj + per_pair * T * 1024 * 3.5)
    causal = dataclasses.replace(shape, is_causal=True)
    mean = 1024 * 1025 / 2 / c
    busiest = T * (1024 - T) + T * (T + 1) / 2  # the last colossal chunk, natural order
    model, executed = layer_flops(causal, c, u, t, dp, splash=True)
    assert model == pytest.approx(3 * (proj + per_pair * mean))  # useful work, spread evenly: MFU's numerator
    assert executed == pytest.approx(3 * proj + per_pair * busiest * 4.5)
    assert layer_flops(causal, c, u, t, dp, splash=True, balanced=True)[1] == pytest.approx(
        3 * proj + per_pair * mean * 4.5)


def test_cli_prints_the_report():
    cmd = [sys.executable, "-m", "jax_cp.plan", "--topology", TOPO, "--model", "tiny", "--seq-len", "512",
           "--cp-ulysses", "4", "--tp", "2", "--fused-qkv-chunks", "1"]
    out = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in ("jax_cp plan: v5e:2x4", "overlap fraction fwd", "ESTIMATED step time", "all-to-all",
                   "fused_qkv_chunks=1", "kernel (kernel=auto): splash (splash_mqa_dkv x", "kernel that ran",
                   "FLOPs per device (shapes, model)", "est. MFU (model FLOPs / step)"):
        assert needle in out.stdout
    bad = subprocess.run([*cmd[:7], "--seq-len", "512", "--cp-ulysses", "3"],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not divide the topology's 8 devices" in bad.stderr


def test_fused_qkv_exchange_sends_one_all_to_all_per_chunk():
    """fused_qkv_chunks=1 on pure Ulysses: Q, K and V cross cp_ulysses in one all-to-all
    (forward: that one and the output's), the same bytes as the two of the default (Q; K and V)."""
    c, u, t = LAYOUTS["ulysses"]
    fused = plan.analyze(cp_colossal=c, cp_ulysses=u, tp=t, fused_qkv_chunks=1, overlap_chunks=1,
                         kv_exchange="all_gather", baseline=False, **SMALL)
    assert "fused_qkv_chunks=1" in str(fused)
    fwd = {name: a.schedule.select("fwd") for name, a in (("split", report("ulysses").analysis),
                                                          ("fused", fused.analysis))}
    for cs in fwd.values():
        assert {(x.kind, x.axes) for x in cs} == {("all-to-all", ("cp_ulysses",))}
    assert len(fwd["split"]) == 3 and len(fwd["fused"]) == 2
    assert sum(x.bytes for x in fwd["split"]) == sum(x.bytes for x in fwd["fused"])


def test_out_of_hbm_is_a_clear_error():
    """A program the TPU compiler cannot fit (36 GiB of temporaries on a 16 GiB v5e) is a ValueError
    that quotes the compiler and says what to change, not a compiler traceback."""
    mesh = plan.topology_mesh(TOPO)
    x = jax.ShapeDtypeStruct((3 * 2**30,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"too big does not fit one TPU v5 lite device \(16 GiB HBM\); the TPU "
                                         r"compiler says: .*Ran out of memory on HBM.* Spread it further"):
        plan.analyze_program(lambda x: jnp.cumsum(x) + x[::-1], (x,), topology=TOPO, mesh=mesh, label="too big")


def test_auto_says_why_when_the_naive_baseline_estimates_faster():
    from types import SimpleNamespace

    from jax_cp.plan._analyze import _baseline_wins
    from jax_cp.plan._report import Estimate

    chosen = SimpleNamespace(estimate=Estimate(compute_s=1e-3, memory_s=3e-3, comm_s=1e-3, exposed_comm_s=0.0))
    naive = SimpleNamespace(estimate=Estimate(compute_s=1e-3, memory_s=2e-3, comm_s=1e-3, exposed_comm_s=0.5e-3))
    why = _baseline_wins(chosen, naive)
    assert why.startswith("note: the naive baseline's estimate (2.500 ms) beats the chosen layout's (3.000 ms); "
                          "the largest difference is HBM traffic (+1.000 ms")
    assert "exposed communication -0.500 ms" in why
