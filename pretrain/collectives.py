"""The collectives of a compiled XLA program: the bytes each device sends per step, read from its HLO text.

`pretrain.plan` adds them to its estimate of step time, those between islands (GPU machines, TPU slices) apart:
their bytes cross the slower network between them. The HLO text format is libtpu's (0.0.42.1) or XLA's GPU
compiler's (jax 0.10.2): an unknown replica-group format or DCN transfer raises, and a loop whose trip count cannot
be read is counted once and said so.
"""
import collections
import dataclasses
import functools
import math
import re
from typing import Optional, Sequence

import numpy as np

# The step's cross-device collectives, read from the compiled program's HLO text. What one device sends
# in a bandwidth-optimal (ring) collective over a group of n devices, as a multiple of the buffer its
# HLO result shows: an all-reduce reduces then gathers its buffer, sending 2(n-1)/n of it; an
# all-gather's result is the gathered buffer, of which each device sends on the (n-1)/n it did not
# hold; a reduce-scatter's result is the 1/n of the reduced buffer a device keeps, and it sends (n-1)/n
# of the whole, n-1 times its result; an all-to-all keeps 1/n of its buffer and sends the rest; a
# collective-permute sends its whole buffer to another device.
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_SENT_PER_RESULT_BYTE = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
}
# libtpu writes a reduce-scatter as a custom fusion of this name (emitter *AllReduceScatterFusion): an
# all-reduce of the whole buffer, from which each device slices its part. It moves what a reduce-scatter
# moves, (n-1)/n of the buffer, not an all-reduce's 2(n-1)/n.
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"
# Opcode -> kind. An async collective is a -start and a -done; the -start carries the transfer. (XLA's GPU
# programs make every kind async; libtpu's, all but reduce-scatter and all-to-all.)
_COLLECTIVE_OPCODES = {**{kind: kind for kind in COLLECTIVE_KINDS},
                       **{f"{kind}-start": kind for kind in COLLECTIVE_KINDS}}
# libtpu sends what crosses slices over DCN as host transfers: a `send` whose frontend attributes name the
# collective (megascale's transfer type) and, for a reduction, the slices in its group ({1,2}x{0:7}: slices 1 and 2,
# each device's part). Each device sends its part: the send's operand.
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ONE_TO_ONE": "collective-permute"}
_MEGASCALE_TRANSFER = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,:]*)\}x')
# Its result tuple holds the operands, then the results: (input, output[, contexts]); an all-reduce-start's result is
# its output.
_ASYNC_RESULT_ELEMENT = {f"{kind}-start": 1 for kind in COLLECTIVE_KINDS if kind != "all-reduce"}
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY_TYPE = re.compile(r"([a-z]\w*)\[([\d,]*)\]")  # f32[4,128] in `f32[4,128]{1,0:T(8,128)}`
_INSTRUCTION = re.compile(r"\s+(?:ROOT )?%(\S+) = ")
_COMPUTATION = re.compile(r"(?:ENTRY )?%(\S+) .*\{$")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")  # {{0,1},{2,3}}; {} is all devices
_IOTA = re.compile(r"\[([\d,]*)\](?:T\(([\d,]*)\))?")  # [4,2]T(1,0): iota over [4,2], transposed
_IOTA_GROUPS = re.compile(rf"replica_groups=\[(\d+),(\d+)\]<=({_IOTA.pattern})")  # [groups,size]<=[8] or <=[4,2]T(1,0)
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class HloInstruction:
  """One instruction of HLO text: `%name = type opcode(arguments), attributes`."""
  name: str
  type: str  # 'f32[8,128]{1,0}', or a tuple '(f32[8]{0}, s32[])'
  opcode: str
  arguments: str  # operand names, or a constant's value
  attributes: str

  @property
  def operands(self) -> list:
    return re.findall(r"%([^\s,()]+)", self.arguments)

  def called(self, attribute: str) -> list:
    """Computations named by `attribute=%c` or `attribute={%a, %b}`."""
    match = re.search(rf"\b{attribute}=(\{{[^}}]*\}}|%\S+?)(?:,|$)", self.attributes)
    return re.findall(r"%([^\s,{}]+)", match.group(1)) if match else []

  def integer(self) -> Optional[int]:
    """A scalar integer constant's value, else None."""
    return int(self.arguments) if self.opcode == "constant" and re.fullmatch(r"-?\d+", self.arguments) else None

  def tuple_index(self) -> Optional[int]:
    match = re.search(r"\bindex=(\d+)", self.attributes)
    return int(match.group(1)) if self.opcode == "get-tuple-element" and match else None


