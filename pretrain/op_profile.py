"""Where a compiled program's device time goes: the kernels of a jax.profiler trace, summed by the model
code that made them.

Each kernel event of a trace names the HLO instruction it ran (its `hlo_op` stat) and the program (its
`hlo_module`); the compiled program's text gives each instruction's source as JAX recorded it (`op_name`
metadata: transforms and the Flax module path). Times are summed per source with layer indices folded
(`layer_3` -> `layer_*`), forward and backward apart, so a report reads, e.g., "backward
encoder/layer_*/attention/.../dot_general: 21 ms of a 124 ms step". A kernel run from a CUDA graph
(XLA's command buffers on GPUs) is known by its name, which spells its fusion's; one that names no
instruction (a library's, such as cuBLAS's) is counted under its own name.

  python -m pretrain.op_profile TRACE.xplane.pb [--hlo=PROGRAM.txt] [--steps=N] [--top=N]
"""
import collections
import dataclasses
import re
import sys
from typing import Dict, Iterable, Optional

# `name = type[shape] opcode(...), ..., metadata={op_name="..." ...}` in HLO text; `%` before names in older XLA.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')
_C_IDENTIFIER = re.compile(r"[^\w]")
_NUMBERED = re.compile(r"[.]\d+$")  # fusion.12 -> fusion
_LAYER_INDEX = re.compile(r"(layer|layers|block|blocks)_\d+")


@dataclasses.dataclass
class KernelTime:
  seconds: float = 0.0
  launches: int = 0


def kernel_times(xplane_path: str, module: Optional[str] = None) -> Dict[str, KernelTime]:
  """Device time per HLO instruction (or kernel name, where no instruction is named) in a trace, summed
  over its events: the device planes' on an accelerator, the host's XLA thunks on the CPU. `module`
  keeps only the program of that name (`module_name`) and the kernels that name no program."""
  from jax.profiler import ProfileData
  with open(xplane_path, "rb") as f:
    serialized = f.read()
  try:
    data = ProfileData.from_serialized_xspace(serialized)
  except RuntimeError as e:  # the parser's only word on a file that is not an XSpace
    raise ValueError(f"{xplane_path}: not a jax.profiler trace (an .xplane.pb file): {e}") from None
  planes = [p for p in data.planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
  on_host = not any(_has_kernels(p) for p in planes)
  if on_host:
    planes = [p for p in data.planes if p.name == "/host:CPU"]
  times = collections.defaultdict(KernelTime)
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if on_host and "hlo_op" not in stats:
          continue  # the host's other work: Python, dispatch, the profiler itself
        if module and stats.get("hlo_module", module) != module:
          continue
        instruction = str(stats.get("hlo_op") or event.name)
        if instruction.startswith("command_buffer"):  # a CUDA graph's kernel: its own name is the fusion's
          instruction = event.name
        entry = times[instruction]
        entry.seconds += event.duration_ns * 1e-9
        entry.launches += 1
  return dict(times)


def _has_kernels(plane) -> bool:
  return any(True for line in plane.lines for _ in line.events)


def module_name(hlo_text: str) -> str:
  """The program's name in a compiled program's text (what a trace's events call their `hlo_module`)."""
  match = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
  if not match:
    raise ValueError("not an HLO module's text: it does not begin with 'HloModule NAME'")
  return match.group(1)


def instruction_sources(hlo_text: str) -> Dict[str, str]:
  """HLO instruction name -> its op_name metadata, from a compiled program's text (`compiled.as_text()`)."""
  sources = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      sources[match.group(1)] = match.group(2)
      # A GPU kernel a trace does not tie to its instruction (one run in a CUDA graph) bears the fusion's name
      # spelled as a C identifier: loop_add_fusion.3 -> loop_add_fusion_3.
      sources.setdefault(_C_IDENTIFIER.sub("_", match.group(1)), match.group(2))
  return sources


def source_group(op_name: str) -> str:
  """'forward|backward path/primitive' of an op_name: JAX's transform wrappers (jit(...), jvp(...),
  transpose(...), remat, ...) dropped, layer indices folded, backward where the op is a transpose's."""
  parts = [p for p in op_name.split("/") if p]
  backward = any(p.startswith("transpose(") for p in parts)
  path = [_LAYER_INDEX.sub(r"\1_*", p) for p in parts if "(" not in p and p not in ("main", "rematted_computation")]
  return f"{'backward' if backward else 'forward '} {'/'.join(path) or op_name}"


def grouped(times: Dict[str, KernelTime], sources: Dict[str, str]) -> Dict[str, KernelTime]:
  """Kernel times summed by `source_group` of their instruction's source; unknown instructions by name."""
  groups = collections.defaultdict(KernelTime)
  for instruction, time in times.items():
    source = sources.get(instruction)
    key = source_group(source) if source else "(no source) " + _NUMBERED.sub("", instruction)
    groups[key].seconds += time.seconds
    groups[key].launches += time.launches
  return dict(groups)


def report(times: Dict[str, KernelTime], sources: Dict[str, str], steps: int, top: int = 25,
           step_seconds: Optional[float] = None, what: str = "device time") -> str:
  """A table of the `top` sources by device time per step, with the total kernel time per step (and, given
  the measured step time, the share the device was busy); `what` the times are, if not measured."""
  groups = sorted(grouped(times, sources).items(), key=lambda kv: -kv[1].seconds)
  total = sum(t.seconds for t in times.values()) / steps
  busy = f", {100 * total / step_seconds:.0f}% of the {1e3 * step_seconds:.1f} ms step" if step_seconds else ""
  lines = [f"{what} per step {1e3 * total:.1f} ms in {sum(t.launches for t in times.values()) // steps} "
           f"kernels{busy}; top {min(top, len(groups))} of {len(groups)} sources:",
           f"{'ms/step':>9}{'share':>7}{'kernels':>8}  source"]
  for key, time in groups[:top]:
    lines.append(f"{1e3 * time.seconds / steps:>9.2f}{100 * time.seconds / steps / total:>6.1f}%"
                 f"{time.launches // steps:>8}  {key}")
  return "\n".join(lines)


def summary(trace: str, program: str, steps: int, top: int = 25, step_seconds: Optional[float] = None) -> str:
  """`report` of the kernels in `trace` of the compiled program whose text is `program`, named by source."""
  times = kernel_times(trace, module_name(program))
  return report(times, instruction_sources(program), steps, top, step_seconds)


def main(argv: Iterable[str]) -> int:
  import argparse
  parser = argparse.ArgumentParser(prog="python -m pretrain.op_profile", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("trace", help="a .xplane.pb file written by jax.profiler (e.g. PROFILE_STEPS')")
  parser.add_argument("--hlo", help="the compiled program's text (`compiled.as_text()`): only its kernels are counted, "
                                    "each named by its source")
  parser.add_argument("--steps", type=int, default=1, help="steps the trace holds: times are per step")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args(list(argv))
  try:
    program = open(args.hlo).read() if args.hlo else None
    try:
      module = module_name(program) if program else None
    except ValueError as e:
      raise ValueError(f"{args.hlo}: {e}") from None
    times = kernel_times(args.trace, module)
  except (OSError, ValueError) as e:
    print(f"pretrain.op_profile: error: {e}", file=sys.stderr)
    return 1
  if not times:
    print(f"pretrain.op_profile: error: {args.trace} holds no kernel events"
          + (f" of the program {module}" if module else ""), file=sys.stderr)
    return 1
  sources = instruction_sources(program) if program else {}
  print(report(times, sources, args.steps, args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
