"""Pallas kernels are costed from flash and splash attention's algorithms and blocks, not from their own estimates.

Expected figures are worked out here from the kernels' design (jax.experimental.pallas.ops.tpu.flash_attention):
the forward keeps a query block while it walks the key blocks, so keys and values are read once per query
block; the dk/dv kernel keeps a key block while it walks the query blocks; an unchanged block is not moved
again. The end-to-end check (a compiled v4 step) is in test_plan."""
import pytest

from pretrain import kernel_costs
from pretrain.collectives import HloInstruction

BATCH, HEADS, DIM = 2, 3, 64


def array(length, last=DIM, dtype="bf16", heads=HEADS):
  return f"{dtype}[{BATCH},{heads},{length},{last}]" if heads else f"{dtype}[{BATCH},{length},{last}]"


def nbytes(hlo_type):
  from pretrain.collectives import type_bytes
  return type_bytes(hlo_type)


def kernel(name, scope, outputs, cost=""):
  attributes = f', custom_call_target="tpu_custom_call", metadata={{op_name="jit(step)/{scope}/pallas_call"}}'
  if cost:
    attributes += f', backend_config={{"custom_call_config":{{"cost_estimate":{cost}}}}}'
  return HloInstruction(name, outputs, "custom-call", "", attributes)


def test_the_forward_reads_keys_and_values_once_per_query_block():
  q, k = array(512), array(512)
  residual = array(512, last=128, dtype="f32")  # l and m, on 128 lanes
  outputs = f"({q}, {residual}, {residual})"
  flops, moved = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", outputs),
                                         [q, k, k])
  assert flops == 4 * BATCH * HEADS * 512 * 512 * DIM  # QKᵀ and PV
  query_blocks = 512 // 128
  assert moved == nbytes(q) + query_blocks * 2 * nbytes(k) + nbytes(q) + 2 * nbytes(residual)


def test_one_block_per_row_moves_everything_once_and_segment_ids_once_per_row_not_per_head():
  q = array(128)
  q_segments, kv_segments = array(128, last=128, dtype="s32", heads=0), f"s32[{BATCH},8,128]"
  flops, moved = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", q),
                                         [q, q, q, q_segments, kv_segments])
  assert flops == 4 * BATCH * HEADS * 128 * 128 * DIM
  assert moved == 4 * nbytes(q) + nbytes(q_segments) + nbytes(kv_segments)


def test_segment_ids_move_with_every_head_once_a_row_has_several_blocks():
  q = array(256)
  q_segments, kv_segments = array(256, last=128, dtype="s32", heads=0), f"s32[{BATCH},8,256]"
  _, with_ids = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", q),
                                        [q, q, q, q_segments, kv_segments])
  _, without = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", q), [q, q, q])
  # Query ids: once per (head, query block); key ids: once per (head, query block, key block).
  assert with_ids - without == HEADS * nbytes(q_segments) + HEADS * 2 * nbytes(kv_segments)


def test_the_backward_kernels_walk_their_own_axes_with_the_blocks_their_names_give():
  q, k = array(512), array(1024)
  residual, output = array(512, last=128, dtype="f32"), f"({k}, {k})"
  operands = [q, k, k, residual, residual, q, residual]  # q, k, v, l, m, dO, di
  dkv = kernel("flash_mha_bwd_dkv_block_q_major_128_block_q_128_block_k_major_256_block_k_128.3",
               "flash_mha_bwd_dkv_block_q_major=128", output)
  flops, moved = kernel_costs.flash_cost("dkv", dkv, operands)
  assert flops == 8 * BATCH * HEADS * 512 * 1024 * DIM
  key_blocks = 1024 // 256
  assert moved == 2 * nbytes(k) + key_blocks * (2 * nbytes(q) + 3 * nbytes(residual)) + 2 * nbytes(k)

  dq = kernel("flash_mha_bwd_dq_block_q_major_256_block_k_major_512_block_k_128.3",
              "flash_mha_bwd_dq_block_q_major=256", q)
  flops, moved = kernel_costs.flash_cost("dq", dq, operands)
  assert flops == 6 * BATCH * HEADS * 512 * 1024 * DIM
  query_blocks = 512 // 256
  assert moved == 2 * nbytes(q) + 3 * nbytes(residual) + query_blocks * 2 * nbytes(k) + nbytes(q)


def test_blocks_move_at_their_size_in_the_tiled_layout():
  """A head_dim of 64 in (8, 128) tiles occupies 128 lanes: q, k, v and the output move twice their bytes."""
  plain = array(128)
  tiled = plain + "{3,2,1,0:T(8,128)(2,1)}"
  _, plain_bytes = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", plain),
                                           [plain] * 3)
  _, tiled_bytes = kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", tiled),
                                           [tiled] * 3)
  assert plain_bytes == 4 * nbytes(plain)
  assert tiled_bytes == 2 * plain_bytes


def test_a_kernel_with_an_unexpected_operand_count_is_an_error():
  q = array(128)
  with pytest.raises(ValueError, match="4 operands"):
    kernel_costs.flash_cost("forward", kernel("flash_attention.1", "flash_attention", q), [q, q, q, q])


