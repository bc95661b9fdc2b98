"""Will a run fit on a TPU slice, and how fast could it be? Its training step, compiled ahead of time.

  python -m pretrain.plan --gin_file=gin_configs/runs/xlnet_large_v3_512.gin [--gin.KEY=VALUE ...] \\
      [--topology=v3:16x16] [--num_slices=N]

Needs libtpu (`pip install -e ".[tpu]"`), not a TPU. It parses the same gin files as pretrain.train,
takes train()'s bound arguments, builds the same Setup (steps.make_setup: model, optimizer,
shardings, microbatches, remat from the model config) over the devices of the topology and compiles
the same jitted step (steps.jit_train_step) for them. It prints the compiler's per-device HBM
figures, FLOPs and bytes per step, the model's FLOPs, the bytes each device sends in the step's
collectives (read from the compiled program), and a roofline estimate of step time and MFU, with the
collectives overlapped and not. With scanned layers the memory figures and collectives are the scanned
program's, and its FLOPs and bytes come from small unrolled compiles (XLA counts a loop body once).
`--topology` is libtpu's name, `vN:AxB[xC]` in chips (`v3:16x16` is a v3-512 slice);
`--num_slices` defaults to the run's NUM_SLICES.

Exit codes: 0 fits; 2 does not fit (the compiler's out-of-memory line on stderr); 1 bad configuration.
A large model takes minutes and up to 13 GB of host RAM to compile (XLNet-Large on v3:16x16):
plan one configuration at a time.
"""
import dataclasses
import math
import os
import re
import sys
import time
import warnings
from typing import Optional

from pretrain import cli
from pretrain.collectives import Collectives, collective_traffic
from pretrain.errors import ConfigError

