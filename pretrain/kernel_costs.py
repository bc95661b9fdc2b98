"""The cost of the Pallas kernels in a compiled TPU step, counted from their algorithm, not their own word.

XLA's cost analysis counts a Pallas kernel (a `tpu_custom_call`) at exactly the cost_estimate the kernel
declares about itself, or at nothing where it declares none: jax's flash attention declares its forward's
as the unfused computation's and its backward kernels' not at all. A plan that compared fused and XLA
attention on those figures would compare a guess. So `pretrain.plan` replaces them: flash attention's
matmul FLOPs, and the HBM bytes its blocks move, counted by walking each kernel's grid the way Pallas
pipelines it (a block is fetched when its index differs from the previous grid step's, and an output
block written back likewise), each block at its size in the operand's tiled layout (a head_dim of 64
fills the 128 lanes of its tiles). The block sizes are in the backward kernels' names; the forward's are
jax's defaults, which models.layers leaves in place. Splash attention's forward and fused backward kernels
(vmapped over the batch rows) are counted where each sequence is one block, as models.layers blocks lengths
up to 512: every operand and output then moves once. A causal kernel is counted as a full one (its skipped
blocks are not credited), so the fused path's figures are if anything high. Any other kernel keeps its
declared cost, and the plan says how many did.
"""
import dataclasses
import itertools
import json
import math
import re
from typing import List

from pretrain.collectives import HloInstruction, parse_hlo, tuple_elements, type_bytes

_ARRAY = re.compile(r"[a-z]\w*\[([\d,]*)\]")
_BLOCK = re.compile(r"block_(q_major|k_major)_(\d+)")
_TILED_LAYOUT = re.compile(r"\{([\d,]+):T\((\d+),(\d+)\)")  # {3,2,1,0:T(8,128)...}: minor-to-major, tile


@dataclasses.dataclass(frozen=True)
class _Operand:
  """How a flash attention operand is blocked: along the query or the key axis, for each head or shared
  by a row's heads (segment ids)."""
  axis: str  # 'q' or 'k'
  per_head: bool = True


_Q, _K, _Q_ROW, _K_ROW = _Operand("q"), _Operand("k"), _Operand("q", per_head=False), _Operand("k", per_head=False)


@dataclasses.dataclass(frozen=True)
class _FlashKernel:
  """One of flash attention's three kernels: its grid's two sequence axes (outer, inner), its matmul
  FLOPs per query × key × head_dim, and its operands and outputs in jax's order (segment ids optional)."""
  outer: str
  matmul_flops_per_qkd: int
  inputs: tuple
  inputs_with_segments: tuple
  outputs: tuple


# Forward: S = QKᵀ, O = PV. dk/dv kernel: S again, dV = PᵀdO, dP = dO Vᵀ, dK = dSᵀQ. dq kernel: S, dP,
# dQ = dS K. Each product is 2·q·k·d FLOPs per head, so the kernels do 4, 8 and 6 q·k·d.
_FLASH_KERNELS = {
    "forward": _FlashKernel("q", 4, (_Q, _K, _K), (_Q, _K, _K, _Q_ROW, _K_ROW), (_Q, _Q, _Q)),
    "dkv": _FlashKernel("k", 8, (_Q, _K, _K, _Q, _Q, _Q, _Q), (_Q, _K, _K, _Q_ROW, _K_ROW, _Q, _Q, _Q, _Q),
                        (_K, _K)),
    "dq": _FlashKernel("q", 6, (_Q, _K, _K, _Q, _Q, _Q, _Q), (_Q, _K, _K, _Q_ROW, _K_ROW, _Q, _Q, _Q, _Q), (_Q,)),
}


