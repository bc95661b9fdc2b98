"""The layout search of `pretrain.plan --search`: the mesh, microbatches, remat and scan_layers that run a
model fastest on a slice, found with few compiles.

Layouts: meshes that split each slice's devices into data × fsdp × model (model dividing the heads; several
slices put `replica` across them), microbatch counts that divide every data-parallel group's rows (the rest,
e.g. odd rows under XLNet's bi_data, are what steps.make_setup refuses), remat 'none', 'dots' or 'full',
and layers unrolled or scanned. Cheapest pruning first:
1. Memory arithmetic: a mesh whose parameters, gradients and optimizer state (bytes per device under its
   shardings) exceed the usable HBM is discarded without compiling.
2. Estimates from small compiles (roofline.unrolled_figures: stacks of 2 and 3 layers, extrapolated to full
   depth). More microbatches add loop overhead and more remat recomputation, while each saves memory: a
   layout with at least as much of them and of fsdp as a fitting one is dominated and not compiled
   (LayoutSearch.explore_model_split). More fsdp adds collectives but divides the optimizer's HBM traffic,
   so beyond a fitting layout whose step HBM traffic bounds, more fsdp is estimated while it is faster.
   A layout is not compiled either where the HBM predicted from the layouts measured beside it exceeds
   the HBM (predicted_hbm: temporaries are activations, alike on meshes of one model size, and a share
   of the state that fsdp divides).
3. A scanned layout does its unrolled twin's work, so it takes the twin's estimate; its memory is known
   once it is compiled at full size.
4. The best `confirm` by estimated step time are compiled at full size, and ranked by those figures; a
   scanned layout whose unrolled twin fits with room is not among them (it saves memory, not time). Once a
   confirmed layout needs less HBM than its estimate, a faster one estimated too big by no more is among them.
5. The best of those, unrolled, is compiled once more with the GELU's other gradient (`gelu_gradient`), which
   plans better on some layouts and worse on others: a full-size compile decides (confirm_other_gelu_gradient).
The run's own layout (its MESH_SHAPE, MICROBATCHES and remat, unrolled) is estimated first where the slice can
have it, and compiled at full size: it is what the search must beat, the table marks it, and its memory prunes
from the start, with that of its mesh at twice its microbatches; how far its estimate ran over its full compile
scales the predictions that prune (explore_model_split): BART-large's run layout on a v5litepod-256 was estimated
71% over its full compile, and predictions from such estimates rule out layouts that fit.
How far estimates go: FLOPs, collectives and the state's HBM are linear in depth and extrapolate exactly. Peak
temporaries were near-additive in depth for small models (12-layer BERT-base and 12+12-layer BART-large on a v3-8,
4+4 BART-large layers on a v4-8: 3% over to 1% under from 1- and 2-layer compiles). At the run files' sizes 1-layer
steps misled (roofline.SHALLOWEST_DEPTH): estimates were 61-75% over for BART-large on a v4-128 and 51% over for
XLNet-Large on a v3-1024. From 2- and 3-layer steps (libtpu 0.0.42.1, 2026-11-28), against full compiles:
BART-large on a v4-128, data 16 × fsdp 8 and data 32 × fsdp 4 with 8 microbatches, +0.9% and +1.3% on memory, +2.7%
and -1% on step time, but on a v5litepod-256, data 32 × fsdp 8 with 4 and 8 microbatches and data 64 × fsdp 4 with
2, +29%, -8% and +71% on memory (the last ruled out a layout that fits), 0%, -17% and -3% on step time (searched
again under a 90% cap, 2026-11-29: data 4 × fsdp 64 and data 8 × fsdp 32 with 2, +43% and +75%, 0% and -1%); XLNet-Large
on a v4-128, data 16 × fsdp 8 with 16 and 8 microbatches, +0.4% and +32% on memory, +7% and +2% on step time, and
data 32 × fsdp 4 with 16, +42% and +14%; on a v5litepod-256 with 8 microbatches, data 128 × fsdp 2 +1.5% and +15%,
data 64 × fsdp 4 -35% and +5% (and a layout estimated to fit that the compiler refused); ALBERT-xxlarge on a
v5litepod-256 with 2 microbatches, data 128 × model 2 +0.3% (from 1 and 2 layers: -50%), data 256 +11% (+14%), and
data 32 × fsdp 8 -18% (-18%), step times within 0.1%. That last one's temporaries grow 0.47 GiB per layer up to 6
layers, 0.81 from 6 to 8, and reach 9.48 GiB at 12 where the line gives 7.7: the compiler schedules a deep program
differently. So the full-size compiles decide, and a layout that predicted memory rules out may fit after all (see
explore_model_split). XLA's count of HBM bytes on TPU is not linear in depth at a few layers: it includes
memory-space assignment's prefetches into VMEM, and how much a program prefetches per layer changes with its depth.
So an HBM-bound estimate can be far off: BERT-Large on a v5litepod-256, data 64 × model 4, counts 1.74e9 bytes with
1 layer, 1.68e9 with 2, 1.95e9 with 3, 2.24e9 with 4, and 9.72e9 with 24 (extrapolated from 1 and 2 layers: 0.5e9;
from 2 and 3: 7.6e9); pure data parallel, 3.24e9, 4.54e9 and 6.68e9 with 1 to 3 layers, about 2.9e10 with 24 (from
1 and 2 layers: 3.3e10; from 2 and 3: 5.2e10). The confirmed figures decide.
Nor is a full compile's HBM one figure: the compiler fills HBM it has to spare (roofline.HBM_CAP_OPTION). Those
three ALBERT-xxlarge layouts, estimated at 7.99 (data 32 × fsdp 8), 9.21 (data 128 × model 2) and 11.44 GiB (data
256), take 9.79, 9.10 and 10.27 GiB of 15.75. Compiled under caps (`--hbm_limit_gib`; libtpu 0.0.42.1, 2026-11-28), the
first fits in 8 GiB (7.84) and not in 7.19, the second not in 8.29, the third in 10.3 (9.94) and not in 9.0 (where
it recomputes: 4% more compute). So the least each needs is 7.19-7.84, 8.29-9.10 and 9.0-9.94 GiB: the estimates
are 2-11%, 1-11% and 15-27% over it, where against the uncapped compiles they were -18%, +1% and +11%. XLNet-Large
on a v4-128, data 16 × fsdp 8 with 8 microbatches, squeezes little: 14.27 GiB uncapped, 14.03 under 13.72.
"""
import concurrent.futures
import dataclasses
import math
import os
import re
import textwrap
import threading
import time
from typing import Callable, Dict, List, Optional