DEFAULT_TOPOLOGY = "v3:16x16"
GIB = 2 ** 30
HEADROOM_WARNING = 0.10  # below this fraction of free HBM, fragmentation or a new libtpu may tip it over


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip. A JAX device is a chip, or one TensorCore where the topology lists cores."""
  cloud_name: str  # accelerator types are <cloud_name>-<TensorCores>: v3-512 is 256 chips
  tensorcores: int
  peak_bf16_flops: float  # FLOP/s
  hbm_bandwidth: float  # bytes/s
  usable_hbm_bytes: float  # what XLA lets a program use: its out-of-memory message, libtpu 0.0.42.1
  device_kinds: tuple  # jax Device.device_kind of the generation, as jax/_src/pallas/mosaic/tpu_info.py names them
  ici_bandwidth: float  # bytes/s one chip sends over all its ICI links together, one direction


# Peak bf16 FLOP/s and HBM bandwidth per chip from the sources named; usable HBM measured by compiling
# an oversized program for each generation (nominal HBM per chip in the comments). ICI bandwidth is
# what a chip can send at once over all its links, one way: Cloud's "all-reduce bandwidth per Pod" over
# the Pod's chips, which is also half its "bidirectional ICI bandwidth per chip" where it gives both.
CHIPS = {
    # Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural Networks", CACM 2020:
    # 46 TFLOP/s, 700 GB/s, 16 GiB (2 cores of 7.48 GiB usable); ICI 4 links of 496 Gbit/s.
    "v2": Chip("v2", 2, 46e12, 700e9, 2 * 7.48 * GIB, ("TPU v2",), 4 * 496e9 / 8),
    # cloud.google.com/tpu/docs/v3: 123 TFLOP/s, 900 GB/s, 32 GiB (2 cores of 15.48 GiB usable);
    # all-reduce bandwidth 340 TB/s per Pod of 1024 chips (Jouppi et al.: 4 links of 656 Gbit/s, 328 GB/s).
    "v3": Chip("v3", 2, 123e12, 900e9, 2 * 15.48 * GIB, ("TPU v3",), 340e12 / 1024),
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s, 1200 GB/s, 32 GiB (2 cores of 15.25 GiB usable);
    # all-reduce bandwidth 1.1 PB/s per Pod of 4096 chips.
    "v4": Chip("v4", 2, 275e12, 1200e9, 2 * 15.25 * GIB, ("TPU v4",), 1.1e15 / 4096),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s, 819 GB/s, 16 GB; ICI 400 GB/s per chip both ways
    # (all-reduce bandwidth 51.2 TB/s per Pod of 256 chips).
    "v5e": Chip("v5litepod", 1, 197e12, 819e9, 15.75 * GIB, ("TPU v5 lite", "TPU v5e"), 400e9 / 2),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s, 2765 GB/s, 95 GB; ICI 1200 GB/s per chip both ways.
    "v5p": Chip("v5p", 2, 459e12, 2765e9, 95.74 * GIB, ("TPU v5", "TPU v5p"), 1200e9 / 2),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOP/s, 1638 GB/s, 32 GB; ICI 800 GB/s per chip both ways
    # (all-reduce bandwidth 102.4 TB/s per Pod of 256 chips).
    "v6e": Chip("v6e", 1, 918e12, 1638e9, 31.25 * GIB, ("TPU v6 lite", "TPU v6e"), 800e9 / 2),
}
# Peak dense bf16 FLOP/s of one GPU from NVIDIA's datasheets, which give Tensor Core figures "with
# sparsity", twice the dense ones: A100 624 TFLOP/s (SXM and PCIe); H100 1979 (SXM), 1671 (NVL), 1513
# (PCIe); H200 1979 (SXM, as GH200), 1671 (NVL); L4 242. V100 has no bf16 nor sparsity: fp16 Tensor 125
# (SXM2), 112 (PCIe). A pattern is a whole word of jax's device_kind ('NVIDIA H100 80GB HBM3',
# 'Tesla V100-SXM2-16GB'); the first match wins.
# AWS's A10G has no NVIDIA datasheet: left out (MFU n/a) rather than guessed.
GPUS = (
    ("A100", 312e12),
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("L4", 121e12),
    ("V100-PCIE", 112e12),
    ("V100", 125e12),
)
_TOPOLOGY = re.compile(r"(v\d+[a-z]*):(\d+(?:x\d+)*)")

# train()'s arguments that shape the compiled step; the rest (paths, schedule of logging) do not.
STEP_ARGUMENTS = ("family", "mixture_or_task_name", "task_feature_lengths", "batch_size", "mesh_shape",
                  "optimizer", "schedule", "microbatches", "microbatch_rows_per_group", "num_slices")


HELP = cli.gin_help(__doc__, flags=f"""\
  --topology=vN:AxB[xC]       libtpu's name of the slice, in chips (default {DEFAULT_TOPOLOGY}, a v3-512)
  --num_slices=N              slices joined over DCN (default: the run's NUM_SLICES)""")


class DoesNotFit(Exception):
  """The step needs more HBM than the device has; the message says so in one line."""


def parse_topology(name: str) -> tuple:
  """'v3:16x16' -> ('v3', 256 chips)."""
  match = _TOPOLOGY.fullmatch(name)
  if not match or match.group(1) not in CHIPS:
    raise ConfigError(f"--topology={name!r}: expected <generation>:<chips per axis>, e.g. v3:16x16 "
                     f"(generations {', '.join(CHIPS)})")
  return match.group(1), math.prod(int(n) for n in match.group(2).split("x"))


def peak_flops_per_device(device) -> Optional[float]:
  """Peak bf16 FLOP/s of one JAX device, None where unknown (CPU, a GPU not in GPUS).

  A TPU device is one TensorCore of a v2 or v3 chip, or a whole v4 or v5p chip (megacore: both
  TensorCores, `num_cores` 2), as in the Plan's devices_per_chip; v5e and v6e chips have one core.
  """
  for chip in CHIPS.values():
    if device.device_kind in chip.device_kinds:
      return chip.peak_bf16_flops * getattr(device, "num_cores", 1) / chip.tensorcores
  return next((peak for name, peak in GPUS if re.search(rf"\b{name}\b", device.device_kind)), None)


def accelerator_type(topology: str) -> str:
  """'v3:16x16' -> 'v3-512', the Cloud name of the slice."""
  generation, chips = parse_topology(topology)
  chip = CHIPS[generation]
  return f"{chip.cloud_name}-{chips * chip.tensorcores}"


def matmul_flops(jaxpr) -> float:
  """2·M·N·K over every dot_general, recursing into sub-programs: scan bodies × length, the costliest
  cond branch, while bodies once (their trip count is unknown)."""
  import jax.extend.core as jex
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
      lhs_shape = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs_shape[d] for d in lhs_contracting)
    inner = [matmul_flops(sub) for sub in jex.jaxprs_in_params(eqn.params)]
    if eqn.primitive.name == "cond":
      total += max(inner, default=0.0)
    elif eqn.primitive.name == "scan":
      total += eqn.params["length"] * sum(inner)
    else:
      total += sum(inner)
  return total


