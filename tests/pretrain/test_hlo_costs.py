"""pretrain.hlo_costs counts a compiled program's kernels: products' FLOPs, loop bodies as often as they run, the
bytes a fusion slices out of an operand rather than the operand, an in-place update rather than its buffer, and
cuDNN's flash attention from its shapes (compiled for a described H100, no GPU needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain import gpu_topology, hlo_costs

F32 = 4


def costs_of(function, *args, donate=(), device=None):
  if device is not None:
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  return hlo_costs.program_costs(jax.jit(function, donate_argnums=donate).lower(*args).compile().as_text())


def test_a_product_costs_two_flops_per_multiply_add_and_reads_its_operands_once():
  x, w = jnp.ones((64, 128)), jnp.ones((128, 256))
  costs = costs_of(lambda x, w: x @ w, x, w)
  assert costs.flops == 2 * 64 * 128 * 256
  assert costs.bytes_accessed == pytest.approx((64 * 128 + 128 * 256 + 64 * 256) * F32, rel=0.01)


def test_a_loop_body_counts_as_often_as_the_loop_runs():
  x, w = jnp.ones((64, 128)), jnp.ones((128, 128))

  def scanned(x, w, steps):
    return jax.lax.scan(lambda carry, _: (jnp.tanh(carry @ w), None), x, None, length=steps)[0]

  once, five = (costs_of(lambda x, w: scanned(x, w, steps), x, w) for steps in (1, 5))
  assert five.flops == 5 * 2 * 64 * 128 * 128
  assert five.loops_of_unknown_length == 0
  assert five.bytes_accessed > 4 * once.bytes_accessed


def test_a_fusion_that_slices_an_operand_reads_the_slice_not_the_operand():
  big = jnp.ones((1024, 1024))
  costs = costs_of(lambda x: x[:, :8] * 2, big)
  assert costs.bytes_accessed == pytest.approx(2 * 1024 * 8 * F32, rel=0.01)  # the slice read, the result written


@pytest.mark.parametrize("made", [lambda u: u, lambda u: u * 2], ids=["unfused", "fused with its update's maker"])
def test_an_update_in_place_reads_the_update_and_writes_its_region_not_the_buffer(made):
  buffer, update = jnp.ones((1024, 1024)), jnp.ones((8, 1024))
  costs = costs_of(lambda b, u: jax.lax.dynamic_update_slice(b, made(u), (0, 0)), buffer, update, donate=(0,))
  assert 2 * update.size * F32 <= costs.bytes_accessed < 2.1 * update.size * F32


def test_cudnn_flash_attention_counts_its_products_and_the_scores_recomputed_in_its_backward_pass():
  device = gpu_topology.devices("h100:1")[0]
  rng = np.random.default_rng(0)
  q, k, v, weights = (jnp.asarray(rng.normal(size=(4, 256, 8, 64)), jnp.bfloat16) for _ in range(4))

  def loss_and_gradients(implementation):
    def loss(q, k, v, weights):
      attended = jax.nn.dot_product_attention(q, k, v, implementation=implementation)
      return (attended * weights).astype(jnp.float32).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))

  fused = costs_of(loss_and_gradients("cudnn"), q, k, v, weights, device=device)
  plain = costs_of(loss_and_gradients("xla"), q, k, v, weights, device=device)
  # XLA's attention: 2 products forward (scores, weighted values), 4 backward (dv, dp, dq, dk). cuDNN's flash
  # attention keeps no scores for the backward pass and computes them again there: 7 products.
  assert plain.flops == pytest.approx(6 * 2 * 4 * 8 * 256 * 256 * 64, rel=0.01)
  assert fused.flops == pytest.approx(plain.flops * 7 / 6, rel=0.01)
  # Its whole point: no [batch, heads, 256, 256] scores written to memory and read back.
  assert fused.bytes_accessed < plain.bytes_accessed / 2


def test_point_to_point_transfers_are_communication_not_kernels():
  program = """\
HloModule transfers, entry_computation_layout={(f32[256]{0})->f32[256]{0}}

ENTRY %main (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  %token = token[] after-all()
  %send = (f32[256]{0}, u32[], token[]) send(%p, %token), channel_id=1
  %send-done = token[] send-done(%send), channel_id=1
  %recv = (f32[256]{0}, u32[], token[]) recv(%token), channel_id=2
  %recv-done = (f32[256]{0}, token[]) recv-done(%recv), channel_id=2
  %received = f32[256]{0} get-tuple-element(%recv-done), index=0
  ROOT %sum = f32[256]{0} add(%p, %received)
}
"""
  costs = hlo_costs.program_costs(program)
  assert [k.name for k in costs.kernels] == ["sum"]
  assert costs.bytes_accessed == 3 * 256 * F32