@dataclasses.dataclass
class HloComputation:
  instructions: dict  # name -> HloInstruction, in program order
  root: str

  def source(self, name: str) -> HloInstruction:
    """The instruction whose value `name` holds, looking through copies and bitcasts."""
    instruction = self.instructions[name]
    while instruction.opcode in ("copy", "bitcast") and instruction.operands[0] in self.instructions:
      instruction = self.instructions[instruction.operands[0]]
    return instruction

  def tuple_element(self, name: str, index: int) -> Optional[HloInstruction]:
    """Element `index` of the tuple `name` builds, or None where it is not built here."""
    built = self.source(name)
    return self.source(built.operands[index]) if built.opcode == "tuple" else None


def _closing_parenthesis(text: str, start: int) -> int:
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  raise ValueError(f"unbalanced parentheses in HLO: {text[:200]}")


def parse_instruction(name: str, text: str) -> HloInstruction:
  """`text` is what follows `%name = `: the type (a tuple's holds parentheses), opcode, arguments."""
  type_end = _closing_parenthesis(text, 0) + 1 if text.startswith("(") else text.index(" ")
  opening = text.index("(", type_end)
  closing = _closing_parenthesis(text, opening)
  return HloInstruction(name, text[:type_end], text[type_end + 1:opening], text[opening + 1:closing],
                        text[closing + 1:])


def parse_hlo(text: str) -> tuple:
  """HLO module text -> ({computation name: HloComputation}, the entry computation's name)."""
  computations, entry, current, last = {}, None, None, None  # last: the instruction read last, [name, text]

  def add(instruction) -> None:
    if instruction:
      current.instructions[instruction[0]] = parse_instruction(*instruction)

  for line in text.splitlines():
    if current is None:
      header = _COMPUTATION.match(line)
      if header:
        current = computations[header.group(1)] = HloComputation({}, "")
        entry = header.group(1) if line.startswith("ENTRY") else entry
    elif line == "}":
      add(last)
      current = last = None
    else:
      head = _INSTRUCTION.match(line)
      if head:
        add(last)
        last = [head.group(1), line[head.end():]]
        current.root = head.group(1) if line.lstrip().startswith("ROOT ") else current.root
      elif last:  # an attribute that spans lines (a Pallas kernel's metadata)
        last[1] += "\n" + line
  return computations, entry


def _element_bytes(dtype: str) -> float:
  if dtype.startswith("f8"):
    return 1
  if dtype in ("s4", "u4"):
    return 0.5
  if dtype not in _ELEMENT_BYTES:
    raise ValueError(f"unknown HLO element type {dtype!r}")
  return _ELEMENT_BYTES[dtype]


def type_bytes(hlo_type: str) -> float:
  """Bytes of an HLO array type or of all arrays in a tuple type."""
  return sum(_element_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY_TYPE.findall(hlo_type))


def tuple_elements(hlo_type: str) -> list:
  """'(f32[2]{0}, (s32[], u32[]))' -> ['f32[2]{0}', '(s32[], u32[])']."""
  elements, depth, start = [], 0, 1
  for i, char in enumerate(hlo_type[1:-1], start=1):
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
    if char == "," and depth == 0:
      elements.append(hlo_type[start:i].strip())
      start = i + 1
  elements.append(hlo_type[start:-1].strip())
  return [re.sub(r"/\*.*?\*/", "", element) for element in elements]


def _iota(text: str) -> np.ndarray:
  """'[4,2]T(1,0)' -> arange(8) laid out as [4,2], then transposed."""
  dims, permutation = _IOTA.fullmatch(text).groups()
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(p) for p in permutation.split(",")]) if permutation else ids