@dataclasses.dataclass(frozen=True)
class KernelCosts:
  """Per device per step (loop bodies once, as XLA counts): what the kernels declared and what they cost."""
  declared_flops: float = 0.0
  declared_bytes: float = 0.0
  flops: float = 0.0
  bytes_accessed: float = 0.0
  counted: int = 0  # kernels costed here
  self_reported: int = 0  # kernels of unknown algorithm, left at their declared cost

  def plus(self, other: "KernelCosts", times: float) -> "KernelCosts":
    """self + times × other, field by field (as StepFigures combines steps of different depths)."""
    return KernelCosts(*(a + times * b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def _tiled_bytes(hlo_type: str) -> float:
  """Bytes of an HLO array in its memory layout: the dims its tile T(rows,lanes) covers rounded up, so a
  head_dim of 64 takes the 128 lanes it occupies on a TPU."""
  layout = _TILED_LAYOUT.search(hlo_type)
  if not layout:
    return type_bytes(hlo_type)
  dims = list(_dims(hlo_type)[0])
  minor_to_major = [int(d) for d in layout.group(1).split(",")]
  for dim, tile in zip(minor_to_major, (int(layout.group(3)), int(layout.group(2)))):
    dims[dim] = -(-dims[dim] // tile) * tile
  return type_bytes(f"{hlo_type.split('[', 1)[0]}[{','.join(map(str, dims))}]")


def _dims(hlo_type: str) -> List[tuple]:
  return [tuple(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(hlo_type)]


def _kind(instruction: HloInstruction):
  """Flash attention's 'forward', 'dkv' or 'dq', splash attention's 'splash_forward' or 'splash_backward' (its
  fused backward kernel), or None for another kernel."""
  op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
  scope = op_name.group(1) if op_name else ""
  if "splash_mha_fwd" in scope:
    return "splash_forward"
  if "splash_mha_dkv" in scope:
    ranks = [len(dims) for dims in _dims(instruction.type)]
    # Fused, it writes dq besides dk and dv (last), one partial per key block: an axis more.
    return "splash_backward" if max(ranks) > ranks[-1] else None
  if "flash_mha_bwd_dkv" in scope:
    return "dkv"
  if "flash_mha_bwd_dq" in scope:
    return "dq"
  return "forward" if "flash_attention" in scope else None


def _declared(instruction: HloInstruction) -> tuple:
  match = re.search(r'"cost_estimate":(\{[^}]*\})', instruction.attributes)
  if not match:
    return 0.0, 0.0
  estimate = json.loads(match.group(1))
  return float(estimate.get("flops", 0)), float(estimate.get("bytes_accessed", 0))


def _forward_blocks(q_length: int, k_length: int) -> tuple:
  from jax.experimental.pallas.ops.tpu import flash_attention as flash
  default = flash.BlockSizes.get_default(None, None, q_length, k_length, None)
  return min(default.block_q, q_length), min(default.block_k_major, k_length)


def _fetches(operand: _Operand, kernel: _FlashKernel, heads: int, q_blocks: int, k_blocks: int) -> int:
  """How often one batch row's blocks of `operand` move between HBM and the kernel: once per change of the
  block index over the grid (heads, outer axis, inner axis), as Pallas's pipeline skips a repeated block."""
  blocks = {"q": q_blocks, "k": k_blocks}
  outer, inner = kernel.outer, "k" if kernel.outer == "q" else "q"
  previous, moves = None, 0
  for head, i, j in itertools.product(range(heads), range(blocks[outer]), range(blocks[inner])):
    index = (head if operand.per_head else 0, i if operand.axis == outer else j)
    moves += index != previous
    previous = index
  return moves


def flash_cost(kind: str, instruction: HloInstruction, operand_types: List[str]) -> tuple:
  """(FLOPs, HBM bytes) of one flash attention kernel from its operands' shapes and its blocks."""
  kernel = _FLASH_KERNELS[kind]
  (batch, heads, q_length, head_dim), (_, _, k_length, _) = _dims(operand_types[0])[0], _dims(operand_types[1])[0]
  if kind == "forward":
    q_block, k_block = _forward_blocks(q_length, k_length)
  else:
    blocks = dict(_BLOCK.findall(instruction.name))
    q_block, k_block = int(blocks.get("q_major", q_length)), int(blocks.get("k_major", k_length))
  q_blocks, k_blocks = -(-q_length // q_block), -(-k_length // k_block)
  roles = {len(kernel.inputs): kernel.inputs, len(kernel.inputs_with_segments): kernel.inputs_with_segments}
  if len(operand_types) not in roles:
    raise ValueError(f"flash attention kernel {instruction.name} has {len(operand_types)} operands; expected "
                     f"{' or '.join(str(n) for n in roles)}")
  outputs = _output_types(instruction.type)[:len(kernel.outputs)]
  moved = 0.0
  for role, hlo_type in list(zip(roles[len(operand_types)], operand_types)) + list(zip(kernel.outputs, outputs)):
    distinct_blocks = (heads if role.per_head else 1) * (q_blocks if role.axis == "q" else k_blocks)
    moved += _tiled_bytes(hlo_type) / distinct_blocks * _fetches(role, kernel, heads, q_blocks, k_blocks)
  return float(kernel.matmul_flops_per_qkd * batch * heads * q_length * k_length * head_dim), moved


# Splash forward: S = QKᵀ, O = PV. Its fused backward: S again, dP = dO Vᵀ, dV = PᵀdO, dK = dSᵀQ, dQ = dS K.
_SPLASH_MATMUL_FLOPS_PER_QKD = {"splash_forward": 4, "splash_backward": 10}
_SPLASH_BLOCKS = {"splash_forward": ("block_q", "block_kv"), "splash_backward": ("block_q_dkv", "block_kv_dkv")}
_SEQ_MINOR = 2  # splash's QKVLayout.SEQ_MINOR: [..., head_dim, length]


class NotCounted(ValueError):
  """A kernel configuration whose traffic is not counted here: it keeps its declared cost."""


def splash_cost(kind: str, instruction: HloInstruction, operand_types: List[str]) -> tuple:
  """(FLOPs, HBM bytes) of one splash attention kernel, vmapped over the batch rows, from its operands' shapes and
  the block sizes in its metadata. Counted where each sequence is one block (models.layers' blocks for lengths
  up to 512): the grid then visits every (row, head) once, so each operand and output moves once; the scalar
  prefetch tables and the scratch outputs, whose blocks change with the row only, also once."""
  metadata = re.search(r'"xprof_metadata":"(\{.*?\})"', instruction.attributes)
  if not metadata:
    raise NotCounted(f"splash kernel {instruction.name} carries no block sizes")
  blocks = json.loads(metadata.group(1).replace('\\"', '"'))
  # Queries, keys and values are its first floating-point operands: [rows, heads, ...] (no rows axis where a
  # device has one row) after the scalar prefetch tables.
  arrays = [t for t in operand_types if t.startswith(("f", "bf")) and len(_dims(t)[0]) >= 3]
  if len(arrays) < 3:
    raise NotCounted(f"splash kernel {instruction.name} has {len(arrays)} query, key and value operands; expected 3")
  q_shape, k_shape = _dims(arrays[0])[0], _dims(arrays[1])[0]
  batch, heads, q_dims, k_dims = math.prod(q_shape[:-3]), q_shape[-3], q_shape[-2:], k_shape[-2:]
  seq_minor = blocks["q_layout"] == _SEQ_MINOR
  (head_dim, q_length), k_length = (q_dims if seq_minor else q_dims[::-1]), k_dims[1 if seq_minor else 0]
  q_block, k_block = (blocks[name] for name in _SPLASH_BLOCKS[kind])
  if (q_block, k_block) != (q_length, k_length):
    raise NotCounted(f"splash kernel {instruction.name} has blocks of {q_block} x {k_block} over {q_length} x "
                     f"{k_length}: only one block per sequence is counted")
  moved = sum(_tiled_bytes(t) for t in operand_types + _output_types(instruction.type))
  flops = _SPLASH_MATMUL_FLOPS_PER_QKD[kind] * batch * heads * q_length * k_length * head_dim
  return float(flops), float(moved)


def _output_types(hlo_type: str) -> List[str]:
  return tuple_elements(hlo_type) if hlo_type.startswith("(") else [hlo_type]


def kernel_costs(hlo_text: str) -> KernelCosts:
  """The declared and the counted costs of every Pallas kernel in a compiled program's HLO text."""
  computations, _ = parse_hlo(hlo_text)
  total = KernelCosts()
  for computation in computations.values():
    for instruction in computation.instructions.values():
      if instruction.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in instruction.attributes:
        continue
      declared_flops, declared_bytes = _declared(instruction)
      kind = _kind(instruction)
      operand_types = [computation.instructions[name].type for name in instruction.operands]
      try:
        if kind is None:
          raise NotCounted(instruction.name)
        cost = (splash_cost if kind.startswith("splash") else flash_cost)(kind, instruction, operand_types)
        kernel = KernelCosts(declared_flops, declared_bytes, *cost, counted=1)
      except NotCounted:
        kernel = KernelCosts(declared_flops, declared_bytes, declared_flops, declared_bytes, self_reported=1)
      total = total.plus(kernel, 1)
  return total
