"""Will a run fit on a TPU slice or on GPUs, and how fast could it be? Its training step, compiled ahead of time.

  python -m pretrain.plan --gin_file=gin_configs/runs/xlnet_large_v3_512.gin [--gin.KEY=VALUE ...] \\
      [--topology=v3:16x16] [--num_slices=N]
  python -m pretrain.plan --gin_file=RUN --topology=h100:8 [--gin.KEY=VALUE ...]
  python -m pretrain.plan --gin_file=RUN --topology=v4:4x4x4 --search [--confirm=3] [--max_minutes=M] \\
      [--write=PATH] [--jobs=N]
  (either one with [--hbm_limit_gib=X])

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

GPUs: `--topology=<gpu>:<GPUs>` or `<gpu>:<machines>x<GPUs per machine>` (a100, h100, h200; `h100:8` is one
machine of 8), with `@<Gbit/s>` for the network each GPU sends to other machines over where it is not the DGX
machines' (400 for an H100 or H200, 200 for an A100; `h100:4x8@100`), compiles the step for described NVIDIA GPUs
(pretrain.gpu_topology) with jax's CUDA plugin, `pip install -e ".[gpu-plan]"`, here or on a GPU machine; no GPU
is needed or used. Memory is checked against
the share of each GPU's memory that jax takes (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75). XLA gives no cost
analysis there: FLOPs and bytes are the program's kernels' (pretrain.hlo_costs), and a further estimate runs
the kernels one after another, each at its own roofline, as a GPU does. Nothing is autotuned without a GPU, so
the program is XLA's default one; the measured H200 steps took 1.8-2.0x that last estimate (benchmarks/README.md,
"Plans for GPUs").

`--search` chooses the layout instead (pretrain.plan_search): it explores mesh splits, microbatches,
remat and scan_layers, estimates each from small compiles, compiles the best `--confirm` (default 3,
at most 8) at full size, and the best of those once more with the GELU's other gradient (`gelu_gradient`),
and prints a ranked table and the best layout as pretrain.train flags;
`--write=PATH` writes a run file of the run and that layout, with the table in its header.
`--max_minutes` bounds the search: estimates stop at 60% of it (plus the time of the run's own layout's full-size
compile) and full-size compiles start until its end;
it then reports what it has.
The small compiles of an estimate (stacks of 2 and 3 layers) run `--jobs` at once, each on a CPU of its own
(default: up to 3, as many as there are CPUs).

The compiler's HBM use adapts to the HBM it has (roofline.HBM_CAP_OPTION): with room to spare it holds more
(earlier collectives, prefetches), so a step's HBM at the chip's limit overstates what it needs. `--hbm_limit_gib`
compiles as if each device had that much: a layout that fits in 90% of the chip's HBM still fits if a new libtpu
or a few more activations need 10% more.

Exit codes: 0 fits; 2 does not fit (the compiler's out-of-memory line on stderr; with --search, the
smallest change that would fit); 1 bad configuration.
A large model takes minutes and up to 13 GB of host RAM to compile (XLNet-Large on v3:16x16):
plan one configuration at a time.
"""
import dataclasses
import os
import shlex
import sys
import threading
import time
from typing import Optional

from pretrain import cli, gpu_topology, plan_search, roofline
from pretrain.errors import ConfigError
from pretrain.roofline import GIB, HEADROOM_WARNING, DoesNotFit, Plan, accelerator_type, model_flops_per_step

DEFAULT_TOPOLOGY = "v3:16x16"

HELP = cli.gin_help(__doc__, flags=f"""\
  --topology=vN:AxB[xC]       libtpu's name of the slice, in chips (default {DEFAULT_TOPOLOGY}, a v3-512); or
                              GPUs: h100:8 (one machine of 8 H100s), h200:4x8, a100:1, h100:4x8@100 (100 Gbit/s
                              per GPU between machines)
  --num_slices=N              slices joined over DCN (default: the run's NUM_SLICES)
  --search                    choose the layout: mesh, microbatches, remat, scan_layers
  --confirm=N                 with --search: layouts compiled at full size (default {plan_search.DEFAULT_CONFIRM}, \
at most {plan_search.MAX_CONFIRM})
  --max_minutes=M             with --search: estimate for 60% of M minutes, confirm until M, report what it has
  --write=PATH                with --search: write a run file of the run with the best layout
  --hbm_limit_gib=X           compile as if each device had X GiB of HBM (at most the chip's): does it fit with room?
  --jobs=N                    with --search: small compiles at once, a CPU each (default {plan_search.DEFAULT_JOBS} \
here: one per CPU and {plan_search.COMPILE_HOST_BYTES // 2**30} GiB of RAM, at most {plan_search.MAX_JOBS})""")