def test_a_program_s_kernels_are_counted_and_an_unknown_kernel_keeps_its_own_estimate():
  q = array(256)
  program = f"""HloModule step

ENTRY %main (p0: {q}) -> {q} {{
  %p0 = {q} parameter(0)
  %flash_attention.1 = {q} custom-call(%p0, %p0, %p0), custom_call_target="tpu_custom_call", \
metadata={{op_name="jit(step)/jit(flash_attention)/pallas_call"}}, \
backend_config={{"custom_call_config":{{"cost_estimate":{{"flops":"1000","bytes_accessed":"300"}}}}}}
  ROOT %other.2 = {q} custom-call(%flash_attention.1), custom_call_target="tpu_custom_call", \
metadata={{op_name="jit(step)/my_kernel/pallas_call"}}, \
backend_config={{"custom_call_config":{{"cost_estimate":{{"flops":"50","bytes_accessed":"7"}}}}}}
}}
"""
  costs = kernel_costs.kernel_costs(program)
  flash_flops, flash_bytes = kernel_costs.flash_cost(
      "forward", kernel("flash_attention.1", "flash_attention", q), [q, q, q])
  assert (costs.counted, costs.self_reported) == (1, 1)
  assert (costs.declared_flops, costs.declared_bytes) == (1050, 307)
  assert (costs.flops, costs.bytes_accessed) == (flash_flops + 50, flash_bytes + 7)


def splash_program(block: int, length: int = 512, rows: int = BATCH) -> str:
  """A step's splash attention kernels as XLA prints them: vmapped over the rows (an axis XLA drops where a
  device has one row), queries, keys and values laid out sequence-minor, the block sizes in metadata that
  spans lines, no cost estimate."""
  def tiled(*dims):  # bf16 in (8, 128) tiles
    dims = ((rows,) if rows > 1 else ()) + dims
    return f"bf16[{','.join(map(str, dims))}]{{{','.join(map(str, reversed(range(len(dims)))))}:T(8,128)(2,1)}}"

  seq_minor, head_minor = tiled(HEADS, DIM, length), tiled(HEADS, length, DIM)  # head-minor: 64 lanes of 128
  logsumexp, prefetch = f"f32[{f'{rows},' if rows > 1 else ''}{HEADS},{length},128]", "s8[1,1,1]"
  dq = tiled(length // block, HEADS, length, DIM)

  def splash(name, result, operands, blocks):
    metadata = ", ".join(f'\\"{key}\\": {value}' for key, value in blocks.items())
    return (f"  %{name} = {result} custom-call({operands}), custom_call_target=\"tpu_custom_call\", "
            f"frontend_attributes={{kernel_metadata={{\n\"xprof_metadata\":\"{{{metadata}, \\\"q_layout\\\": 2}}\"\n"
            f"}}}}, metadata={{op_name=\"jit(step)/vmap(static_sparsity_splash)/{name.split('.')[0]}/pallas_call\"}}")

  return "\n".join([
      "HloModule step", "",
      f"ENTRY %main (q: {seq_minor}, t: {prefetch}, o: {head_minor}) -> ({dq}, {head_minor}, {head_minor}) {{",
      f"  %q = {seq_minor} parameter(0)", f"  %t = {prefetch} parameter(1)", f"  %o = {head_minor} parameter(2)",
      splash("splash_mha_fwd_residuals.1", f"({head_minor}, {logsumexp})", "%t, %t, %q, %q, %q",
             {"block_q": block, "block_kv": block}),
      f"  %lse = {logsumexp} get-tuple-element(%splash_mha_fwd_residuals.1), index=1",
      splash("splash_mha_dkv_no_residuals.2", f"({dq}, {head_minor}, {head_minor})", "%t, %t, %q, %q, %q, %o, %lse",
             {"block_q_dkv": block, "block_kv_dkv": block}).replace("%splash_mha_dkv", "ROOT %splash_mha_dkv"),
      "}", ""])


@pytest.mark.parametrize("rows", [BATCH, 1])
def test_splash_kernels_with_one_block_per_sequence_move_every_operand_once(rows):
  """Splash's forward (QKᵀ, PV) and fused backward (QKᵀ again, dO Vᵀ, PᵀdO, dSᵀQ, dS K): 4 + 10 products of
  q·k·d per head. With a block the length of the sequence, the grid visits each row's heads once."""
  costs = kernel_costs.kernel_costs(splash_program(block=512, rows=rows))
  assert (costs.counted, costs.self_reported) == (2, 0)
  assert costs.flops == 14 * rows * HEADS * 512 * 512 * DIM
  per_row = rows / BATCH
  seq_minor, head_minor = per_row * nbytes(array(512)), 2 * per_row * nbytes(array(512))  # 64 in 128 lanes
  logsumexp, prefetch = per_row * nbytes(array(512, last=128, dtype="f32")), 1
  forward = 2 * prefetch + 3 * seq_minor + head_minor + logsumexp
  backward = 2 * prefetch + 3 * seq_minor + head_minor + logsumexp + 3 * head_minor  # ..., dq, dk, dv
  assert costs.bytes_accessed == forward + backward


def test_splash_kernels_with_several_blocks_per_sequence_keep_their_own_estimate():
  costs = kernel_costs.kernel_costs(splash_program(block=128))
  assert (costs.counted, costs.self_reported) == (0, 2)