from pretrain import roofline
from pretrain.errors import ConfigError

REMAT_POLICIES = ("none", "dots", "full")  # each keeps fewer activations for the backward pass, recomputes more
HEAD_COUNT_FIELDS = ("num_heads", "n_head")  # model configs' attention heads: BERT, ALBERT and BART; XLNet
DEFAULT_CONFIRM = 3
MAX_CONFIRM = 8  # full-size compiles of a large model take minutes each
MAX_JOBS = 3  # the most small compiles one estimate makes (stacks of 2 and 3 layers; two of unequal depths: 3)
# Host RAM that one small compile of a large model may hold: searches on a 23 GiB machine peaked at 15.2 GB with
# 2 at once (XLNet-Large) and 23.7 GB with 3 (BART-large, which then swapped).
COMPILE_HOST_BYTES = 8 * 2**30


def default_jobs(cpus: int, memory_bytes: int) -> int:
  """Compiles at once: one per CPU, no more than the RAM holds at COMPILE_HOST_BYTES each, at most MAX_JOBS."""
  return max(1, min(MAX_JOBS, cpus, memory_bytes // COMPILE_HOST_BYTES))


DEFAULT_JOBS = default_jobs(os.cpu_count() or 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
ESTIMATING_SHARE = 0.6  # of --max_minutes: estimates stop there (and later by the time the run's own layout took to
# compile at full size, confirming done first), leaving the rest to confirm the best of them
_INDIVISIBLE = re.compile(r"spec=P\(([^)]*)\).*full shape: (\([^)]*\))", re.DOTALL)  # jax's IndivisibleError


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh: tuple  # (axis, size) for every axis of partitioning.MESH_AXES
  microbatches: int
  remat: str
  scan_layers: bool
  gelu_gradient: Optional[str] = None  # layers.GELU_GRADIENTS; None: the run's own

  @property
  def mesh_shape(self) -> dict:
    return dict(self.mesh)

  def label(self) -> str:
    layers = "scan" if self.scan_layers else "unrolled"
    gelu = f" gelu={self.gelu_gradient}" if self.gelu_gradient else ""
    return f"{_mesh_label(self.mesh)} mb={self.microbatches} remat={self.remat} {layers}{gelu}"

  def model_settings(self) -> dict:
    """The model config fields the layout sets."""
    gelu = {"gelu_gradient": self.gelu_gradient} if self.gelu_gradient else {}
    return {"remat_policy": self.remat, "scan_layers": self.scan_layers, **gelu}

  def gin_bindings(self, config_name: str) -> List[str]:
    return [f"MESH_SHAPE = {self.mesh_shape}", f"MICROBATCHES = {self.microbatches}",
            *(f"{config_name}.{name} = {value!r}" for name, value in self.model_settings().items())]


@dataclasses.dataclass
class Candidate:
  """A layout with its figures: estimated from small compiles, or confirmed by compiling it at full size."""
  layout: Layout
  plan: roofline.Plan  # figures None: the compiler refused even its small steps
  confirmed: bool = False
  estimate: Optional[roofline.Plan] = None  # of a confirmed layout: what the small compiles said
  twin_confirmed: bool = False  # a scanned estimate that holds its unrolled twin's full-size figures

  @property
  def estimated_time(self) -> bool:
    """Whether its step time is from small compiles, which step_time_calibration corrects."""
    return not (self.confirmed or self.twin_confirmed) and self.plan.figures is not None

  @property
  def fits(self) -> bool:
    return self.plan.figures is not None and self.plan.headroom >= 0

  @property
  def roomy(self) -> bool:
    """Fits with HEADROOM_WARNING of the chip's HBM free (roofline.Plan.roomy): what an estimate's few percent
    of error cannot tip over."""
    return self.fits and self.plan.roomy

  def may_fit(self, memory_scale: float) -> bool:
    """Fits, or is an estimate that would fit with its HBM scaled (memory_calibration)."""
    return self.fits or (not self.confirmed and self.plan.figures is not None
                         and self.plan.figures.hbm_total * memory_scale <= self.plan.hbm_limit)

  def seconds(self, pace: float = 1.0) -> tuple:
    """(overlapped, serial) step time; an estimated one times `pace` (step_time_calibration)."""
    scale = pace if self.estimated_time else 1.0
    return (self.plan.overlapped_seconds() * scale, self.plan.serial_seconds() * scale)

  def speed_key(self, pace: float = 1.0) -> tuple:
    """Fastest (collectives overlapped) first, then fastest if they do not overlap (which separates
    compute-bound layouts that the overlapped bound ties); unrolled before its scanned twin. Overlapped bounds
    tie where they agree to the 3 digits the table shows: ALBERT-xxlarge's compute-bound layouts on a
    v5litepod-256 differ below that, and took the first confirmations in the order of those differences,
    passing over a 3% better serial bound. Estimated times are scaled by `pace`."""
    overlapped, serial = self.seconds(pace) if self.plan.figures else (math.inf,) * 2
    return (float(f"{overlapped:.3g}"), serial, self.layout.scan_layers, not self.confirmed)

  def rank_key(self, pace: float = 1.0) -> tuple:
    """Fitting layouts first, each part by speed_key."""
    return (not self.fits, *self.speed_key(pace))


@dataclasses.dataclass
class SearchResult:
  candidates: List[Candidate]  # ranked
  best: Optional[Candidate]  # the fastest fitting layout, confirmed if any is (see _best)
  layouts: int  # how many the search considered
  discarded: Dict[str, int]  # layouts not compiled, by reason
  compiles: int
  seconds: float
  stopped_early: bool  # max_minutes ran out
  config_name: str  # how gin names the model config, e.g. bert.BertConfig
  run_layout: Optional[Layout] = None  # the run's own, where the slice can have it
  suggestion: str = ""  # when nothing fits: the smallest change that would


def config_name(config) -> str:
  """How gin files name a model config class: `<module>.<class>` (gin_configs/models import models.<module>)."""
  return f"{type(config).__module__.rsplit('.', 1)[-1]}.{type(config).__name__}"


def divisors(n: int) -> List[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def mesh_splits(devices_per_slice: int, num_slices: int, heads: int) -> List[tuple]:
  """Every data × fsdp × model split of a slice with `model` dividing the heads, least model and fsdp first."""
  return [(("replica", num_slices), ("data", devices_per_slice // (model * fsdp)), ("fsdp", fsdp), ("model", model))
          for model in divisors(devices_per_slice) if heads % model == 0
          for fsdp in divisors(devices_per_slice // model)]


def state_bytes_per_device(setup) -> float:
  """Parameters, optimizer state and carry under their shardings, plus a gradient per parameter: what a
  device holds whatever the activations. Raises ValueError where the mesh does not divide an array."""
  import jax
  state = setup.sharded_abstract_state()

  def shard_bytes(tree) -> float:
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

  return shard_bytes(state) + shard_bytes(state.params)


class LayoutSearch:
  """One search: the run, the slice, and every compile it has made (a step compiled once serves every use)."""

  def __init__(self, arguments: dict, topology: str, num_slices: int, show: Callable,
               max_minutes: Optional[float] = None, jobs: int = 1, hbm_cap: Optional[float] = None):
    from pretrain import trainer
    self.arguments, self.topology, self.num_slices, self.show = arguments, topology, num_slices, show
    budget, now = (60 * max_minutes if max_minutes else math.inf), time.time()
    # Estimating ends first, so that the full-size compiles that decide are not what the time bound cuts.
    self.estimating_ends, self.confirming_ends = now + ESTIMATING_SHARE * budget, now + budget
    self.stopped_early = False  # a deadline passed with work left
    self.devices = roofline.slice_devices(topology, num_slices)
    self.family = trainer.fitted_family(arguments["family"], arguments["mixture_or_task_name"],
                                        arguments["task_feature_lengths"])
    self.compiled: Dict[tuple, tuple] = {}  # (layout mesh, microbatches, model config) -> (figures or None, s)
    self.compiles = 0
    self.jobs = jobs  # compiles at once
    self.hbm_cap = hbm_cap  # bytes per device each step is compiled to fit in; None: the chip's
    self._counting = threading.Lock()  # compiles are numbered as they start, in whichever thread
    self.model_flops = None
    self.usable_hbm = None
    self.discarded: Dict[str, int] = {}  # layouts not compiled: how many, by reason

  def make_mesh(self, mesh_shape: dict):
    from pretrain import partitioning
    return partitioning.make_mesh(mesh_shape, devices=self.devices, num_slices=self.num_slices)

  def data_parallel_groups(self, mesh_shape: dict) -> int:
    from pretrain import partitioning
    return partitioning.data_parallel_groups(self.make_mesh(mesh_shape))

  def past(self, deadline: float) -> bool:
    """Whether the deadline has passed; if so, the search says it stopped early."""
    passed = time.time() > deadline
    self.stopped_early |= passed
    return passed

  def config(self, layout: Layout):
    return dataclasses.replace(self.family.config, **layout.model_settings())

  def setup(self, layout: Layout, config=None):
    family = dataclasses.replace(self.family, config=config or self.config(layout))
    return roofline.run_setup(self.arguments, family, self.make_mesh(layout.mesh_shape), layout.microbatches)

  def plan(self, layout: Layout, figures, compile_seconds: float) -> roofline.Plan:
    setup = self.setup(layout)
    if self.model_flops is None:  # the same for every layout: the global batch's matmuls
      self.model_flops = roofline.model_flops_per_step(setup)
    described = roofline.describe(setup, self.arguments, self.topology, self.num_slices, self.hbm_cap)
    return dataclasses.replace(described, figures=figures, compile_seconds=compile_seconds,
                               model_flops=self.model_flops)

  def figures_of(self, layout: Layout, config, what: str):
    """The figures of the layout's step with this model config, compiled once; None where XLA refuses it."""
    key = (layout.mesh, layout.microbatches, config)
    if key not in self.compiled:
      setup = self.setup(layout, config)  # before counting: make_setup may refuse the layout
      with self._counting:
        self.compiles += 1
        number = self.compiles
      self.show(f"[{number}] {layout.label()}: {what} ...")
      start = time.time()  # a refused compile's time counts too
      try:
        figures = roofline.measure(setup, self.hbm_cap)[0]
      except roofline.DoesNotFit:
        figures = None
      self.compiled[key] = (figures, time.time() - start)
      self.show(f"[{number}] {layout.label()}: {what} {self.compiled[key][1]:.0f} s")
    return self.compiled[key]

  def map(self, function: Callable, items: list) -> list:
    """`function` over `items`, `jobs` at a time (threads: a compile holds no Python lock once traced)."""
    if self.jobs == 1:
      return list(map(function, items))
    with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
      futures = [pool.submit(function, item) for item in items]
      try:
        return [future.result() for future in futures]
      except KeyboardInterrupt:
        for future in futures:
          future.cancel()
        self.show("stopping once the compiles under way end (XLA's compile cannot be interrupted)")
        raise

  def estimate(self, layout: Layout) -> Candidate:
    """The layout's figures from small unrolled compiles (roofline.unrolled_figures)."""
    seconds = []

    def small(config):
      depth = "+".join(str(getattr(config, name)) for name in self.family.layer_count_fields)
      figures, compile_seconds = self.figures_of(layout, config, f"{depth} layer(s)")
      seconds.append(compile_seconds)
      if figures is None:
        raise roofline.DoesNotFit(depth)
      return figures

    try:
      figures = roofline.unrolled_figures(self.config(layout), self.family.layer_count_fields, small, self.map)
    except roofline.DoesNotFit:
      figures = None
    return Candidate(layout, self.plan(layout, figures, sum(seconds)), confirmed=self.is_full_size(layout))

  def is_full_size(self, layout: Layout) -> bool:
    """Whether the full unrolled step was among the small compiles (stacks of at most 2 layers)."""
    return not layout.scan_layers and (layout.mesh, layout.microbatches, self.config(layout)) in self.compiled

  def confirm(self, candidate: Candidate, twin: Candidate) -> Candidate:
    """The candidate compiled at full size. A scanned step's FLOPs and bytes stay its unrolled twin's (XLA
    counts a loop body once); its memory and collectives are its own."""
    layout = candidate.layout
    figures, seconds = self.figures_of(layout, self.config(layout), "full size")
    if figures is not None and layout.scan_layers:
      figures = dataclasses.replace(figures, flops=twin.plan.figures.flops,
                                    bytes_accessed=twin.plan.figures.bytes_accessed, kernels=twin.plan.figures.kernels)
    return Candidate(layout, self.plan(layout, figures, seconds), confirmed=True, estimate=candidate.plan)

  def hbm_limit(self, mesh: tuple) -> float:
    """Usable HBM per device: the slice's, read once from the Plan of one of its layouts."""
    if self.usable_hbm is None:
      self.usable_hbm = self.plan(Layout(mesh, 1, "none", False), None, 0).hbm_limit
    return self.usable_hbm

  def valid_microbatches(self, mesh: tuple) -> List[int]:
    groups = self.data_parallel_groups(dict(mesh))
    return divisors(max(1, self.arguments["batch_size"] // groups))

  def run_layout(self) -> Optional[Layout]:
    """The layout the run's gin files set, unrolled (a scanned step takes its unrolled twin's estimate); None
    where this slice cannot have it."""
    from pretrain import partitioning, steps
    try:
      shape = partitioning.resolve_mesh_shape(self.arguments["mesh_shape"], len(self.devices))
      microbatches = steps.resolve_microbatches(self.arguments["batch_size"], self.data_parallel_groups(shape),
                                                self.arguments["microbatches"],
                                                self.arguments["microbatch_rows_per_group"])
    except (ConfigError, ValueError):
      return None
    mesh = tuple((axis, shape[axis]) for axis in partitioning.MESH_AXES)
    return Layout(mesh, microbatches, self.family.config.remat_policy, False)

  def run(self, confirm: int) -> SearchResult:
    start = time.time()
    config = self.family.config
    heads = next(getattr(config, field) for field in HEAD_COUNT_FIELDS if hasattr(config, field))
    meshes = mesh_splits(len(self.devices) // self.num_slices, self.num_slices, heads)
    can_scan = _allows(config, scan_layers=True)
    layouts_per_mesh = {mesh: len(self.valid_microbatches(mesh)) * len(REMAT_POLICIES) * (1 + can_scan)
                        for mesh in meshes}
    floors, least_floor, holding = {}, None, {}  # holding: model size -> meshes that hold the state, least fsdp first
    for mesh in meshes:
      if self.past(self.estimating_ends):
        break
      try:
        floors[mesh] = state_bytes_per_device(self.setup(Layout(mesh, 1, "none", False)))
      except (ConfigError, ValueError) as e:  # make_setup's refusal; an array the mesh does not divide
        _count(self.discarded, f"invalid ({invalid_reason(e)})", layouts_per_mesh[mesh])
        continue
      if least_floor is None or floors[mesh] < floors[least_floor]:
        least_floor = mesh
      if floors[mesh] > self.hbm_limit(mesh):
        _count(self.discarded, "parameters, gradients and optimizer state alone exceed HBM", layouts_per_mesh[mesh])
      else:
        holding.setdefault(dict(mesh)["model"], []).append(mesh)
    run_layout = self.run_layout()
    # The run's model split first, so that its layout is estimated whatever --max_minutes leaves.
    splits = sorted(holding.values(), key=lambda split: run_layout is None or run_layout.mesh not in split)
    estimates = [c for split in splits for c in self.explore_model_split(split, floors, run_layout)]
    fitting = [c for c in estimates if c.fits]
    if can_scan:
      estimates += [Candidate(dataclasses.replace(c.layout, scan_layers=True),
                              dataclasses.replace(c.plan, scan_layers=True)) for c in fitting]
    ranked = sorted(estimates, key=Candidate.rank_key)
    considered = sum(layouts_per_mesh.values())
    _count(self.discarded, "dominated by a faster fitting layout, or too big by memory arithmetic",
           considered - len(estimates) - sum(self.discarded.values()))
    self.confirm_fastest(ranked, confirm)
    unrolled = {c.layout: c for c in ranked if not c.layout.scan_layers}
    for index, candidate in enumerate(ranked):  # a scanned estimate follows its twin's confirmed figures
      twin = unrolled.get(dataclasses.replace(candidate.layout, scan_layers=False))
      if candidate.layout.scan_layers and not candidate.confirmed and twin.confirmed:
        ranked[index] = Candidate(candidate.layout, dataclasses.replace(twin.plan, scan_layers=True),
                                  twin_confirmed=True)
    rank_by_speed(ranked)
    self.confirm_other_gelu_gradient(ranked)
    rank_by_speed(ranked)
    result = SearchResult(ranked, _best(ranked), considered, self.discarded, self.compiles, time.time() - start,
                          self.stopped_early, config_name(config), run_layout)
    if result.best is None:
      result.suggestion = ("--max_minutes ran out before any layout was found to fit: allow more"
                           if result.stopped_early else self.suggestion(ranked, floors, least_floor))
    return result

  def confirm_fastest(self, ranked: List[Candidate], confirm: int) -> None:
    """Puts the full-size figures of the `confirm` fastest layouts that may fit in `ranked` (in place), counting
    those whose small compile was the full step. A layout may fit where its estimate does, or where its
    estimate scaled by memory_calibration does: memory estimates have run far over (BART-large on a
    v5litepod-256: 18.8 GiB estimated, 11.0 compiled, the fastest layout that fits), so once a confirmed layout
    shows its estimate over, a faster layout estimated over by as much is compiled before slower ones that fit.
    A scanned layout whose unrolled twin was confirmed with HEADROOM_WARNING free is passed over: scanning
    saves memory, not time, and the compile tells more on another mesh, whose estimate may be far off (XLA's
    HBM bytes do not grow linearly with depth: module docstring).
    Where no layout fits or may fit by its estimate, the estimate that needs the least HBM is compiled, and
    calibrates the rest: a search of BART-large on a v5litepod-256 begun from its run file's layout (estimated
    18.8 GiB, 11.0 compiled) found every estimate too big, and without that compile would say nothing fits."""
    confirmed, considered = 0, set()
    while confirmed < confirm:
      scale = memory_calibration(ranked)
      pending = [i for i, c in enumerate(ranked) if i not in considered and c.may_fit(scale)]
      if not pending and not any(c.confirmed and c.fits for c in ranked):
        estimated = [i for i, c in enumerate(ranked)
                     if i not in considered and not c.confirmed and c.plan.figures is not None]
        pending = [min(estimated, key=lambda i: ranked[i].plan.figures.hbm_total)] if estimated else []
      if not pending:
        return
      index = min(pending, key=lambda i: ranked[i].speed_key())
      considered.add(index)
      candidate = ranked[index]
      twin = next(c for c in ranked if c.layout == dataclasses.replace(candidate.layout, scan_layers=False))
      if candidate.layout.scan_layers and twin.confirmed and twin.roomy:
        continue
      if not candidate.confirmed:
        if self.past(self.confirming_ends):
          return
        ranked[index] = self.confirm(candidate, twin)
      confirmed += 1

  def confirm_other_gelu_gradient(self, ranked: List[Candidate]) -> None:
    """Adds to `ranked` (in place, at its end) the best confirmed unrolled layout compiled at full size with the
    GELU's other gradient (layers.GELU_GRADIENTS). Which one plans better depends on the layout, not the chip:
    by formula, BART-large on a v4-128 and XLNet-Large on a v3-512; by autodiff, XLNet-Large on a v4-128 and
    BART-large on a v5litepod-256 (benchmarks/README.md, "Which GELU gradient")."""
    from models import layers
    best = _best([c for c in ranked if not c.layout.scan_layers])
    if best is None or not best.confirmed or self.past(self.confirming_ends):
      return
    other = next(name for name in layers.GELU_GRADIENTS if name != self.family.config.gelu_gradient)
    layout = dataclasses.replace(best.layout, gelu_gradient=other)
    figures, seconds = self.figures_of(layout, self.config(layout), "full size")
    ranked.append(Candidate(layout, self.plan(layout, figures, seconds), confirmed=True))

  def explore_model_split(self, meshes: List[tuple], floors: dict, first: Optional[Layout] = None) -> List[Candidate]:
    """The fitting layouts that no other fitting one dominates, for meshes of one model size (least fsdp
    first): more fsdp, microbatches or remat each save memory and cost time, so a layout is estimated
    only where no fitting one has as little of all three. Except for fsdp where HBM traffic bounds a fitting
    layout's step (more fsdp divides the optimizer's): there the next fsdp is estimated while it fits and is
    faster than the last. A layout estimated to fit with less than
    HEADROOM_WARNING free dominates nothing: small compiles underestimate a deep step's peak HBM (BERT-Large
    on a v3-512: 3.18 GiB estimated, 4.32 GiB compiled), so the safer layouts beyond it are estimated too.
    A layout predicted from this remat's estimates (predicted_hbm) to need more HBM than there is is not
    compiled, its prediction scaled by how far the estimates ran over full compiles (memory_calibration).
    `first`, where it is one of these layouts, is estimated before the others (the run's own) and compiled at
    full size, whose memory calibrates those predictions; where it fits with microbatches, its mesh at twice as
    many is estimated next."""
    counts = self.valid_microbatches(meshes[0])
    limit = self.hbm_limit(meshes[0])
    estimates, fitting = [], []  # fitting: (mesh index, microbatches, remat index)
    measured = {remat: [] for remat in REMAT_POLICIES}  # (temporaries, microbatches, state) of the estimates

    def estimate(layout: Layout) -> Candidate:
      candidate = self.estimate(layout)
      estimates.append(candidate)
      if candidate.plan.figures is not None:
        state = floors[layout.mesh]
        measured[layout.remat].append((candidate.plan.figures.hbm_total - state, layout.microbatches, state))
      return candidate

    known = {}  # estimated before the walk
    if first is not None and first.mesh in meshes and first.remat in measured:
      # Compiled at full size once estimated: the baseline, and how far over this split's memory estimates run
      # (memory_calibration), so that predictions from them rule out only what cannot fit even so.
      # Where it fits with microbatches, its mesh at twice as many next: the cheapest compile (half the rows per
      # core) that tells its activations from its state share (predicted_hbm), so that the layouts of fewer
      # microbatches, whose compiles cost the most, are predicted rather than compiled where they cannot fit.
      twice = dataclasses.replace(first, microbatches=2 * first.microbatches)
      for layout in (first, twice) if first.microbatches > 1 else (first,):
        if layout.microbatches not in counts:
          break
        if self.past(self.estimating_ends):
          return estimates
        try:
          known[layout] = estimate(layout)
        except ConfigError:  # the walk reaches it and counts its row as invalid
          break
        if layout == first and not known[layout].confirmed and known[layout].plan.figures is not None:
          known[layout] = estimates[-1] = self.confirm(known[layout], known[layout])
          # Confirming done early: its time comes out of confirming's share of --max_minutes, not estimating's.
          self.estimating_ends = min(self.estimating_ends + known[layout].plan.compile_seconds, self.confirming_ends)
        if not known[layout].fits:
          break
    for remat_index, remat in enumerate(REMAT_POLICIES):
      for microbatches in counts:
        undominated = min((i for i, m, r in fitting if m <= microbatches and r <= remat_index), default=len(meshes))
        faster_than = None  # seconds of the last fitting layout of this row, while more fsdp may beat it
        for index, mesh in enumerate(meshes[:undominated]):
          layout = Layout(mesh, microbatches, remat, False)
          candidate = known.get(layout)
          if candidate is None:
            if predicted_hbm(floors[mesh], microbatches, measured[remat]) * memory_calibration(estimates) > limit:
              continue
            if self.past(self.estimating_ends):
              return estimates
            try:
              candidate = estimate(layout)
            except ConfigError as e:  # e.g. bi_data's row pairs split by this many microbatches, on every mesh
              _count(self.discarded, f"invalid ({invalid_reason(e)})", len(meshes))
              break
          if faster_than is not None and not (candidate.fits and candidate.plan.overlapped_seconds() < faster_than):
            break
          if candidate.roomy:
            fitting.append((index, microbatches, remat_index))
            if candidate.plan.bound() != "HBM":  # only the optimizer's traffic does more fsdp divide
              break
            faster_than = candidate.plan.overlapped_seconds()
    return estimates

  def suggestion(self, ranked: List[Candidate], floors: dict, least_floor) -> str:
    """The smallest change that would fit, from the layout that needed the least HBM."""
    devices = len(self.devices)
    if least_floor is None:
      return "no layout is valid for this slice"
    limit = self.hbm_limit(least_floor)
    if floors[least_floor] > limit:
      return (f"parameters, gradients and optimizer state alone need {floors[least_floor] / roofline.GIB:.2f} GiB "
              f"per device on the most sharded mesh ({_mesh_label(least_floor)}), more than "
              f"{limit / roofline.GIB:.2f} GiB: "
              f"a slice of {_power_of_two(devices * floors[least_floor] / limit)} devices would hold them")
    measured = [c for c in ranked if c.plan.figures is not None]
    if not measured:
      return "the compiler refuses even the smallest steps: use a larger slice or shorter sequences"
    least = min(measured, key=lambda c: c.plan.figures.hbm_total)
    layout, floor = least.layout, floors[least.layout.mesh]
    groups = self.data_parallel_groups(layout.mesh_shape)
    rows = self.arguments["batch_size"] // (groups * layout.microbatches)
    per_row = (least.plan.figures.hbm_total - floor) / rows
    rows_that_fit = int((limit - floor) // per_row)
    if rows_that_fit >= 1:
      return (f"BATCH_SIZE={rows_that_fit * groups * layout.microbatches} would fit with {layout.label()} "
              f"({rows_that_fit} rows per data-parallel group per microbatch instead of {rows})")
    return (f"{layout.label()} needs {least.plan.figures.hbm_total / roofline.GIB:.2f} GiB per device with "
            f"{rows} row(s) per microbatch: shorter sequences, or a slice of "
            f"{_power_of_two(devices * least.plan.figures.hbm_total / limit)} devices")


def predicted_hbm(state: float, microbatches: int, measured: List[tuple]) -> float:
  """The HBM per device that a layout is predicted to need, from the (temporaries, microbatches, state) of the
  estimates of the same model split and remat: its state, plus temporaries that are activations (alike on
  every such mesh, scaling with the rows per microbatch) and a share of the state (gradients in flight, the
  optimizer's update: pure data parallel holds them whole, fsdp divides them). Both parts matter: XLNet-Large
  on a v3-1024 estimated 28.1 GiB for pure data parallel with one microbatch, and data 128 × fsdp 8 compiled at
  9.8 GiB with the same rows per core. Measurements that tell the two parts apart are fitted; one alone
  cannot, so it is read as the mix that favours this layout: the least it could need."""
  points = [(max(temporaries, 0.0), 1 / measured_microbatches, measured_state)
            for temporaries, measured_microbatches, measured_state in measured]
  fit = _activations_and_state_share(points)
  if fit is None:
    return state + max((max(temporaries, 0.0) * min(state / measured_state, measured_microbatches / microbatches)
                        for temporaries, measured_microbatches, measured_state in measured), default=0.0)
  activations, share = fit
  return state + activations / microbatches + share * state


def rank_by_speed(candidates: List[Candidate]) -> None:
  """Sorts the candidates (in place) by Candidate.rank_key, with estimated step times scaled by
  step_time_calibration: where full compiles took longer than their estimates, a layout estimated a little faster
  than a confirmed one is not ranked above it."""
  pace = step_time_calibration(candidates)
  candidates.sort(key=lambda c: c.rank_key(pace))


def memory_calibration(candidates: List[Candidate]) -> float:
  """The least ratio of a confirmed unrolled layout's HBM to its estimate's, or 1 where none was over: how far
  over the estimates of this model on this slice have been seen to run."""
  return min([1.0, *(c.plan.figures.hbm_total / c.estimate.figures.hbm_total for c in _compiled_both_ways(candidates))])


def step_time_calibration(candidates: List[Candidate]) -> float:
  """The least ratio of a confirmed unrolled layout's step time (collectives overlapped) to its estimate's, or 1
  where there is none: the least that a full compile has been seen to change an estimate's time here. Small
  compiles underestimate HBM-bound steps (module docstring): BERT-Large's full compiles on a v5litepod-256 took
  1.14-1.28x their estimates' time (2026-12-03), and a layout estimated 6% faster than the best confirmed planned
  19% slower."""
  ratios = [c.plan.overlapped_seconds() / c.estimate.overlapped_seconds() for c in _compiled_both_ways(candidates)]
  return min(ratios) if ratios else 1.0


def calibrated(ratio: float) -> bool:
  """Whether a calibration ratio differs from 1 as printed (2 decimals): whether to name it."""
  return round(ratio, 2) != 1


def _compiled_both_ways(candidates: List[Candidate]) -> List[Candidate]:
  """Confirmed layouts with the figures of their estimate and of their full compile. Scanned layouts are left
  out: their estimate is their unrolled twin's."""
  return [c for c in candidates if c.confirmed and not c.layout.scan_layers and c.plan.figures is not None
          and c.estimate is not None and c.estimate.figures is not None]


def _activations_and_state_share(points: List[tuple]) -> Optional[tuple]:
  """Non-negative (a, s) fitting temporaries ≈ a × x + s × state by least squares over (temporaries, x, state)
  points; None where the points cannot tell a from s (fewer than two, or x proportional to state)."""
  xx, xs, ss = (sum(p[i] * p[j] for p in points) for i, j in ((1, 1), (1, 2), (2, 2)))
  tx, ts = (sum(p[0] * p[i] for p in points) for i in (1, 2))
  determinant = xx * ss - xs * xs
  if len(points) < 2 or determinant <= 1e-9 * xx * ss:
    return None
  a, s = (tx * ss - ts * xs) / determinant, (ts * xx - tx * xs) / determinant
  if a < 0:
    return 0.0, ts / ss
  if s < 0:
    return tx / xx, 0.0
  return a, s


def _allows(config, **changes) -> bool:
  """Whether the model config takes these settings (ALBERT shares sublayers that cannot scan)."""
  try:
    dataclasses.replace(config, **changes)
  except ValueError:
    return False
  return True


def _best(ranked: List[Candidate]) -> Optional[Candidate]:
  """The fastest confirmed fitting layout; where none is confirmed (the time ran out, or every confirmed one
  was too big), the fastest that fits by estimate. Either way one with HEADROOM_WARNING of HBM free is
  preferred: an estimate's memory can be a few percent short of the full compile's."""
  fitting = [c for c in ranked if c.fits]
  confirmed = [c for c in fitting if c.confirmed]
  return ([c for c in confirmed if c.roomy] or confirmed or [c for c in fitting if c.roomy] or fitting or [None])[0]


def _count(counts: dict, reason: str, layouts: int) -> None:
  if layouts:
    counts[reason] = counts.get(reason, 0) + layouts


def invalid_reason(error: Exception) -> str:
  """Why a layout cannot be set up, in words that are the same for every mesh it refuses: an array the mesh
  does not divide is named by its shape and partition spec (jax's message names the whole mesh)."""
  text = str(error)
  indivisible = _INDIVISIBLE.search(text)
  if indivisible:
    return f"an array of shape {indivisible.group(2)} does not split as P({indivisible.group(1)})"
  return textwrap.shorten(text.splitlines()[0], 160, placeholder=" ...")  # whole words, the table's line short


def _mesh_label(mesh: tuple) -> str:
  return " ".join(f"{axis}={size}" for axis, size in mesh if size > 1) or "data=1"


def _power_of_two(at_least: float) -> int:
  return 2 ** math.ceil(math.log2(max(at_least, 1)))


def search(arguments: dict, topology: str, num_slices: int, confirm: int = DEFAULT_CONFIRM,
           max_minutes: Optional[float] = None, show: Callable = print, jobs: int = DEFAULT_JOBS,
           hbm_cap: Optional[float] = None) -> SearchResult:
  """Searches the run's layouts on the topology, `jobs` small compiles at once, each compiled to fit in `hbm_cap`
  bytes per device where given (roofline.compile_step); `show` gets a line per compile."""
  return LayoutSearch(arguments, topology, num_slices, show, max_minutes, jobs, hbm_cap).run(confirm)


def table_lines(result: SearchResult) -> List[str]:
  """The ranked table (estimated step times ranked as step_time_calibration scales them), then how many layouts
  were not compiled and why."""
  lines = ["rank | layout | fits: HBM per core (headroom) | step >= overlapped / not | MFU <= | compile | figures"]
  pace = step_time_calibration(result.candidates)
  for rank, c in enumerate(result.candidates, 1):
    p = c.plan
    source = "confirmed" if c.confirmed else ("estimate (memory as unrolled)" if c.layout.scan_layers else "estimate")
    if c.estimate is not None and c.estimate.figures is not None:
      source += (f" (estimate {c.estimate.figures.hbm_total / roofline.GIB:.2f} GiB, "
                 f"{c.estimate.overlapped_seconds():.3g} s)")
    if c.estimated_time and calibrated(pace):
      source += f", ranked at {c.seconds(pace)[0]:.3g} s ({pace:.2f}x, as full compiles here took)"
    if c.layout == result.run_layout:
      source += "; the run's own layout"
    if p.figures is None:
      lines.append(f"{rank} | {c.layout.label()} | no: the compiler refused it | - | - | {p.compile_seconds:.0f} s | "
                   f"{source}")
      continue
    lines.append(f"{rank} | {c.layout.label()} | {'yes' if c.fits else 'no'}: {p.figures.hbm_total / roofline.GIB:.2f} "
                 f"of {p.hbm_limit / roofline.GIB:.2f} GiB ({p.headroom:.0%}) | {p.overlapped_seconds():.3g} s / "
                 f"{p.serial_seconds():.3g} s | {p.mfu(p.overlapped_seconds()):.1%} | {p.compile_seconds:.0f} s | "
                 f"{source}")
  not_compiled = "; ".join(f"{count} {reason}" for reason, count in result.discarded.items())
  stopped = " (stopped at --max_minutes)" if result.stopped_early else ""
  lines.append(f"{result.layouts} layouts, {result.compiles} compiles in {result.seconds:.0f} s{stopped}; "
               f"not compiled: {not_compiled or 'none'}")
  return lines


def against_run_layout(result: SearchResult) -> str:
  """How the best layout compares with the run's own, where the search ranked that."""
  own = next((c for c in result.candidates if c.layout == result.run_layout), None)
  if own is None or result.best is None:
    return ""
  if own is result.best:
    return ", the run's own layout"
  if not own.fits:  # an estimate's memory can be far over (module docstring): it may fit after all
    return ", where the run's own layout does not fit" if own.confirmed else (
        ", where the run's own layout is estimated not to fit (not compiled at full size)")
  best, given = result.best.plan.overlapped_seconds(), own.plan.overlapped_seconds()
  return f", {given / best:.2f}x the speed of the run's own layout ({given:.3g} s -> {best:.3g} s)"


def worth_confirming(result: SearchResult) -> List[Candidate]:
  """Unrolled layouts not compiled at full size (what --confirm or --max_minutes ran out before) that may fit and
  be faster than the best, by how this search's estimates compared with their full compiles: their memory scaled
  as memory_calibration allows, their step time as step_time_calibration. The search of BART-large on a
  v5litepod-256 left one so (its table's rank 3), compiled by hand later: 14.46 GiB of 15.75, 13% less time per
  step than the best confirmed."""
  if result.best is None or not result.best.confirmed:
    return []
  scale, pace = memory_calibration(result.candidates), step_time_calibration(result.candidates)
  return [c for c in result.candidates if not c.confirmed and not c.layout.scan_layers and c.plan.figures is not None
          and c.may_fit(scale) and c.speed_key(pace)[:2] < result.best.speed_key()[:2]]


def gin_flags(result: SearchResult, arguments: dict, layout: Optional[Layout] = None) -> str:
  """A layout (by default the best) as pretrain.train or pretrain.plan flags."""
  return " ".join(f'--gin.{key}="{value}"' for key, value in _bindings(result, arguments, layout))


def _bindings(result: SearchResult, arguments: dict, layout: Optional[Layout] = None) -> List[tuple]:
  lines = (layout or result.best.layout).gin_bindings(result.config_name)
  if arguments["microbatch_rows_per_group"] is not None:  # it would contradict MICROBATCHES
    lines.append("MICROBATCH_ROWS_PER_GROUP = None")
  return [tuple(part.strip() for part in line.split("=", 1)) for line in lines]


def run_file(result: SearchResult, arguments: dict, gin_files: List[str], bindings: List[str], header: str) -> str:
  """A run file: the searched run's gin files and command-line bindings, then the best layout, with the
  search's table in its header."""
  comments = [f"# {line}" for line in [header, *table_lines(result)]]
  includes = [f"include '{path}'" for path in gin_files]
  layout = [f"{key} = {value}" for key, value in _bindings(result, arguments)]
  return "\n".join([*comments, *includes, "", *bindings, *layout]) + "\n"