def setup_lines(p: Plan) -> list:
  capped = "" if p.hbm_cap is None else f" (--hbm_limit_gib; the chip's {p.chip_hbm / GIB:.2f})"
  if p.chip.kind == "GPU":
    machines = gpu_topology.parse(p.topology)[1]
    network = (f" in {machines} machines, {p.network_bandwidth / 1e9:.3g} GB/s between them (a network adapter per "
               "GPU)" if machines > 1 else "")
    where = (f"topology: {p.topology} = {p.devices} GPU{'s' if p.devices > 1 else ''} ({p.device_kind}){network}; "
             f"per GPU {gpu_topology.memory_note()}, ")
  else:
    where = (f"topology: {p.topology} ({accelerator_type(p.topology)}) x {p.num_slices} slice(s) = {p.devices} "
             f"devices ({p.device_kind}); per device ")
  return [
      f"{where}{p.hbm_limit / GIB:.2f} GiB HBM usable{capped}, {p.peak_flops / 1e12:.1f} TFLOP/s bf16 peak, "
      f"{p.hbm_bandwidth / 1e9:.0f} GB/s HBM, {p.ici_bandwidth / 1e9:.0f} GB/s {p.chip.interconnect}",
      f"run: {p.family}, {p.parameters / 1e6:.1f}M parameters, global batch {p.batch_size} "
      f"({p.tokens_per_step} tokens), mesh {p.mesh}, microbatches {p.microbatches}, remat {p.remat}, "
      f"{'scanned' if p.scan_layers else 'unrolled'} layers",
  ]


