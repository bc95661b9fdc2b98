"""pretrain.collectives reads the bytes each device sends from a compiled program's HLO text: loop bodies
count as often as they run, an unreadable loop is counted once and said so, one device sends nothing."""
import pytest

from pretrain import collectives


# HLO as libtpu prints it, cut down: a jax scan of 3 steps around an all-reduce, and outside it an async
# all-gather, an async reduce-scatter wrapped in its own computation, a collective-permute, an all-reduce
# over all devices, a conditional whose costlier branch holds an all-to-all, and a reduce-scatter the way
# libtpu fuses one: an all-reduce each device slices its part from.
TPU_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[256]{0})->f32[256]{0}}

%add.1 (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%x.1, %y.1)
}

%wide.region_1.sunk (wide.param.2: (s32[], f32[256])) -> (s32[], f32[256]) {
  %wide.param.2 = (s32[]{:T(256)}, f32[256]{0:T(256)}) parameter(0)
  %get-tuple-element.7 = s32[]{:T(256)} get-tuple-element(%wide.param.2), index=0
  %copy.5 = s32[]{:T(256)} copy(%get-tuple-element.7)
  %constant.17..sunk = s32[]{:T(256)} constant(1)
  %add.12 = s32[]{:T(256)} add(%copy.5, %constant.17..sunk), metadata={op_name="jit(step)/while/body/add"}
  %get-tuple-element.8 = f32[256]{0:T(256)} get-tuple-element(%wide.param.2), index=1
  %all-reduce.267 = f32[256]{0:T(256)} all-reduce(%get-tuple-element.8), channel_id=5, replica_groups=[2,4]<=[8], \
use_global_device_ids=true, to_apply=%add.1, backend_config={"flag_configs":[],"barrier_config":{"id":"0"}}
  ROOT %tuple.9 = (s32[]{:T(256)}, f32[256]{0:T(256)}) tuple(%add.12, %all-reduce.267)
}

%wide.region_73 (wide.param.0: (s32[], f32[256])) -> pred[] {
  %constant.10 = s32[]{:T(256)} constant(3)
  %wide.param.0 = (s32[]{:T(256)}, f32[256]{0:T(256)}) parameter(0)
  %get-tuple-element.6 = s32[]{:T(256)} get-tuple-element(%wide.param.0), index=0
  ROOT %lt.4 = pred[]{:T(1024)} compare(%get-tuple-element.6, %constant.10), direction=LT
}

%wrapped_reduce-scatter (p.0: bf16[32]) -> bf16[8] {
  %p.0 = bf16[32]{0} parameter(0)
  ROOT %reduce-scatter.1 = bf16[8]{0} reduce-scatter(%p.0), channel_id=3, \
replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, dimensions={0}, to_apply=%add.1
}

%all-reduce-scatter.1 (input.1: f32[64]) -> f32[8] {
  %input.1 = f32[64]{0} parameter(0)
  %all-reduce.4 = f32[64]{0} all-reduce(%input.1), channel_id=8, replica_groups=[1,8]<=[8], to_apply=%add.1
  %partition-id.1 = u32[] partition-id()
  %constant.20 = u32[] constant(8)
  %multiply.1 = u32[] multiply(%partition-id.1, %constant.20)
  ROOT %dynamic-slice.1 = f32[8]{0} dynamic-slice(%all-reduce.4, %multiply.1), dynamic_slice_sizes={8}
}

%branch_0 (b.0: f32[16]) -> f32[16] {
  ROOT %b.0 = f32[16]{0} parameter(0)
}

%branch_1 (b.1: f32[16]) -> f32[16] {
  %b.1 = f32[16]{0} parameter(0)
  ROOT %all-to-all.1 = f32[16]{0} all-to-all(%b.1), channel_id=6, replica_groups={{0,1},{2,3},{4,5},{6,7}}, \\
dimensions={0}
}

