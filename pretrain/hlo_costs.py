"""The kernels of a compiled XLA program and what each costs: FLOPs and HBM bytes, read from its HLO text.

XLA's GPU compiler gives no cost analysis for a program compiled without a GPU (`pretrain.plan --topology=h100:8`
compiles for described GPUs), so the plan counts a step's cost here, kernel by kernel. A kernel is an
instruction of the entry computation (or of a loop body, counted as often as the loop runs): a fusion, a library
call (cuBLAS, cuDNN) or an unfused op. Each reads its operands from HBM and writes its result there once:
- FLOPs are the matrix products' (2 × result elements × contracted size; cuDNN's flash attention, forward and
  backward, and models/flash_dropout.py's Triton kernels from their shapes); element-wise arithmetic is left out,
  as it is bounded by its bytes;
- bytes are the operands' and the result's, but for what a fusion only slices out of an operand (the slice) and
  an in-place update of a buffer (the update, read and written; not the whole buffer).
Collectives are left out: `pretrain.collectives` counts what they send.
"""
import dataclasses
import functools
import json
import math
import re
from typing import List, Optional

from pretrain import op_profile
from pretrain.collectives import (HloInstruction, is_collective, parse_hlo, tuple_elements, type_bytes,
                                  while_trip_count)

# Instructions that launch nothing and move no bytes of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain"}
_SLICES = ("slice", "dynamic-slice")
_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One kernel of the program and its cost each time it runs."""
  name: str
  source: str  # its op_name: where in the model it comes from
  flops: float
  bytes_accessed: float
  runs: int = 1  # per step: a loop body's kernels run as often as the loop
  counted: bool = True  # False: a library call of unknown algorithm, its FLOPs unknown (bytes only)

  def seconds(self, peak_flops: float, hbm_bandwidth: float) -> float:
    """Its roofline time per step: its FLOPs at peak or its bytes at full bandwidth, whichever is longer."""
    return self.runs * max(self.flops / peak_flops, self.bytes_accessed / hbm_bandwidth)


def _shape(hlo_type: str) -> List[int]:
  match = _DIMS.search(hlo_type)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _result_type(instruction: HloInstruction) -> str:
  """A library call's result without its scratch space (the s8/u8 workspace at the end of its tuple)."""
  if not instruction.type.startswith("("):
    return instruction.type
  elements = tuple_elements(instruction.type)
  return ", ".join(e for e in elements if not re.match(r"[su]8\[", e)) or instruction.type


def _backend_config(instruction: HloInstruction) -> dict:
  match = re.search(r"backend_config=(\{.*\})\s*$", instruction.attributes, re.S)
  try:
    return json.loads(match.group(1)) if match else {}
  except json.JSONDecodeError:
    return {}


def _product_flops(result_type: str, lhs_type: str, lhs_contracting: List[int]) -> float:
  """2 × result elements × the contracted size of a matrix product."""
  lhs = _shape(lhs_type)
  return 2.0 * math.prod(_shape(result_type)) * math.prod(lhs[d] for d in lhs_contracting)


def _dot_flops(dot: HloInstruction, lhs_type: str) -> float:
  """FLOPs of an HLO dot instruction whose left operand is of `lhs_type`."""
  match = re.search(r"\blhs_contracting_dims=\{([\d,]*)\}", dot.attributes)
  contracting = [int(d) for d in match.group(1).split(",") if d] if match else []
  return _product_flops(dot.type, lhs_type, contracting)


def _library_call_flops(instruction: HloInstruction, operand_types: List[str]) -> Optional[float]:
  """FLOPs of a cuBLAS product or a cuDNN flash attention, None for a call of unknown algorithm."""
  target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
  target = target.group(1) if target else ""
  config = _backend_config(instruction)
  if target.startswith("__cublas"):
    dims = config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    return _product_flops(_result_type(instruction), operand_types[0], contracting)
  if target.startswith("__cudnn$fmha"):
    fmha = config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    query = _shape(operand_types[0])
    if len(scores) != 4 or len(query) != 4:
      return None
    head_dim = query[-1]
    # Forward: scores = q·kᵀ and out = p·v. Backward: the scores again, then dv, dp, dq and dk.
    products = 5 if "Backward" in target else 2
    return products * 2.0 * math.prod(scores) * head_dim
  if target == "__gpu$xla.gpu.triton":
    return _flash_dropout_flops(instruction, operand_types)
  return None


# models/flash_dropout.py's Triton kernels, by the name of their kernel function (in the op_name), and the products
# each does per query × key × head dim, 2 FLOPs each: forward S = QKᵀ and O = PV; dk/dv kernel S again, dV = PᵀdO,
# dP = dO Vᵀ, dK = dSᵀQ; dq kernel S, dP, dQ = dS K. A causal kernel skips the key blocks past its queries; it is
# counted whole (its program shows no mask), so a plan errs high on BART's decoder.
_FLASH_DROPOUT_PRODUCTS = {"_forward_kernel": 2, "_dkv_kernel": 4, "_dq_kernel": 3}


def _flash_dropout_flops(instruction: HloInstruction, operand_types: List[str]) -> Optional[float]:
  """FLOPs of one of flash_dropout's kernels, from its query and key operands ([batch, length, heads, head dim],
  its first two of 4 dimensions), None for another Triton kernel."""
  kernel = re.search(r'op_name="[^"]*/(\w+)/pallas_call"', instruction.attributes)
  blocks = [_shape(t) for t in operand_types if len(_shape(t)) == 4]
  if not kernel or kernel.group(1) not in _FLASH_DROPOUT_PRODUCTS or len(blocks) < 2:
    return None
  (batch, queries, heads, head_dim), keys = blocks[0], blocks[1][1]
  return _FLASH_DROPOUT_PRODUCTS[kernel.group(1)] * 2.0 * batch * heads * queries * keys * head_dim


