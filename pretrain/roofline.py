"""A run's training step compiled ahead of time for a TPU topology or for GPUs, and the roofline figures it gives.

`pretrain.plan` reports one layout with these figures and `pretrain.plan_search` ranks many. The chips'
peaks live here, and so does FLOP counting, which `pretrain.throughput` also uses. A compile gives
per-device HBM, FLOPs and bytes per step (loop bodies multiplied out) and the bytes sent in collectives;
a scanned stack's FLOPs and bytes, which XLA counts once, come from small unrolled compiles extrapolated
to full depth (`unrolled_figures`). For GPUs (`pretrain.gpu_topology`) the figures come from the program's kernels
(`pretrain.hlo_costs`), loop bodies counted as often as they run.
"""
import dataclasses
import math
import re
import time
from typing import Callable, Optional

from pretrain import gpu_topology, hlo_costs
from pretrain.collectives import Collectives, collective_traffic
from pretrain.errors import ConfigError
from pretrain.kernel_costs import KernelCosts, kernel_costs

GIB = 2 ** 30
HEADROOM_WARNING = 0.10  # below this fraction of free HBM, fragmentation or a new libtpu may tip it over
# libtpu's compile option for the HBM per device that a program must fit in (MiB). The compiler's HBM use adapts
# to what it has: ALBERT-xxlarge on a v5litepod-256 (data 32 × fsdp 8, 2 microbatches) takes 9.79 GiB of 15.75,
# 7.84 GiB when capped at 8, and does not fit in 6. So a step's HBM at the chip's limit overstates what it needs,
# and the question "does it fit with room to spare" is answered by compiling it under a cap. The compiler's own
# count against the cap is not memory_analysis's sum (under 7.19 GiB that layout compiles at 7.43 in all): the
# Plan's check, every buffer within hbm_limit, decides.
HBM_CAP_OPTION = "xla_tpu_max_hbm_size_mib"


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
  kind: str = "TPU"  # or "GPU" (pretrain.gpu_topology): its devices are joined by NVLink, not ICI
  # bytes/s one device sends to other islands (GPU machines): None where not known (TPU slices' DCN), and such
  # transfers are then timed at ici_bandwidth
  network_bandwidth: Optional[float] = None

  @property
  def interconnect(self) -> str:
    return "ICI" if self.kind == "TPU" else "NVLink"

  @property
  def island(self) -> str:
    """What the devices joined by the interconnect make up: a slice's chips, a machine's GPUs."""
    return "slice" if self.kind == "TPU" else "machine"


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
# (PCIe); H200 1979 (SXM, as GH200), 1671 (NVL); L4 242; per GPU of HGX B200 (36 PFLOP/s for 8) 4500, of
# GB200 NVL72 (360 PFLOP/s for 72) 5000. V100 has no bf16 nor sparsity: fp16 Tensor 125
# (SXM2), 112 (PCIe). A pattern is a whole word of jax's device_kind ('NVIDIA H100 80GB HBM3',
# 'Tesla V100-SXM2-16GB'); the first match wins.
# AWS's A10G has no NVIDIA datasheet: left out (MFU n/a) rather than guessed.
GPUS = (
    ("A100", 312e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
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



class DoesNotFit(Exception):
  """The step needs more HBM than the device has; the message says so in one line."""


def parse_topology(name: str) -> tuple:
  """'v3:16x16' -> (the v3 Chip, 256 chips); 'h100:8' -> (an H100 as a Chip, 8 GPUs)."""
  if gpu_topology.is_gpu_topology(name):
    gpu, machines, per_machine = gpu_topology.parse(name)
    usable = gpu_topology.usable_memory_fraction() * gpu.memory_bytes
    return Chip(name.split(":")[0], 1, gpu_peak_flops(gpu.device_kind), gpu.memory_bandwidth, usable,
                (gpu.device_kind,), gpu.nvlink_bandwidth, "GPU", gpu.network_bandwidth), machines * per_machine
  match = _TOPOLOGY.fullmatch(name)
  if not match or match.group(1) not in CHIPS:
    raise ConfigError(f"--topology={name!r}: expected <generation>:<chips per axis>, e.g. v3:16x16 "
                      f"(generations {', '.join(CHIPS)}), or <gpu>:<GPUs>, e.g. h100:8 "
                      f"(GPUs {', '.join(gpu_topology.GPUS)})")
  return CHIPS[match.group(1)], math.prod(int(n) for n in match.group(2).split("x"))


def peak_flops_per_device(device) -> Optional[float]:
  """Peak bf16 FLOP/s of one JAX device, None where unknown (CPU, a GPU not in GPUS).

  A TPU device is one TensorCore of a v2 or v3 chip, or a whole v4 or v5p chip (megacore: both
  TensorCores, `num_cores` 2), as in the Plan's devices_per_chip; v5e and v6e chips have one core.
  """
  for chip in CHIPS.values():
    if device.device_kind in chip.device_kinds:
      return chip.peak_bf16_flops * getattr(device, "num_cores", 1) / chip.tensorcores
  return gpu_peak_flops(device.device_kind)


def gpu_peak_flops(device_kind: str) -> Optional[float]:
  """Dense bf16 FLOP/s of the GPU jax calls `device_kind`, None where unknown."""
  return next((peak for name, peak in GPUS if re.search(rf"\b{name}\b", device_kind)), None)


def accelerator_type(topology: str) -> str:
  """'v3:16x16' -> 'v3-512', the Cloud name of the slice; 'h100:2x8' -> 'h100-16'."""
  chip, chips = parse_topology(topology)
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

  from pretrain import steps
  unfused = {"attention_implementation": "xla"} if hasattr(setup.family.config, "attention_implementation") else {}
  config = dataclasses.replace(setup.family.config, remat_policy="none", scan_layers=False, **unfused)
  family = dataclasses.replace(setup.family, config=config)
  plain = dataclasses.replace(setup, family=family, model=family.make_model())
  model, state = plain.model, plain.abstract_state()

  def loss(params, batch, carry):
    outputs, _ = family.forward(model, params, batch, carry, rngs={}, deterministic=True)
    return family.loss_and_metrics(outputs, batch)[0]

  with steps.MODEL_TRACING:
    jaxpr = jax.make_jaxpr(jax.grad(loss))(state.params, setup.batch_shapes, state.carry).jaxpr
  return matmul_flops(jaxpr)


def compile_step(setup, hbm_cap: Optional[float] = None):
  """steps.jit_train_step(setup) compiled for abstract state and batch with the run's shardings; with
  `hbm_cap` (bytes), as if each device had that much HBM (HBM_CAP_OPTION). Safe in several threads at once;
  the caller keeps JAX's persistent cache off for a described topology (`pretrain.plan.main`)."""
  from pretrain import steps
  lowered = steps.lower_train_step(setup)  # as train() lowers it
  if on_gpus(setup):  # (XLA's GPU compiler takes no memory limit: Plan checks the step against it)
    return gpu_topology.compiled(lowered)
  options = {} if hbm_cap is None else {HBM_CAP_OPTION: str(int(hbm_cap // 2**20))}
  try:
    return lowered.compile(compiler_options=options)
  except Exception as e:  # XLA reports running out of HBM as a runtime error from compile()
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    raise DoesNotFit(next((line for line in lines if "memory" in line.lower()), lines[0])) from None


@dataclasses.dataclass(frozen=True)
class StepFigures:
  """What a compiled step says per device: HBM by use, FLOPs and HBM bytes per step, collectives."""
  memory: dict  # bytes: arguments, outputs, aliased, temporaries
  flops: float  # per step, loop bodies multiplied out
  bytes_accessed: float  # per step, likewise
  collectives: Collectives
  kernels: KernelCosts = KernelCosts()  # the Pallas kernels among the FLOPs and bytes (loop bodies once)
  # GPUs: the step's kernels one after another, each at its own roofline (pretrain.hlo_costs); 0 on TPUs, whose
  # compiler overlaps more of a step's work.
  kernel_seconds: float = 0.0
  kernel_report: str = ""  # GPUs: the costliest sources in kernel_seconds (a table; an extrapolation keeps self's)

  @property
  def hbm_total(self) -> float:
    m = self.memory
    return m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"]

  def plus(self, other: "StepFigures", times: float) -> "StepFigures":
    """self + times × other, figure by figure: steps of different depths combined linearly."""
    return self._combined(other, lambda mine, theirs: mine + times * theirs, self.kernels.plus(other.kernels, times))

  def added_by(self, deeper: "StepFigures") -> "StepFigures":
    """What a deeper step adds to this one, figure by figure, none below zero: a layer cannot make a step
    cheaper, though XLA's counts of a few layers can say so (pretrain.plan_search's docstring has figures)."""
    return self._combined(deeper, lambda shallow, deep: max(deep - shallow, 0.0), deeper.kernels.plus(self.kernels, -1))

  def _combined(self, other: "StepFigures", figure: Callable, kernels: KernelCosts) -> "StepFigures":
    """`figure(mine, theirs)` of every figure of the two steps (a collective one of them lacks counts 0)."""
    sent, other_sent = self.collectives.bytes_by_kind, other.collectives.bytes_by_kind
    collectives = Collectives({kind: figure(sent.get(kind, 0.0), other_sent.get(kind, 0.0))
                               for kind in {**sent, **other_sent}},
                              max(self.collectives.loops_of_unknown_length, other.collectives.loops_of_unknown_length),
                              figure(self.collectives.between_islands, other.collectives.between_islands))
    return StepFigures({use: figure(size, other.memory[use]) for use, size in self.memory.items()},
                       figure(self.flops, other.flops), figure(self.bytes_accessed, other.bytes_accessed),
                       collectives, kernels, figure(self.kernel_seconds, other.kernel_seconds), self.kernel_report)


def step_figures(compiled, setup) -> StepFigures:
  """The figures of a compiled step (`compile_step(setup)`); on TPU, a scanned stack's FLOPs and bytes counted
  once."""
  stats = compiled.memory_analysis()
  memory = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
            "aliased": stats.alias_size_in_bytes, "temporaries": stats.temp_size_in_bytes}
  program = compiled.as_text()
  collectives = collective_traffic(program, setup.mesh.devices.size, islands(setup.mesh))
  if on_gpus(setup):
    costs = hlo_costs.program_costs(program)
    device = setup.mesh.devices.flat[0]
    peaks = gpu_peak_flops(device.device_kind), gpu_topology.gpu_of(device.device_kind).memory_bandwidth
    return StepFigures(memory, costs.flops, costs.bytes_accessed, collectives,
                       kernel_seconds=costs.serial_seconds(*peaks),
                       kernel_report=costs.report(*peaks, top=KERNEL_REPORT_SOURCES))
  kernels = kernel_costs(program)
  flops, bytes_accessed = step_cost(compiled, setup.microbatches, kernels)
  return StepFigures(memory, flops, bytes_accessed, collectives, kernels)


KERNEL_REPORT_SOURCES = 12  # lines of a GPU plan's table of where its estimate goes


def islands(mesh) -> list:
  """The island of each of the mesh's devices, in the order of the program's device ids: a GPU's machine (its
  process), a TPU's slice."""
  gpus = _is_gpu(mesh.devices.flat[0])
  return [device.process_index if gpus else getattr(device, "slice_index", 0) for device in mesh.devices.flat]


def _is_gpu(device) -> bool:
  return device.platform in ("gpu", "cuda")


def on_gpus(setup) -> bool:
  return _is_gpu(setup.mesh.devices.flat[0])


def measure(setup, hbm_cap: Optional[float] = None) -> tuple:
  """(StepFigures, compile seconds) of the setup's step (compile_step). Raises DoesNotFit where the compiler
  refuses it."""
  start = time.time()
  compiled = compile_step(setup, hbm_cap)
  return step_figures(compiled, setup), time.time() - start


def step_cost(compiled, microbatches: int, kernels: KernelCosts) -> tuple:
  """(FLOPs, HBM bytes accessed) per device per step, from the compiler's cost analysis with the Pallas
  kernels' own estimates replaced by their counted costs."""
  cost = compiled.cost_analysis()
  flops = cost.get("flops", 0.0) - kernels.declared_flops + kernels.flops
  bytes_accessed = cost.get("bytes accessed", 0.0) - kernels.declared_bytes + kernels.bytes_accessed
  # The microbatch loop is a lax.scan: its body (nearly all the work) is counted once. Multiplying the
  # whole step over-counts the optimizer update by (microbatches - 1) times, well under 1%.
  return flops * microbatches, bytes_accessed * microbatches


# Layers per stack of an estimate's shallowest compile. One layer is no guide to what each further layer adds:
# a 1-layer step's peak HBM can sit in a part of the step whose size depth does not change (ALBERT-xxlarge on
# a v5litepod-256, data 128 × model 2: temporaries 2.29, 2.37, 2.91, 3.44 GiB with 1 to 4 layers, then 0.54 GiB
# per layer up to 7.75 GiB with 12), or exceed the 2-layer step's (BART-large on a v4-128: 2.38 GiB with 1+1
# layers, 1.53, 1.98, 2.42 and 3.29 with 2+2, 3+3, 4+4 and 6+6, 5.93 with 12+12).
SHALLOWEST_DEPTH = 2


def unrolled_figures(config, layer_count_fields, figures_of: Callable, mapper: Callable = map) -> StepFigures:
  """The figures of the step with model config `config`, its layers unrolled, without compiling them all.

  `figures_of(config)` compiles the step with another model config. The step's work is linear in each
  stack's depth, so a deep model's figures are extrapolated from a few small compiles instead of the full
  unrolled program (XLA counts a scanned stack's body once): one with SHALLOWEST_DEPTH layers per stack, and
  one with a layer more in every deeper stack, whose difference is taken as often as all of them have layers
  left. Stacks of unequal depths take another compile each for the layers that only they have left. Peak HBM
  is not additive across stacks: BART-large's 2+2 layers on a v4-128 gain 0.45 GiB of temporaries with 3+3,
  while the gains of its 3+2 and 2+3 steps add up to 1.97 GiB (extrapolated to 12+12: 21.8 GiB, against 6.50
  compiled). What a layer adds is taken as at least nothing, figure by figure. FLOPs and collectives
  extrapolate well, HBM bytes on TPU less so (pretrain.plan_search's docstring). A model of at most
  SHALLOWEST_DEPTH + 1 layers per stack is compiled as it is, which costs no more. `mapper(figures_of,
  configs)` makes the small compiles (`map`: one after another; a thread pool's map: at once).
  """
  depths = {name: getattr(config, name) for name in layer_count_fields}
  unrolled = dataclasses.replace(config, scan_layers=False)
  if max(depths.values()) <= SHALLOWEST_DEPTH + 1:
    return figures_of(unrolled)
  shallow_depths = {name: min(depth, SHALLOWEST_DEPTH) for name, depth in depths.items()}
  left = {name: depths[name] - shallow_depths[name] for name in depths if depths[name] > shallow_depths[name]}
  together = min(left.values())  # layers every deeper stack has left
  shallow = dataclasses.replace(unrolled, **shallow_depths)
  configs = [shallow, dataclasses.replace(shallow, **{name: shallow_depths[name] + 1 for name in left})]
  alone = [name for name in left if left[name] > together]
  configs += [dataclasses.replace(shallow, **{name: shallow_depths[name] + 1}) for name in alone]
  base, deeper_together, *deeper_alone = mapper(figures_of, configs)
  total = base.plus(base.added_by(deeper_together), together)
  for name, deeper in zip(alone, deeper_alone):
    total = total.plus(base.added_by(deeper), left[name] - together)
  return total


def slice_devices(topology: str, num_slices: int) -> list:
  """The JAX devices of `num_slices` slices of libtpu's `topology`, or of the GPUs a GPU topology names,
  described, not opened."""
  if gpu_topology.is_gpu_topology(topology):
    if num_slices > 1:
      raise ConfigError(f"--num_slices={num_slices}: GPU machines are not slices; give them in --topology, "
                        "e.g. h100:4x8")
    return gpu_topology.devices(topology)
  from jax.experimental import topologies
  extra = {"num_slices": num_slices} if num_slices > 1 else {}
  return topologies.get_topology_desc(topology_name=topology, platform="tpu", **extra).devices


def run_setup(arguments: dict, family, mesh, microbatches: Optional[int] = None):
  """steps.make_setup of the run (train()'s STEP_ARGUMENTS) with this family and mesh; `microbatches`,
  where given, replaces the run's MICROBATCHES or MICROBATCH_ROWS_PER_GROUP."""
  from pretrain import steps
  rows_per_group = None if microbatches else arguments["microbatch_rows_per_group"]
  return steps.make_setup(family, arguments["task_feature_lengths"], arguments["batch_size"], mesh,
                          arguments["optimizer"], arguments["schedule"], microbatches or arguments["microbatches"],
                          rows_per_group)


def describe(setup, arguments: dict, topology: str, num_slices: int, hbm_cap: Optional[float] = None) -> "Plan":
  """The Plan of a setup, before any figures: the slice, the run and its layout; `hbm_cap` as compile_step's."""
  import jax

  from pretrain import steps
  chip, chips = parse_topology(topology)
  devices = setup.mesh.devices.size
  config = setup.family.config
  plan = Plan(topology=topology, num_slices=num_slices, devices=devices,
              device_kind=setup.mesh.devices.flat[0].device_kind, chip=chip,
              devices_per_chip=devices / (chips * num_slices), family=setup.family.name,
              parameters=sum(x.size for x in jax.tree.leaves(setup.abstract_state().params)),
              batch_size=arguments["batch_size"],
              mesh={k: v for k, v in setup.mesh.shape.items() if v > 1} or {"data": 1},
              microbatches=setup.microbatches, remat=config.remat_policy, scan_layers=config.scan_layers,
              tokens_per_step=steps.tokens_per_batch(arguments["batch_size"], arguments["task_feature_lengths"]),
              hbm_cap=hbm_cap)
  if hbm_cap is not None and hbm_cap > plan.chip_hbm:
    raise ConfigError(f"--hbm_limit_gib={hbm_cap / GIB:g}: more than the {plan.chip_hbm / GIB:.2f} GiB a device of "
                      f"{topology} has")
  return plan


@dataclasses.dataclass
class Plan:
  """A layout of a run on a slice and, once compiled, its figures and roofline estimate."""
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
  scan_layers: bool  # XLA counts a scanned stack's body once: FLOPs and bytes come from unrolled_figures
  tokens_per_step: int
  compile_seconds: float = 0.0
  figures: Optional[StepFigures] = None
  model_flops: float = 0.0  # whole step, all devices
  hbm_cap: Optional[float] = None  # bytes per device the step was compiled to fit in, below the chip's own

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
  def chip_hbm(self) -> float:
    """Per device: what XLA lets a program use on this chip."""
    return self.chip.usable_hbm_bytes / self.devices_per_chip

  @property
  def hbm_limit(self) -> float:
    """Per device: the HBM the step was compiled to fit in."""
    return self.chip_hbm if self.hbm_cap is None else self.hbm_cap

  @property
  def headroom(self) -> float:
    """The fraction of hbm_limit the step leaves free (negative: it does not fit)."""
    return 1 - self.figures.hbm_total / self.hbm_limit

  @property
  def roomy(self) -> bool:
    """Leaves HEADROOM_WARNING of the chip's HBM free; a step compiled under a cap runs in what it took there."""
    return self.figures.hbm_total <= (1 - HEADROOM_WARNING) * self.chip_hbm

  @property
  def network_bandwidth(self) -> float:
    """Per device, between islands: the chip's, or its interconnect's where that is not known."""
    return self.ici_bandwidth if self.chip.network_bandwidth is None else self.chip.network_bandwidth

  def step_seconds(self) -> dict:
    """Roofline lower bounds per step: all FLOPs at peak, all HBM bytes at full bandwidth, all collective
    bytes at full ICI (or NVLink) bandwidth, and those of collectives between machines at the network's (every
    link busy; latency ignored)."""
    c = self.figures.collectives
    return {"compute": self.figures.flops / self.peak_flops, "HBM": self.figures.bytes_accessed / self.hbm_bandwidth,
            "communication": (c.total - c.between_islands) / self.ici_bandwidth
                             + c.between_islands / self.network_bandwidth}

  def bound(self) -> str:
    """What sets the overlapped estimate: 'compute', 'HBM' or 'communication'."""
    times = self.step_seconds()
    return max(times, key=times.get)

  def overlapped_seconds(self) -> float:
    """The step's bound with its work and its collectives fully overlapped: on TPUs the roofline of all its
    compute, HBM traffic and collectives; on GPUs, which run one kernel at a time, its kernels one after another,
    each at its own roofline, or its collectives, whichever take longer."""
    times = self.step_seconds()
    return max(self.figures.kernel_seconds, times["communication"]) if self.figures.kernel_seconds else max(
        times.values())

  def serial_seconds(self) -> float:
    """The bound if collectives do not overlap: the work's bound (as overlapped_seconds) + communication."""
    times = self.step_seconds()
    return (self.figures.kernel_seconds or max(times["compute"], times["HBM"])) + times["communication"]

  def mfu(self, step_seconds: float) -> float:
    return self.model_flops / (self.devices * self.peak_flops * step_seconds)