def model_flops_per_step(setup) -> float:
  """Matmul FLOPs of one step's forward and backward pass at the global batch, counted in the program
  with remat off and layers unrolled: MFU's model FLOPs exclude recomputation, and the backward pass
  of a scan computes a few products an unrolled one skips. (3 × forward over-counts matmuls whose
  inputs need no gradient: XLNet's memory, relative positions and target mapping.) Attention is counted
  as XLA computes it: a fused kernel's products are not dot_generals of the program, but the same FLOPs."""
  import jax
  unfused = {"attention_implementation": "xla"} if hasattr(setup.family.config, "attention_implementation") else {}
  config = dataclasses.replace(setup.family.config, remat_policy="none", scan_layers=False, **unfused)
  family = dataclasses.replace(setup.family, config=config)
  plain = dataclasses.replace(setup, family=family, model=family.make_model())
  model, state = plain.model, plain.abstract_state()

  def loss(params, batch, carry):
    outputs, _ = family.forward(model, params, batch, carry, rngs={}, deterministic=True)
    return family.loss_and_metrics(outputs, batch)[0]

  return matmul_flops(jax.make_jaxpr(jax.grad(loss))(state.params, setup.batch_shapes, state.carry).jaxpr)


def compile_step(setup):
  """steps.jit_train_step(setup) compiled for abstract state and batch with the run's shardings."""
  import flax.linen as nn
  import jax

  from pretrain import partitioning, steps
  batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=partitioning.batch_sharding(setup.mesh))
           for k, s in setup.batch_shapes.items()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh`, as in train(); jax prefers jax.set_mesh
    with setup.mesh, nn.logical_axis_rules(setup.rules):
      lowered = steps.jit_train_step(setup).lower(setup.sharded_abstract_state(), batch)
  try:
    return lowered.compile()
  except Exception as e:  # XLA reports running out of HBM as a runtime error from compile()
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raise DoesNotFit(next((line for line in lines if "memory" in line.lower()), lines[0])) from None


@dataclasses.dataclass
class Plan:
  topology: str
  num_slices: int
  devices: int
  device_kind: str
  chip: Chip
  devices_per_chip: float
  family: str
  parameters: int
  batch_size: int
  mesh: dict
  microbatches: int
  remat: str
  scan_layers: bool  # XLA counts a scanned stack's body once: costs come from unrolled_step_cost
  tokens_per_step: int
  compile_seconds: float = 0.0
  memory: dict = dataclasses.field(default_factory=dict)  # bytes per device
  compiled_flops: float = 0.0  # per device per step, loop bodies multiplied out
  bytes_accessed: float = 0.0  # per device per step, likewise
  model_flops: float = 0.0  # whole step, all devices
  collectives: Collectives = dataclasses.field(default_factory=lambda: Collectives({}))  # of the compiled step

  @property
  def peak_flops(self) -> float:
    return self.chip.peak_bf16_flops / self.devices_per_chip

  @property
  def hbm_bandwidth(self) -> float:
    return self.chip.hbm_bandwidth / self.devices_per_chip

  @property
  def ici_bandwidth(self) -> float:  # the two TensorCores of a v2-v4 chip share its links
    return self.chip.ici_bandwidth / self.devices_per_chip

  @property
  def hbm_limit(self) -> float:
    return self.chip.usable_hbm_bytes / self.devices_per_chip

  @property
  def hbm_total(self) -> float:
    m = self.memory
    return m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"]

  def step_seconds(self) -> dict:
    """Roofline lower bounds per step: all FLOPs at peak, all HBM bytes at full bandwidth, all collective
    bytes at full ICI bandwidth (every link busy; latency ignored)."""
    return {"compute": self.compiled_flops / self.peak_flops, "HBM": self.bytes_accessed / self.hbm_bandwidth,
            "communication": self.collectives.total / self.ici_bandwidth}

  def mfu(self, step_seconds: float) -> float:
    return self.model_flops / (self.devices * self.peak_flops * step_seconds)


def setup_lines(p: Plan) -> list:
  return [
      f"topology: {p.topology} ({accelerator_type(p.topology)}) x {p.num_slices} slice(s) = {p.devices} devices "
      f"({p.device_kind}); per device "
      f"{p.hbm_limit / GIB:.2f} GiB HBM usable, {p.peak_flops / 1e12:.1f} TFLOP/s bf16 peak, "
      f"{p.hbm_bandwidth / 1e9:.0f} GB/s HBM, {p.ici_bandwidth / 1e9:.0f} GB/s ICI",
      f"run: {p.family}, {p.parameters / 1e6:.1f}M parameters, global batch {p.batch_size} "
      f"({p.tokens_per_step} tokens), mesh {p.mesh}, microbatches {p.microbatches}, remat {p.remat}, "
      f"{'scanned' if p.scan_layers else 'unrolled'} layers",
  ]


def report_lines(p: Plan) -> list:
  m = p.memory
  notes = [f"× {p.microbatches} microbatches: XLA counts a loop body once"] if p.microbatches > 1 else []
  if p.scan_layers:
    notes.append("scanned layers: extrapolated from unrolled compiles of 1 and 2 layers")
  loops = f" ({'; '.join(notes)})" if notes else ""
  times = p.step_seconds()
  bound = max(times, key=times.get)  # collectives overlapped with compute and HBM traffic
  serial = max(times["compute"], times["HBM"]) + times["communication"]  # collectives not overlapped
  headroom = 1 - p.hbm_total / p.hbm_limit
  lines = [
      f"compiled in {p.compile_seconds:.0f} s",
      f"HBM per device: arguments {m['arguments'] / GIB:.2f} GiB, outputs {m['outputs'] / GIB:.2f} GiB, "
      f"aliased {m['aliased'] / GIB:.2f} GiB, temporaries {m['temporaries'] / GIB:.2f} GiB; "
      f"total {p.hbm_total / GIB:.2f} GiB of {p.hbm_limit / GIB:.2f} GiB ({headroom:.0%} headroom)",
      f"compiled FLOPs per device per step: {p.compiled_flops:.3e}{loops}; includes any remat recomputation",
      f"HBM bytes accessed per device per step: {p.bytes_accessed:.3e}{loops}",
      f"model FLOPs per step: {p.model_flops:.3e} = {p.model_flops / p.devices:.3e} per device = "
      f"{p.model_flops / p.tokens_per_step:.3e} per token (matmuls of the forward and backward pass, counted "
      f"in the program without remat)",
      collectives_line(p, times["communication"]),
      f"estimate (roofline; compute, HBM traffic and collectives fully overlapped): compute {times['compute']:.3g} s, "
      f"HBM {times['HBM']:.3g} s, communication {times['communication']:.3g} s per step -> {bound}-bound, "
      f"step >= {times[bound]:.3g} s, MFU <= {p.mfu(times[bound]):.1%}",
      f"estimate if collectives do not overlap (step >= max(compute, HBM) + communication): "
      f"step >= {serial:.3g} s, MFU <= {p.mfu(serial):.1%}",
  ]
  if headroom < HEADROOM_WARNING:
    lines.append(f"warning: less than {HEADROOM_WARNING:.0%} of HBM left; prefer more remat, microbatches or fsdp")
  return lines


def collectives_line(p: Plan, seconds: float) -> str:
  c = p.collectives
  by_kind = ", ".join(f"{kind} {sent:.3e}" for kind, sent in c.bytes_by_kind.items()) or "none"
  notes = ["ring algorithms", "loop bodies × their trip counts"]
  if c.loops_of_unknown_length:
    notes.append(f"{c.loops_of_unknown_length} loop(s) of unrecognised trip count counted once, so at least this")
  if p.num_slices > 1:
    notes.append("collectives across slices go over DCN, slower than ICI, yet are timed at ICI bandwidth")
  return (f"collectives: bytes sent per device per step: {by_kind}; total {c.total:.3e} ({'; '.join(notes)}) "
          f"-> {seconds:.3g} s at {p.ici_bandwidth / 1e9:.0f} GB/s ICI per device (all its chip's links busy; "
          f"latency ignored)")


def plan(arguments: dict, topology: str, num_slices: int, show=print) -> Plan:
  """Builds and compiles the run's step for the topology; `show` gets the setup lines before compiling."""
  import jax
  from jax.experimental import topologies

  from pretrain import partitioning, steps, trainer
  generation, chips = parse_topology(topology)
  extra = {"num_slices": num_slices} if num_slices > 1 else {}
  devices = topologies.get_topology_desc(topology_name=topology, platform="tpu", **extra).devices
  mesh = partitioning.make_mesh(arguments["mesh_shape"], devices=devices, num_slices=num_slices)
  family = trainer.fitted_family(arguments["family"], arguments["mixture_or_task_name"],
                                 arguments["task_feature_lengths"])
  setup = steps.make_setup(family, arguments["task_feature_lengths"], arguments["batch_size"], mesh,
                           arguments["optimizer"], arguments["schedule"], arguments["microbatches"],
                           arguments["microbatch_rows_per_group"])
  p = Plan(topology=topology, num_slices=num_slices, devices=len(devices), device_kind=devices[0].device_kind,
           chip=CHIPS[generation], devices_per_chip=len(devices) / (chips * num_slices),
           family=setup.family.name, parameters=sum(x.size for x in jax.tree.leaves(setup.abstract_state().params)),
           batch_size=arguments["batch_size"], mesh={k: v for k, v in mesh.shape.items() if v > 1} or {"data": 1},
           microbatches=setup.microbatches, remat=setup.family.config.remat_policy,
           scan_layers=setup.family.config.scan_layers,
           tokens_per_step=steps.tokens_per_batch(arguments["batch_size"], arguments["task_feature_lengths"]))
  for line in setup_lines(p):
    show(line)
  p.model_flops = model_flops_per_step(setup)
  start = time.time()
  compiled = compile_step(setup)
  p.compile_seconds = time.time() - start
  stats = compiled.memory_analysis()
  p.memory = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
              "aliased": stats.alias_size_in_bytes, "temporaries": stats.temp_size_in_bytes}
  if p.hbm_total > p.hbm_limit:  # the compiler does not always refuse (seen with scanned layers)
    raise DoesNotFit(f"the compiled step needs {p.hbm_total / GIB:.2f} GiB per device (temporaries "
                     f"{p.memory['temporaries'] / GIB:.2f} GiB), more than the {p.hbm_limit / GIB:.2f} GiB usable")
  if p.scan_layers:
    p.compiled_flops, p.bytes_accessed = unrolled_step_cost(setup, arguments)
  else:
    p.compiled_flops, p.bytes_accessed = step_cost(compiled, setup.microbatches)
  p.collectives = collective_traffic(compiled.as_text(), p.devices)  # with scanned layers, the scanned program's
  return p


def step_cost(compiled, microbatches: int) -> tuple:
  """(FLOPs, HBM bytes accessed) per device per step, from the compiler's cost analysis."""
  cost = compiled.cost_analysis()
  # The microbatch loop is a lax.scan: its body (nearly all the work) is counted once. Multiplying the
  # whole step over-counts the optimizer update by (microbatches - 1) times, well under 1%.
  return cost["flops"] * microbatches, cost["bytes accessed"] * microbatches


def unrolled_step_cost(setup, arguments: dict) -> tuple:
  """step_cost of the run with its layers unrolled, without compiling them all.

  XLA counts a scanned stack's body once, however deep the stack. The step's cost is linear in each
  stack's depth, so it is extrapolated from unrolled compiles with one layer per stack and with two
  in one stack: a few small compiles instead of the full unrolled program.
  """
  import numpy as np

  from pretrain import steps
  config = setup.family.config
  depths = {name: getattr(config, name) for name in setup.family.layer_count_fields}

  def cost(**depth_overrides) -> np.ndarray:
    small = dataclasses.replace(config, scan_layers=False, **{**dict.fromkeys(depths, 1), **depth_overrides})
    small_setup = steps.make_setup(
        dataclasses.replace(setup.family, config=small), arguments["task_feature_lengths"], arguments["batch_size"],
        setup.mesh, arguments["optimizer"], arguments["schedule"], setup.microbatches)
    return np.array(step_cost(compile_step(small_setup), setup.microbatches))

  one_layer = cost()
  total = one_layer + sum((depth - 1) * (cost(**{name: 2}) - one_layer) for name, depth in depths.items())
  return float(total[0]), float(total[1])


def _flags(rest: list) -> dict:
  flags = {"topology": DEFAULT_TOPOLOGY, "num_slices": None}
  for arg in rest:
    name, _, value = arg.partition("=")
    key = name.removeprefix("--")
    if not name.startswith("--") or key not in flags or not value:
      raise ConfigError(f"unknown argument {arg!r}; expected --gin_file=F, --gin.KEY=VALUE, --topology=vN:AxB, "
                       f"--num_slices=N")
    flags[key] = value
  if flags["num_slices"] is not None:
    if not flags["num_slices"].isdigit() or int(flags["num_slices"]) < 1:
      raise ConfigError(f"--num_slices={flags['num_slices']}: expected a positive integer")
    flags["num_slices"] = int(flags["num_slices"])
  return flags


def main(argv) -> None:
  # The plan compiles for a described topology and opens no TPU: it may run beside any other libtpu
  # user (another plan, training on this host), which libtpu's lockfile would refuse. libtpu wants to
  # know its host at load time; these values silence its warnings and do not change the topology.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  files, bindings, rest = cli.split_gin_args(argv[1:])
  flags = _flags(rest)
  if not files:
    raise ConfigError("no --gin_file given, e.g. --gin_file=gin_configs/runs/xlnet_large_v3_512.gin")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type(flags["topology"]))
  cli.parse_gin(files, bindings)
  from pretrain import trainer
  arguments = cli.bound_arguments(trainer.train, STEP_ARGUMENTS)
  num_slices = flags["num_slices"] or arguments["num_slices"]
  try:
    result = plan(arguments, flags["topology"], num_slices, show=lambda line: print(line, flush=True))
  except DoesNotFit as e:
    print(f"pretrain.plan: does not fit: {e}", file=sys.stderr)
    sys.exit(2)
  for line in report_lines(result):
    print(line)


if __name__ == "__main__":
  cli.start(sys.argv, HELP)
  cli.run("pretrain.plan", lambda: main(sys.argv))