def report_lines(p: Plan) -> list:
  m = p.figures.memory
  # (A GPU's figures count loop bodies as often as they run: pretrain.hlo_costs.)
  tpu = p.chip.kind == "TPU"
  notes = [f"× {p.microbatches} microbatches: XLA counts a loop body once"] if p.microbatches > 1 and tpu else []
  if p.scan_layers and tpu:
    notes.append("scanned layers: extrapolated from unrolled compiles of 2 and 3 layers")
  loops = f" ({'; '.join(notes)})" if notes else ""
  times = p.step_seconds()
  bound = p.bound()  # collectives overlapped with compute and HBM traffic
  serial = max(times["compute"], times["HBM"]) + times["communication"]
  lines = [
      f"compiled in {p.compile_seconds:.0f} s",
      f"HBM per device: arguments {m['arguments'] / GIB:.2f} GiB, outputs {m['outputs'] / GIB:.2f} GiB, "
      f"aliased {m['aliased'] / GIB:.2f} GiB, temporaries {m['temporaries'] / GIB:.2f} GiB; "
      f"total {p.figures.hbm_total / GIB:.2f} GiB of {p.hbm_limit / GIB:.2f} GiB ({p.headroom:.0%} headroom)",
      f"compiled FLOPs per device per step: {p.figures.flops:.3e}{loops}; includes any remat recomputation",
      f"HBM bytes accessed per device per step: {p.figures.bytes_accessed:.3e}{loops}",
      *kernel_lines(p.figures.kernels),
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
  if p.figures.kernel_seconds:  # a GPU's
    lines.append(f"estimate with the step's kernels one after another, each at its own roofline (a GPU runs one at a "
                 f"time; --search ranks by it): step >= {p.overlapped_seconds():.3g} s with collectives overlapped, "
                 f"{p.serial_seconds():.3g} s without, MFU <= {p.mfu(p.overlapped_seconds()):.1%}")
    lines += [f"  {line}" for line in p.figures.kernel_report.splitlines()]
  if not p.roomy:
    lines.append(f"warning: less than {HEADROOM_WARNING:.0%} of HBM left; prefer more remat, microbatches or fsdp")
  return lines


def kernel_lines(k) -> list:
  """What the Pallas kernels among those figures cost, and what they said of themselves."""
  lines = []
  if k.counted:
    lines.append(f"Pallas attention: {k.counted:.0f} kernels, counted from their blocks: {k.flops:.3e} FLOPs, "
                 f"{k.bytes_accessed:.3e} bytes (their own estimates: {k.declared_flops:.3e} FLOPs, "
                 f"{k.declared_bytes:.3e} bytes; loop bodies once)")
  if k.self_reported:
    lines.append(f"warning: {k.self_reported:.0f} Pallas kernel(s) of unknown algorithm are counted at their own "
                 "estimate (or nothing where they give none)")
  return lines


def collectives_line(p: Plan, seconds: float) -> str:
  c = p.figures.collectives
  by_kind = ", ".join(f"{kind} {sent:.3e}" for kind, sent in c.bytes_by_kind.items()) or "none"
  notes = ["ring algorithms", "loop bodies × their trip counts"]
  if c.loops_of_unknown_length:
    notes.append(f"{c.loops_of_unknown_length} loop(s) of unrecognised trip count counted once, so at least this")
  speeds = f"{p.ici_bandwidth / 1e9:.0f} GB/s {p.chip.interconnect}"
  if c.between_islands:
    notes.append(f"{c.between_islands:.3e} of it in collectives between {p.chip.island}s")
    if p.chip.network_bandwidth is None:
      notes.append(f"those go over DCN, slower than {p.chip.interconnect}, yet are timed at its bandwidth")
    else:
      speeds += f", between {p.chip.island}s at {p.network_bandwidth / 1e9:.3g} GB/s (a network adapter per GPU)"
  return (f"collectives: bytes sent per device per step: {by_kind}; total {c.total:.3e} ({'; '.join(notes)}) "
          f"-> {seconds:.3g} s at {speeds} per device (all its links busy; latency ignored)")


def plan(arguments: dict, topology: str, num_slices: int, show=print, hbm_cap: Optional[float] = None) -> Plan:
  """Builds and compiles the run's step for the topology, under `hbm_cap` bytes per device where given;
  `show` gets the setup lines before compiling."""
  from pretrain import partitioning, trainer
  mesh = partitioning.make_mesh(arguments["mesh_shape"], devices=roofline.slice_devices(topology, num_slices),
                                num_slices=num_slices)
  family = trainer.fitted_family(arguments["family"], arguments["mixture_or_task_name"],
                                 arguments["task_feature_lengths"])
  setup = roofline.run_setup(arguments, family, mesh)
  p = roofline.describe(setup, arguments, topology, num_slices, hbm_cap)
  for line in setup_lines(p):
    show(line)
  p.model_flops = model_flops_per_step(setup)
  figures, p.compile_seconds = roofline.measure(setup, hbm_cap)
  if figures.hbm_total > p.hbm_limit:  # the compiler does not always refuse (seen with scanned layers)
    raise DoesNotFit(f"the compiled step needs {figures.hbm_total / GIB:.2f} GiB per device (temporaries "
                     f"{figures.memory['temporaries'] / GIB:.2f} GiB), more than the {p.hbm_limit / GIB:.2f} GiB "
                     "usable")
  # TPU: the scanned program's memory and collectives, the unrolled step's FLOPs and bytes. (A GPU's figures
  # count loop bodies as often as they run.)
  if p.scan_layers and not roofline.on_gpus(setup):
    unrolled = roofline.unrolled_figures(
        setup.family.config, setup.family.layer_count_fields,
        lambda config: roofline.measure(roofline.run_setup(
            arguments, dataclasses.replace(setup.family, config=config), mesh, setup.microbatches), hbm_cap)[0])
    figures = dataclasses.replace(figures, flops=unrolled.flops, bytes_accessed=unrolled.bytes_accessed,
                                  kernels=unrolled.kernels)
  p.figures = figures
  return p


def _flags(rest: list) -> dict:
  flags = {"topology": DEFAULT_TOPOLOGY, "num_slices": None, "search": False, "confirm": None, "max_minutes": None,
           "write": None, "jobs": None, "hbm_limit_gib": None}
  for arg in rest:
    name, has_value, value = arg.partition("=")
    key = name.removeprefix("--")
    takes_value = key != "search"
    if not name.startswith("--") or key not in flags or takes_value != bool(has_value) or (has_value and not value):
      raise ConfigError(f"unknown argument {arg!r}; expected --gin_file=F, --gin.KEY=VALUE, --topology=vN:AxB, "
                        f"--num_slices=N, --search, --confirm=N, --max_minutes=M, --write=PATH, --jobs=N, "
                        f"--hbm_limit_gib=X")
    flags[key] = value or True
  searching = [f"--{key}" for key in ("confirm", "max_minutes", "write", "jobs") if flags[key] is not None]
  if searching and not flags["search"]:
    raise ConfigError(f"{', '.join(searching)} only with --search")
  flags["num_slices"] = _number(flags, "num_slices", int, 1)
  flags["confirm"] = _number(flags, "confirm", int, 1, plan_search.MAX_CONFIRM) or plan_search.DEFAULT_CONFIRM
  flags["max_minutes"] = _number(flags, "max_minutes", float, 0)
  flags["jobs"] = _number(flags, "jobs", int, 1, plan_search.MAX_JOBS) or plan_search.DEFAULT_JOBS
  limit = _number(flags, "hbm_limit_gib", float, 0)
  flags["hbm_cap"] = None if limit is None else limit * GIB  # bytes, as the Plan counts HBM
  return flags


def _number(flags: dict, key: str, kind, least, most=None):
  """The flag's value as a number from `least` to `most`, or None where not given."""
  if flags[key] is None:
    return None
  try:
    value = kind(flags[key])
  except ValueError:
    value = None
  if value is None or value < least or (most is not None and value > most) or (kind is float and value == least):
    bounds = f"from {least} to {most}" if most is not None else ("above" if kind is float else "at least") + f" {least}"
    raise ConfigError(f"--{key}={flags[key]}: expected a {'number' if kind is float else 'whole number'} {bounds}")
  return value


def _print_whole_lines():
  """print for the search's compile threads: print writes a line and its newline apart, so two threads'
  lines could run into each other."""
  printing = threading.Lock()

  def show(line: str) -> None:
    with printing:
      print(line, flush=True)
  return show


def described_topology_environment(topology: str) -> dict:
  """The environment in which libtpu compiles for a described topology and opens no TPU: it may then run beside
  any other libtpu user (another plan, training on this host), which libtpu's lockfile would refuse. libtpu
  wants to know its host at load time; these values silence its warnings and do not change the topology, and it
  asks no cloud metadata server (loaded after jax's CUDA plugin, it did: 30 tries a setting, 10 minutes).
  For GPUs, gpu_topology.environment()."""
  if gpu_topology.is_gpu_topology(topology):
    return gpu_topology.environment()
  return {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_WORKER_HOSTNAMES": "localhost",
          "TPU_ACCELERATOR_TYPE": accelerator_type(topology), "TPU_SKIP_MDS_QUERY": "1"}


def main(argv) -> None:
  files, bindings, rest = cli.split_gin_args(argv[1:])
  flags = _flags(rest)
  if not files:
    raise ConfigError("no --gin_file given, e.g. --gin_file=gin_configs/runs/xlnet_large_v3_512.gin")
  for name, value in described_topology_environment(flags["topology"]).items():
    os.environ.setdefault(name, value)
  cli.parse_gin(files, bindings)
  from pretrain import compilation_cache, trainer
  arguments = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
  num_slices = flags["num_slices"] or arguments["num_slices"]
  show = _print_whole_lines()
  # Not through JAX's persistent cache: an executable compiled for a described topology, with no TPU client,
  # cannot be loaded back (a second plan would warn, then compile anyway).
  with compilation_cache.used(compilation_cache.OFF, model_dir=""):
    if flags["search"]:
      search_main(arguments, flags, num_slices, files, bindings, show)
      return
    try:
      result = plan(arguments, flags["topology"], num_slices, show=show, hbm_cap=flags["hbm_cap"])
    except DoesNotFit as e:
      print(f"pretrain.plan: does not fit: {e}", file=sys.stderr)
      sys.exit(2)
  for line in report_lines(result):
    print(line)


def search_main(arguments: dict, flags: dict, num_slices: int, files: list, bindings: list, show) -> None:
  """--search: the ranked table and the best layout's flags; exit code 2 when nothing fits."""
  topology = flags["topology"]
  show(f"searching layouts of {', '.join(files)} on {topology} ({accelerator_type(topology)}) x {num_slices} slice(s)")
  result = plan_search.search(arguments, topology, num_slices, flags["confirm"], flags["max_minutes"], show,
                              flags["jobs"], flags["hbm_cap"])
  for line in plan_search.table_lines(result):
    print(line)
  if result.best is None:
    print(f"pretrain.plan: no layout fits: {result.suggestion}", file=sys.stderr)
    sys.exit(2)
  unconfirmed = "" if result.best.confirmed else " (an estimate: not compiled at full size)"
  print(f"best: {result.best.layout.label()}{unconfirmed}{plan_search.against_run_layout(result)}; train with:")
  print(f"  {plan_search.gin_flags(result, arguments)}")
  print_worth_confirming(result, arguments, flags, num_slices, files, bindings)
  gelu = result.best.layout.gelu_gradient
  if gelu:  # it may leave room for layouts the search ruled out with the run's own gradient
    print(f"the GELU by {gelu} planned faster than by the run's own gradient; layouts that did not fit may fit with "
          f"it: search again with --gin.{result.config_name}.gelu_gradient=\"'{gelu}'\"")
  if flags["write"]:
    capped = "" if flags["hbm_cap"] is None else f" --hbm_limit_gib={flags['hbm_cap'] / GIB:g}"
    header = (f"Layout chosen by `python -m pretrain.plan --search --topology={topology}{capped}` on "
              f"{time.strftime('%Y-%m-%d')} ({accelerator_type(topology)} x {num_slices} slice(s)):")
    with open(flags["write"], "w") as f:
      f.write(plan_search.run_file(result, arguments, files, bindings, header))
    print(f"wrote {flags['write']}")


def print_worth_confirming(result, arguments: dict, flags: dict, num_slices: int, files: list, bindings: list) -> None:
  """The layouts that --confirm or --max_minutes left uncompiled and that may fit and be faster than the best
  (plan_search.worth_confirming), each with the command that plans it at full size."""
  unconfirmed = plan_search.worth_confirming(result)
  if not unconfirmed:
    return
  candidates = result.candidates
  memory, pace = plan_search.memory_calibration(candidates), plan_search.step_time_calibration(candidates)
  seen = [*([f"needed at most {memory:.2f}x their estimated HBM"] if plan_search.calibrated(memory) else []),
          *([f"took at least {pace:.2f}x their estimated step time"] if plan_search.calibrated(pace) else [])]
  why = f"full compiles here {' and '.join(seen)}" if seen else "by estimate"
  print(f"{len(unconfirmed)} layout(s) not compiled at full size may fit and be faster than the best ({why}): "
        "search with a larger --confirm, or plan each:")
  given = [*(f"--gin_file={path}" for path in files),
           *(f"--gin.{key.strip()}={value.strip()}" for key, _, value in (b.partition("=") for b in bindings)),
           f"--topology={flags['topology']}", *([f"--num_slices={num_slices}"] if num_slices > 1 else []),
           *([f"--hbm_limit_gib={flags['hbm_cap'] / GIB:g}"] if flags["hbm_cap"] is not None else [])]
  for candidate in unconfirmed:
    print(f"  python -m pretrain.plan {' '.join(shlex.quote(flag) for flag in given)} "
          f"{plan_search.gin_flags(result, arguments, candidate.layout)}")


if __name__ == "__main__":
  cli.start(sys.argv, HELP)
  cli.run("pretrain.plan", lambda: main(sys.argv))