def _fusion_cost(instruction: HloInstruction, operand_types: List[str], fused) -> tuple:
  """(FLOPs, bytes) of a fusion: its products' FLOPs; the bytes it reads of each operand and writes."""
  parameters = {int(re.match(r"(\d+)", i.arguments).group(1)): name
                for name, i in fused.instructions.items() if i.opcode == "parameter"}
  users = {name: [] for name in fused.instructions}
  for name, i in fused.instructions.items():
    for operand in i.operands:
      if operand in users:
        users[operand].append(fused.instructions[name])
  root = fused.source(fused.root)
  updated = None  # the buffer an in-place update writes into: neither read nor written whole
  if root.opcode == "dynamic-update-slice" and fused.source(root.operands[0]).opcode == "parameter":
    updated = fused.source(root.operands[0]).name
  read = 0.0
  for index, operand_type in enumerate(operand_types):
    name = parameters.get(index)
    if name is None:
      read += type_bytes(operand_type)
    elif name == updated:
      continue
    elif users[name] and all(u.opcode in _SLICES for u in users[name]):
      read += min(type_bytes(operand_type), sum(type_bytes(u.type) for u in users[name]))
    else:
      read += type_bytes(operand_type)
  # An in-place update writes the updated region; what it is made from was read among the operands.
  written = type_bytes(fused.instructions[root.operands[1]].type if updated else _result_type(instruction))
  flops = sum(_dot_flops(i, fused.instructions[i.operands[0]].type) for i in fused.instructions.values()
              if i.opcode == "dot")
  return flops, read + written


@dataclasses.dataclass
class ProgramCosts:
  kernels: List[Kernel]
  loops_of_unknown_length: int = 0  # their bodies counted once

  @property
  def flops(self) -> float:
    return sum(k.runs * k.flops for k in self.kernels)

  @property
  def bytes_accessed(self) -> float:
    return sum(k.runs * k.bytes_accessed for k in self.kernels)

  @property
  def uncounted(self) -> int:
    return sum(1 for k in self.kernels if not k.counted)

  def serial_seconds(self, peak_flops: float, hbm_bandwidth: float) -> float:
    """The step's bound when its kernels run one after another, each at its own roofline."""
    return sum(k.seconds(peak_flops, hbm_bandwidth) for k in self.kernels)

  def report(self, peak_flops: float, hbm_bandwidth: float, top: int) -> str:
    """op_profile's table of the `top` sources by their kernels' roofline times."""
    times = {k.name: op_profile.KernelTime(k.seconds(peak_flops, hbm_bandwidth), k.runs) for k in self.kernels}
    table = op_profile.report(times, {k.name: k.source for k in self.kernels if k.source}, steps=1, top=top,
                              what="kernel time at the rooflines")
    if self.uncounted:
      table += (f"\nwarning: {self.uncounted} kernel(s) of unknown FLOPs (custom calls other than cuBLAS's, cuDNN's "
                "attention and our Triton attention) counted by their bytes only")
    if self.loops_of_unknown_length:
      table += f"\nwarning: {self.loops_of_unknown_length} loop(s) of unrecognised trip count counted once"
    return table


def program_costs(hlo_text: str) -> ProgramCosts:
  """The kernels of a compiled program (`compiled.as_text()`) with their costs per step."""
  computations, entry = parse_hlo(hlo_text)
  sources = op_profile.instruction_sources(hlo_text)
  unknown_loops = [0]

  @functools.lru_cache(maxsize=None)
  def kernels_of(name: str) -> tuple:
    computation, kernels = computations[name], []
    for instruction in computation.instructions.values():
      opcode = instruction.opcode
      if opcode in _FREE or is_collective(opcode):
        continue
      if opcode == "while":
        runs = while_trip_count(instruction, computation, computations)
        unknown_loops[0] += runs is None
        body = instruction.called("body")[0]
        kernels += [dataclasses.replace(k, runs=k.runs * (runs or 1)) for k in kernels_of(body)]
        continue
      if opcode in ("call", "conditional"):
        branches = [kernels_of(c) for c in instruction.called("to_apply") + instruction.called("branch_computations")]
        kernels += max(branches, key=lambda ks: sum(k.runs * k.bytes_accessed for k in ks), default=())
        continue
      operand_types = [computation.instructions[o].type for o in instruction.operands
                       if o in computation.instructions]
      flops, counted = 0.0, True
      if opcode == "fusion":
        flops, moved = _fusion_cost(instruction, operand_types, computations[instruction.called("calls")[0]])
      elif opcode == "dynamic-update-slice":  # in place: the update and indices read, the region written
        moved = sum(type_bytes(t) for t in operand_types[1:]) + type_bytes(operand_types[1])
      else:
        moved = sum(type_bytes(t) for t in operand_types) + type_bytes(_result_type(instruction))
        if opcode == "custom-call":
          flops = _library_call_flops(instruction, operand_types)
          counted, flops = flops is not None, flops or 0.0
        elif opcode == "dot":
          flops = _dot_flops(instruction, operand_types[0])
      kernels.append(Kernel(instruction.name, sources.get(instruction.name, ""), flops, moved, counted=counted))
    return tuple(kernels)

  kernels = list(kernels_of(entry))
  return ProgramCosts(kernels, unknown_loops[0])