def replica_groups(attributes: str, devices: int) -> np.ndarray:
  """[groups, size] of the device ids (partitions) of each replica group of a collective, in any of the forms XLA
  prints them: explicit {{0,1},{2,3}} ({} for all devices), iota [groups,size]<=[...], or a mesh with the axes
  grouped."""
  explicit, iota, mesh = (pattern.search(attributes) for pattern in (_EXPLICIT_GROUPS, _IOTA_GROUPS, _MESH_GROUPS))
  if mesh:
    sizes = {axis: int(size) for axis, size in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
    ids = np.arange(devices) if mesh.group(2) is None else (
        _iota(mesh.group(2)) if mesh.group(2).startswith("[") else np.array(re.findall(r"\d+", mesh.group(2)), int))
    ids = ids.reshape(list(sizes.values()))
    grouped = [list(sizes).index(axis) for axis in re.findall(r"'(\w+)'", mesh.group(3))]
    others = [axis for axis in range(len(sizes)) if axis not in grouped]
    return ids.transpose(others + grouped).reshape(-1, math.prod(ids.shape[axis] for axis in grouped))
  if iota:
    return _iota(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2)))
  if explicit:
    if not explicit.group(1):
      return np.arange(devices)[None]
    return np.array([[int(d) for d in group.split(",")] for group in re.findall(r"\{([\d,]+)\}", explicit.group(1))])
  raise ValueError(f"unrecognised replica groups in HLO: {attributes[:300]}")


def group_size(attributes: str, devices: int) -> int:
  """Devices in each replica group of a collective."""
  return replica_groups(attributes, devices).shape[1]


def _permute_pairs(attributes: str) -> list:
  """A collective-permute's (source, target) device ids."""
  pairs = re.search(r"source_target_pairs=(\{[\d,{}]*\})", attributes)
  return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))] if pairs else []


def spans_islands(instruction: HloInstruction, devices: int, islands: Sequence[int]) -> bool:
  """Whether a collective moves data between islands (GPU machines, TPU slices): `islands[i]` is device i's."""
  if instruction.opcode.removesuffix("-start") == "collective-permute":
    return any(islands[source] != islands[target] for source, target in _permute_pairs(instruction.attributes))
  groups = np.asarray(islands)[replica_groups(instruction.attributes, devices)]
  return bool((groups != groups[:, :1]).any())


def is_collective(opcode: str) -> bool:
  """Communication, not a kernel: a collective's opcode (collective-broadcast's too), a point-to-point send or
  recv, or an async one's -start or -done."""
  return opcode.removesuffix("-done").removesuffix("-start") in (*COLLECTIVE_KINDS, "collective-broadcast", "send",
                                                                  "recv")


def _megascale_bytes_sent(instruction: HloInstruction) -> tuple:
  """(kind, bytes one device sends over DCN) of a libtpu `send` between slices."""
  transfer = _MEGASCALE_TRANSFER.search(instruction.attributes).group(1)
  if transfer not in _MEGASCALE_KINDS:
    raise ValueError(f"unknown DCN transfer {transfer!r} in HLO: {instruction.attributes[:300]}")
  kind, sent = _MEGASCALE_KINDS[transfer], type_bytes(tuple_elements(instruction.type)[0])
  if kind == "all-reduce":
    entries = _MEGASCALE_SLICES.search(instruction.attributes).group(1).split(",")  # slice ids, or ranges a:b
    slices = sum(int(end) - int(start) + 1 if end else 1 for start, _, end in (e.partition(":") for e in entries))
    sent *= _SENT_PER_RESULT_BYTE[kind](slices)
  return kind, sent


def between_slices(instruction: HloInstruction) -> bool:
  """A libtpu `send` of a collective's part over DCN, to other slices."""
  return instruction.opcode == "send" and "_xla_megascale_transfer_type" in instruction.attributes


def bytes_sent(instruction: HloInstruction, devices: int, in_reduce_scatter_fusion: bool = False) -> tuple:
  """(kind, bytes one device sends) of a collective instruction; (None, 0) for any other."""
  if between_slices(instruction):
    return _megascale_bytes_sent(instruction)
  kind = _COLLECTIVE_OPCODES.get(instruction.opcode)
  if kind is None:
    return None, 0
  if kind == "all-reduce" and in_reduce_scatter_fusion:
    n = group_size(instruction.attributes, devices)
    return "reduce-scatter", (n - 1) / n * type_bytes(instruction.type)
  result = instruction.type
  if instruction.opcode in _ASYNC_RESULT_ELEMENT:
    result = tuple_elements(result)[_ASYNC_RESULT_ELEMENT[instruction.opcode]]
  if kind == "collective-permute":
    moves = any(source != target for source, target in _permute_pairs(instruction.attributes))
    return kind, type_bytes(result) if moves else 0
  return kind, _SENT_PER_RESULT_BYTE[kind](group_size(instruction.attributes, devices)) * type_bytes(result)