ENTRY %main.1 (Arg_0.1: f32[256], Arg_1.1: f32[16], Arg_2.1: bf16[32], Arg_3.1: s32[]) -> f32[256] {
  %Arg_0.1 = f32[256]{0} parameter(0)
  %Arg_1.1 = f32[16]{0} parameter(1)
  %Arg_2.1 = bf16[32]{0} parameter(2)
  %Arg_3.1 = s32[] parameter(3)
  %constant.18 = s32[]{:T(256)} constant(0)
  %copy.53 = s32[]{:T(256)} copy(%constant.18)
  %tuple.5 = (s32[]{:T(256)}, f32[256]{0:T(256)}) tuple(%copy.53, %Arg_0.1)
  %while.1 = (s32[]{:T(256)}, /*index=1*/f32[256]{0:T(256)}) while(%tuple.5), condition=%wide.region_73, \
body=%wide.region_1.sunk, metadata={op_name="jit(step)/while"}
  %all-gather-start.1 = (f32[16]{0}, f32[64]{0}) all-gather-start(%Arg_1.1), channel_id=2, \
replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done.1 = f32[64]{0} all-gather-done(%all-gather-start.1)
  %reduce-scatter-start = ((bf16[32]{0}), bf16[8]{0}) async-start(%Arg_2.1), calls=%wrapped_reduce-scatter
  %reduce-scatter-done = bf16[8]{0} async-done(%reduce-scatter-start), calls=%wrapped_reduce-scatter
  %collective-permute.1 = f32[16]{0} collective-permute(%Arg_1.1), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %all-reduce.89 = f32[]{:T(256)} all-reduce(%Arg_3.1), channel_id=7, replica_groups={}, to_apply=%add.1
  %conditional.1 = f32[16]{0} conditional(%Arg_3.1, %Arg_1.1, %Arg_1.1), branch_computations={%branch_0, %branch_1}
  %fusion.1 = f32[8]{0} fusion(%Arg_0.1), kind=kCustom, calls=%all-reduce-scatter.1, \\
backend_config={"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion"}}
  ROOT %get-tuple-element.9 = f32[256]{0:T(256)} get-tuple-element(%while.1), index=1
}
"""


def test_collectives_are_read_from_hlo_with_loop_bodies_counted_as_often_as_they_run():
  traffic = collectives.collective_traffic(TPU_HLO, devices=8)
  assert traffic.loops_of_unknown_length == 0
  assert traffic.bytes_by_kind == pytest.approx({
      "all-reduce": 3 * 2 * 3 / 4 * 256 * 4  # in the loop, 3 times: ring over groups of 4 of f32[256]
                    + 2 * 7 / 8 * 4,  # f32[] over all 8 devices
      "reduce-scatter": 3 * 8 * 2  # the 4 devices of 'axis_1' each keep bf16[8], send 3 such parts
                        + 7 / 8 * 64 * 4,  # the fused one: 7/8 of the f32[64] all-reduced, not twice that
      "all-gather": 3 / 4 * 64 * 4,  # the gathered f32[64], counted at its -start and not again at -done
      "all-to-all": 1 / 2 * 16 * 4,  # the costlier branch
      "collective-permute": 16 * 4,
  })


def test_a_loop_of_unrecognised_length_is_counted_once_and_said_so():
  hlo = TPU_HLO.replace("direction=LT", "direction=NE")
  traffic = collectives.collective_traffic(hlo, devices=8)
  assert traffic.loops_of_unknown_length == 1
  assert traffic.bytes_by_kind["all-reduce"] == pytest.approx(2 * 3 / 4 * 256 * 4 + 2 * 7 / 8 * 4)


def test_a_program_on_one_device_has_no_collectives():
  # libtpu describes no one-chip topology without chips_per_host_bounds, which pretrain.plan does not
  # set: a scan compiled for this process's one CPU device stands in for a one-device step.
  import jax
  import jax.numpy as jnp
  step = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 2 + c.sum(), None), x, None, length=4)[0])
  traffic = collectives.collective_traffic(step.lower(jnp.ones(8)).compile().as_text(), devices=1)
  assert traffic.bytes_by_kind == {} and traffic.total == 0 and traffic.loops_of_unknown_length == 0


def test_collectives_whose_groups_span_islands_are_counted_apart():
  """Devices 0-3 on one machine (or slice) and 4-7 on another, then the two interleaved. Each group form is read
  whole: the iota groups [2,4]<=[8] are {0..3} and {4..7}; the mesh groups over 'axis_1' of ids [4,2]T(1,0) are
  {0,2,4,6} and {1,3,5,7}."""
  halves = collectives.collective_traffic(TPU_HLO, devices=8, islands=[0, 0, 0, 0, 1, 1, 1, 1])
  assert halves.between_islands == pytest.approx(3 * 8 * 2  # the reduce-scatter over {0,2,4,6} and {1,3,5,7}
                                                 + 7 / 8 * 64 * 4  # the fused reduce-scatter over all 8
                                                 + 2 * 7 / 8 * 4)  # the all-reduce over all 8
  interleaved = collectives.collective_traffic(TPU_HLO, devices=8, islands=[0, 1] * 4)
  assert interleaved.between_islands == pytest.approx(interleaved.total - 3 * 8 * 2)  # all but the reduce-scatter
  assert halves.bytes_by_kind == interleaved.bytes_by_kind
  assert collectives.collective_traffic(TPU_HLO, devices=8, islands=[0] * 8).between_islands == 0