def while_trip_count(loop: HloInstruction, caller: HloComputation, computations: dict) -> Optional[int]:
  """How many times a while loop runs its body, None where its form is not recognised.

  XLA notes `known_trip_count` on some backends (not TPU's). Otherwise this reads jax's form of a
  scan or fori_loop: a counter in the loop's tuple that starts at a constant, is stepped by a constant
  in the body and is compared `<` a constant in the condition.
  """
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
  if known:
    return int(known.group(1))
  condition, body = (computations[loop.called(part)[0]] for part in ("condition", "body"))
  compare = condition.instructions[condition.root]
  if compare.opcode != "compare" or "direction=LT" not in compare.attributes:
    return None
  counter, limit = (condition.source(name) for name in compare.operands)
  index = counter.tuple_index()
  if index is None or limit.integer() is None:
    return None
  start = caller.tuple_element(loop.operands[0], index)
  update = body.tuple_element(body.root, index)
  if start is None or start.integer() is None or update is None or update.opcode != "add":
    return None
  terms = [body.source(name) for name in update.operands]
  steps = [term.integer() for term in terms if term.integer() is not None]
  if len(steps) != 1 or steps[0] <= 0 or not any(term.tuple_index() == index for term in terms):
    return None
  return max(0, -(-(limit.integer() - start.integer()) // steps[0]))


@dataclasses.dataclass
class Collectives:
  """Bytes one device sends per step in the step's collectives, each loop body counted as often as it runs."""
  bytes_by_kind: dict
  loops_of_unknown_length: int = 0  # their bodies counted once: the bytes are then a lower bound
  # Of the total, the bytes of collectives whose groups span islands (GPU machines, TPU slices): their transfers go
  # over the network between them (a ring through the group crosses it), not over NVLink or ICI alone.
  between_islands: float = 0.0

  @property
  def total(self) -> float:
    return sum(self.bytes_by_kind.values())


def collective_traffic(hlo_text: str, devices: int, islands: Optional[Sequence[int]] = None) -> Collectives:
  """Collectives of a compiled program (`compiled.as_text()`) on `devices` devices; `islands[i]`: the island of
  the program's device i (None: one island).

  XLA lists a loop body once: a while loop's body counts as many times as the loop runs (scanned
  layers, microbatches); a conditional counts as its costliest branch.
  """
  computations, entry = parse_hlo(hlo_text)
  unknown_loops = set()
  several_islands = islands is not None and len(set(islands)) > 1

  @functools.lru_cache(maxsize=None)
  def sent_in(name: str) -> collections.Counter:
    """Bytes by (kind, whether between islands) in one run of computation `name`, with all it calls."""
    computation, total = computations[name], collections.Counter()

    def add(callee: str, runs: int = 1) -> None:
      total.update({key: runs * sent for key, sent in sent_in(callee).items()})

    for instruction in computation.instructions.values():
      kind, sent = bytes_sent(instruction, devices, name.startswith(_REDUCE_SCATTER_FUSION))
      if kind:  # (its `to_apply` is the reduction, no collective)
        total[kind, between_slices(instruction) or (several_islands and sent > 0
                                                    and spans_islands(instruction, devices, islands))] += sent
      elif instruction.opcode == "while":  # (its condition holds no collective)
        runs = while_trip_count(instruction, computation, computations)
        if runs is None:
          unknown_loops.add(instruction.name)
        add(instruction.called("body")[0], 1 if runs is None else runs)
      elif instruction.opcode == "conditional":  # one branch runs: count the costliest
        branches = [sent_in(branch) for attribute in ("branch_computations", "true_computation", "false_computation")
                    for branch in instruction.called(attribute)]
        total.update(max(branches, key=lambda sent: sum(sent.values())))
      elif instruction.opcode == "call":
        add(instruction.called("to_apply")[0])
      elif instruction.opcode not in ("async-update", "async-done"):  # an async-start already ran its call
        for callee in instruction.called("calls"):  # a fusion's, or an async collective's computation
          add(callee)
    return total

  sent = sent_in(entry)
  by_kind = {kind: sent[kind, False] + sent[kind, True] for kind in COLLECTIVE_KINDS}
  return Collectives({kind: by_kind[kind] for kind in COLLECTIVE_KINDS if by_kind[kind]}, len(unknown_loops),
                     sum(sent[kind, True] for kind in COLLECTIVE_KINDS))
