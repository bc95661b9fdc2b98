"""`pretrain.plan --search` on a tiny BERT and a v3-8 (v3:2x2): it ranks fitting layouts by estimated step
time, compiles what no fitting layout dominates, exits 2 with the change that would fit when nothing does,
and writes a run file that trains. One search (two compiles) serves most tests; the search's pruning is
also checked on made-up figures, without compiling."""
import contextlib
import dataclasses
import os
import re
import shlex
import types
from typing import Optional
from unittest import mock

import numpy as np
import pytest
from helpers import host_devices, logged_losses, run_module
from test_plan import NO_DROPOUT, collective_figures, figure, run_plan

from pretrain import plan_search, roofline

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

MIB = 2 ** 20
TINY = ("--gin.bert.BertConfig.vocab_size=2048", "--gin.BATCH_SIZE=16", "--gin.bert.BertConfig.num_layers=1",
        "--gin.bert.BertConfig.num_heads=1", *NO_DROPOUT)  # one head: only the meshes of fsdp are searched


def table_rows(out: str) -> list:
  """(layout, fits, overlapped seconds, figures) of each row of the ranked table."""
  rows = re.findall(r"^\d+ \| ([^|]+) \| (yes|no): [\d.]+ of [\d.]+ GiB \(-?\d+%\) \| ([\d.e+-]+) s / [\d.e+-]+ s \| "
                    r"[\d.]+% \| \d+ s \| (.+)$", out, re.MULTILINE)
  return [(layout, fits == "yes", float(seconds), figures) for layout, fits, seconds, figures in rows]


@contextlib.contextmanager
def tiny_bert_search(bindings, jobs=1):
  """A LayoutSearch on a v3-8 of the tiny demo BERT (vocabulary 2048, unless `bindings` say otherwise), in this
  process, in the environment and with the compilation cache that pretrain.plan uses."""
  import gin

  from pretrain import cli, compilation_cache, plan, trainer
  gin.clear_config()
  try:
    with (mock.patch.dict(os.environ, plan.described_topology_environment("v3:2x2")),
          compilation_cache.used(compilation_cache.OFF, model_dir="")):
      cli.parse_gin(["gin_configs/runs/bert_tiny_demo.gin"], ["bert.BertConfig.vocab_size = 2048", *bindings])
      arguments = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
      yield plan_search.LayoutSearch(arguments, "v3:2x2", 1, lambda line: None, jobs=jobs)
  finally:
    gin.clear_config()


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
  """(stdout, run file) of the tiny search, its best layout written to a run file. The run differentiates its GELU
  by autodiff, which plans a little slower than by formula here (the search's last compile)."""
  run_file = tmp_path_factory.mktemp("search") / "searched.gin"
  result = run_plan("--search", "--confirm=1", f"--write={run_file}", *TINY,
                    "--gin.bert.BertConfig.gelu_gradient='autodiff'")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout, run_file


def test_fitting_layouts_are_ranked_by_estimated_step_time(searched):
  out, _ = searched
  rows = table_rows(out)
  own = "data=8 mb=1 remat=none unrolled"  # the run file's layout: MESH_SHAPE's data=-1, one microbatch
  by_layout = {layout: (seconds, figures) for layout, _, seconds, figures in rows}
  # Two meshes, each with its scanned twin, and the best of them with the GELU's other gradient.
  fsdp = "data=4 fsdp=2 mb=1 remat=none unrolled"
  assert sorted(by_layout) == sorted([own, own.replace("unrolled", "scan"), own + " gelu=formula", fsdp,
                                      fsdp.replace("unrolled", "scan")]), out
  assert all(fits for _, fits, *_ in rows) and [row[2] for row in rows] == sorted(row[2] for row in rows), out
  # A stack of one layer: the small compile is the full step. A scanned twin shares its twin's estimate.
  assert by_layout[own][1] == "confirmed; the run's own layout", out
  assert by_layout[own.replace("unrolled", "scan")] == (by_layout[own][0], "estimate (memory as unrolled)"), out
  assert by_layout[own + " gelu=formula"][1] == "confirmed", out
  best = re.search(r"^best: (.+); train with:$", out, re.MULTILINE).group(1)
  assert best.split(",")[0] == rows[0][0] and (best == f"{own}, the run's own layout") == (rows[0][0] == own), out
  again = "search again with --gin.bert.BertConfig.gelu_gradient=\"'formula'\""
  assert (again in out) == best.startswith(own + " gelu=formula"), out
  # Each compile says what it compiles and how long it took; a layout with more of fsdp, microbatches or
  # remat than a fitting one is not compiled, except that a tiny model's step is bound by HBM traffic, which
  # fsdp divides: so fsdp 2 is compiled beside the fitting fsdp 1, found slower, and no more.
  assert re.search(r"^\[1\] data=8 mb=1 remat=none unrolled: 1 layer\(s\) \d+ s$", out, re.MULTILINE), out
  assert re.search(r"^\[2\] data=4 fsdp=2 mb=1 remat=none unrolled: 1 layer\(s\) \d+ s$", out, re.MULTILINE), out
  assert re.search(r"^\[3\] data=8 mb=1 remat=none unrolled gelu=formula: full size \d+ s$", out, re.MULTILINE), out
  assert re.search(r"48 layouts, 3 compiles in \d+ s; not compiled: 44 dominated", out), out


def test_the_written_run_file_trains_with_the_chosen_layout(searched, tmp_path, demo_paths):
  out, run_file = searched
  text = run_file.read_text()
  assert text.startswith("# Layout chosen by `python -m pretrain.plan --search") and "# 1 | " in text, text
  assert "include 'gin_configs/runs/bert_tiny_demo.gin'" in text and "\nBATCH_SIZE = 16\n" in text
  flags = re.search(r"^  (--gin\.MESH_SHAPE=.+)$", out, re.MULTILINE).group(1)
  assert re.search(r"^MESH_SHAPE = (.+)$", text, re.MULTILINE).group(1) in flags
  chosen = re.search(r"^best: ([^,;]+)", out, re.MULTILINE).group(1)
  assert ("\nbert.BertConfig.gelu_gradient = 'formula'\n" in text) == chosen.endswith(" gelu=formula"), text
  result = run_module("pretrain.train", f"--gin_file={run_file}", f"--gin.MODEL_DIR='{tmp_path}'",
                      "--gin.TRAIN_STEPS=1", "--gin.LOG_EVERY_STEPS=1", "--gin.EVAL_EVERY_STEPS=0",
                      env=host_devices(8))
  assert result.returncode == 0, result.stderr[-3000:]
  assert list(logged_losses(tmp_path)) == [1]


def test_nothing_fits_exits_2_with_the_slice_that_would_hold_the_state():
  # 1 MiB of HBM per core: no mesh holds the parameters, gradients and Adam moments.
  result = run_plan("--search", *TINY, f"--hbm_limit_gib={MIB / 2**30}")
  assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert re.fullmatch(r"pretrain\.plan: no layout fits: parameters, gradients and optimizer state alone need [\d.]+ "
                      r"GiB per device on the most sharded mesh \(.+\), more than 0\.00 GiB: a slice of \d+ devices "
                      r"would hold them", last), last
  assert "[1]" not in result.stdout, result.stdout  # memory arithmetic alone: no compile
  assert re.search(r"not compiled: 48 parameters, gradients and optimizer state alone exceed HBM", result.stdout)


class MadeUpSearch(plan_search.LayoutSearch):
  """A search of one model size's meshes (fsdp 1, 2, 4) whose estimates are made up, not compiled: HBM is
  the mesh's state plus activations that halve with each remat policy and shrink with the microbatches;
  compute time grows with each of fsdp, microbatches and remat, and HBM traffic's time is HBM_SECONDS."""
  STATE = {1: 40, 2: 25, 4: 12}  # by fsdp
  ACTIVATIONS = {"none": 80, "dots": 40, "full": 20}  # with one microbatch
  LIMIT = 100
  HBM_SECONDS = {1: 0.0, 2: 0.0, 4: 0.0}  # by fsdp

  FULL_SIZE_SHARE = 1.0  # of an estimate's HBM that the layout's full-size compile needs
  FULL_SIZE_SECONDS = 0.0  # that compile's time

  def __init__(self):  # none of a real search's run, slice or compiles
    self.discarded, self.estimated, self.compiled_at_full_size = {}, [], []
    self.estimating_ends = self.confirming_ends = float("inf")
    self.stopped_early = False

  def valid_microbatches(self, mesh):
    return [1, 2, 4]

  def hbm_limit(self, mesh):
    return self.LIMIT

  def estimate(self, layout):
    self.estimated.append(layout)
    fsdp = layout.mesh_shape["fsdp"]
    hbm = self.STATE[fsdp] + self.ACTIVATIONS[layout.remat] / layout.microbatches
    compute = 1 + fsdp / 10 + layout.microbatches / 10 + plan_search.REMAT_POLICIES.index(layout.remat) / 10
    times = {"compute": compute, "HBM": self.HBM_SECONDS[fsdp], "communication": 0.0}
    return plan_search.Candidate(layout, made_up_plan(hbm, self.LIMIT, times))

  def confirm(self, candidate, twin):
    self.compiled_at_full_size.append(candidate.layout)
    plan = made_up_plan(candidate.plan.figures.hbm_total * self.FULL_SIZE_SHARE, self.LIMIT,
                        candidate.plan.step_seconds(), compile_seconds=self.FULL_SIZE_SECONDS)
    return plan_search.Candidate(candidate.layout, plan, confirmed=True, estimate=candidate.plan)


def made_up_plan(hbm: float, limit: float, times: dict, chip_hbm: Optional[float] = None, compile_seconds=0.0):
  """A stand-in for a compiled roofline.Plan: its HBM, headroom and step times, with the Plan's own arithmetic;
  `limit` below `chip_hbm`: compiled under a cap (--hbm_limit_gib)."""
  plan = types.SimpleNamespace(figures=types.SimpleNamespace(hbm_total=hbm, kernel_seconds=0.0), hbm_limit=limit,
                               chip_hbm=chip_hbm or limit, compile_seconds=compile_seconds,
                               step_seconds=lambda: times, mfu=lambda seconds: 0.0)
  for method in ("bound", "overlapped_seconds", "serial_seconds"):
    setattr(plan, method, getattr(roofline.Plan, method).__get__(plan))
  for name in ("headroom", "roomy"):
    setattr(plan, name, getattr(roofline.Plan, name).fget(plan))
  return plan


MESHES = [(("replica", 1), ("data", 4 // fsdp), ("fsdp", fsdp), ("model", 1)) for fsdp in (1, 2, 4)]


def explored(search: MadeUpSearch, first=None) -> dict:
  """{(fsdp, microbatches, remat): fits} of the layouts the search estimated, in the order it estimated them."""
  estimates = search.explore_model_split(MESHES, {mesh: search.STATE[dict(mesh)["fsdp"]] for mesh in MESHES}, first)
  assert [c.layout for c in estimates] == search.estimated  # each estimated once
  return {(layout.mesh_shape["fsdp"], layout.microbatches, layout.remat): candidate.fits
          for layout, candidate in zip(search.estimated, estimates)}


def test_the_search_compiles_no_layout_that_a_fitting_one_dominates_or_that_cannot_fit():
  tried = explored(MadeUpSearch())
  # No remat and one microbatch: fsdp 1 is compiled and too big (40 + 80). Its 80 of temporaries could be
  # a share of its state, so fsdp 2 might need as little as 25 + 50: compiled, too big (25 + 80). The two
  # tell activations from state: fsdp 4 is predicted at 12 + 80, and fits, with 8% free: too little to
  # dominate others. Two microbatches fit on fsdp 1 (40 + 40), and so do dots with one microbatch (40 + 40).
  # These dominate every layout with at least as much fsdp, microbatches and remat: nothing else is
  # compiled, no 'full'.
  assert tried == {(1, 1, "none"): False, (2, 1, "none"): False, (4, 1, "none"): True, (1, 2, "none"): True,
                   (1, 1, "dots"): True}


def test_the_runs_own_layout_is_estimated_first_then_its_mesh_at_twice_its_microbatches():
  """The cheapest compile that tells activations from a share of the state: one-microbatch layouts, the dearest
  to compile (the most rows per core), are then predicted, not compiled, where they cannot fit."""
  own = plan_search.Layout(MESHES[1], 2, "none", False)  # fsdp 2, two microbatches: 25 + 40, with room
  tried = explored(MadeUpSearch(), first=own)
  # 25 + 40 with two microbatches and 25 + 20 with four: temporaries are activations of 80 per microbatch, so
  # one microbatch needs 40 + 80 on fsdp 1 and 25 + 80 on fsdp 2, not compiled (the first test compiles
  # both), and 12 + 80 on fsdp 4: compiled, with too little free to dominate. The walk goes on as there.
  assert list(tried.items()) == [((2, 2, "none"), True), ((2, 4, "none"), True), ((4, 1, "none"), True),
                                 ((1, 2, "none"), True), ((1, 1, "dots"), True)]
  # A run's layout that does not fit is not followed by its twin: layouts of more rows cannot fit either.
  too_big = MadeUpSearch()
  too_big.ACTIVATIONS = {"none": 160, "dots": 80, "full": 40}
  tried = explored(too_big, first=own)
  assert list(tried.items())[0] == ((2, 2, "none"), False) and (2, 4, "none") not in tried
  # A layout that is not among the split's (3 microbatches do not divide the rows) changes nothing.
  assert explored(MadeUpSearch(), first=dataclasses.replace(own, microbatches=3)) == explored(MadeUpSearch())


def test_the_runs_own_layout_compiled_at_full_size_scales_the_predictions_that_rule_layouts_out():
  """As BART-large on a v5litepod-256, whose run layout was estimated 71% over its full compile: predictions
  from such estimates would rule out layouts that fit."""
  own = plan_search.Layout(MESHES[0], 2, "none", False)  # fsdp 1, two microbatches: 40 + 45 estimated

  def searched(full_size_share):
    search = MadeUpSearch()
    search.ACTIVATIONS = {"none": 90, "dots": 45, "full": 22.5}
    search.FULL_SIZE_SHARE = full_size_share
    search.FULL_SIZE_SECONDS = 600.0
    search.estimating_ends, search.confirming_ends = 1e12, 1e12 + 1000
    tried = explored(search, first=own)
    # That compile was confirming done early: estimating ends later by its time.
    assert search.estimating_ends == 1e12 + 600
    return tried, search.compiled_at_full_size

  # Estimated as they are, the two layouts of the run's mesh make 90 of activations per microbatch: one
  # microbatch needs 25 + 90 on fsdp 2 and 12 + 90 on fsdp 4, and neither is compiled.
  tried, full_size = searched(1.0)
  assert full_size == [own] and list(tried)[:2] == [(1, 2, "none"), (1, 4, "none")]
  assert (2, 1, "none") not in tried and (4, 1, "none") not in tried
  # The run's layout compiled at 80% of its estimate: predictions are scaled alike (92 and 81.6), so both are
  # estimated, and may be confirmed (confirm_fastest scales their estimates the same way).
  tried, full_size = searched(0.8)
  assert full_size == [own] and tried[(1, 2, "none")] is True
  assert tried[(2, 1, "none")] is False and tried[(4, 1, "none")] is False  # over by estimate: 115 and 102


def test_a_layout_is_left_out_only_where_no_mix_of_activations_and_state_sized_temporaries_would_fit():
  """Pure data parallel's temporaries hold state-sized buffers (gradients in flight, the optimizer's update)
  that fsdp divides: XLNet-Large on a v3-1024 estimated 28.1 GiB at data 1024, and data 128 × fsdp 8 compiled
  at 9.8 GiB with the same rows per core. Here temporaries are 20 of activations plus 1.5× the state."""
  class StateSizedTemporaries(MadeUpSearch):
    ACTIVATIONS = {"none": 20, "dots": 10, "full": 5}

    def estimate(self, layout):
      candidate = super().estimate(layout)
      candidate.plan = made_up_plan(candidate.plan.figures.hbm_total + 1.5 * self.STATE[layout.mesh_shape["fsdp"]],
                                    self.LIMIT, candidate.plan.step_seconds())
      return candidate

  tried = explored(StateSizedTemporaries())
  # fsdp 1 needs 40 + 20 + 60; were its 80 of temporaries activations, fsdp 2 would need 105 and be left out.
  # It needs 25 + 20 + 37.5, with room: the fastest layout.
  assert tried[(1, 1, "none")] is False and tried[(2, 1, "none")] is True
  assert (4, 1, "none") not in tried  # the compute-bound row stops at its first roomy mesh
  rng = np.random.default_rng(0)
  for _ in range(1000):  # any mix: one measurement predicts no more than a layout needs, two predict it
    activations, per_state = rng.uniform(0, 100), rng.uniform(0, 3)
    needs = lambda state, microbatches: state + activations / microbatches + per_state * state
    (state, microbatches), *layouts = [(rng.uniform(1, 50), int(rng.choice([1, 2, 4, 8]))) for _ in range(3)]
    measured = [(needs(s, mb) - s, mb, s) for s, mb in layouts]
    assert plan_search.predicted_hbm(state, microbatches, measured[:1]) <= needs(state, microbatches) + 1e-9
    assert plan_search.predicted_hbm(state, microbatches, measured) == pytest.approx(needs(state, microbatches))


def test_two_estimates_tell_activations_from_the_state_share_and_rule_out_what_cannot_fit():
  search = MadeUpSearch()
  search.ACTIVATIONS = {"none": 90, "dots": 45, "full": 22.5}
  tried = explored(search)
  # fsdp 1 needs 40 + 90. fsdp 2 might need as little as 25 + 56 (were the 90 a share of the state): compiled,
  # 25 + 90. Alike temporaries are activations, so fsdp 4 would need 12 + 90: not compiled.
  assert tried[(1, 1, "none")] is False and tried[(2, 1, "none")] is False and (4, 1, "none") not in tried
  assert tried[(1, 2, "none")] is True  # 40 + 45


def test_where_hbm_traffic_bounds_a_fitting_layout_more_fsdp_is_estimated_while_it_is_faster():
  """fsdp divides the optimizer's HBM traffic: BERT-Large's step at a small batch is bound by it."""
  search = MadeUpSearch()
  search.HBM_SECONDS = {1: 3.0, 2: 2.0, 4: 2.5}  # fsdp 2 halves the optimizer's traffic; 4 pays more in gathers
  tried = explored(search)
  # One microbatch without remat: fsdp 1 and 2 are too big, fsdp 4 fits with too little free. Two
  # microbatches fit on fsdp 1, bound by HBM: fsdp 2 is estimated, faster, still bound by HBM, so fsdp 4 is
  # too: slower, so no more. dots with one microbatch fit on fsdp 1, and the same walk follows. The
  # compute-bound search above stops at the first fitting mesh of each row instead.
  assert tried == {(1, 1, "none"): False, (2, 1, "none"): False, (4, 1, "none"): True, (1, 2, "none"): True,
                   (2, 2, "none"): True, (4, 2, "none"): True, (1, 1, "dots"): True, (2, 1, "dots"): True,
                   (4, 1, "dots"): True}


def test_the_best_layout_keeps_headroom_and_ties_of_compute_bound_layouts_go_to_the_one_with_less_traffic():
  def candidate(fsdp, hbm, compute, communication, confirmed=False):
    layout = plan_search.Layout(MESHES[[1, 2, 4].index(fsdp)], 1, "none", False)
    plan = made_up_plan(hbm, 100, {"compute": compute, "HBM": 0.5, "communication": communication})
    return plan_search.Candidate(layout, plan, confirmed=confirmed)

  tight = candidate(1, 95, 1.0, 0.1)  # 5% free: an estimate's few percent could tip it over
  roomy = candidate(2, 60, 1.0, 0.3)  # as fast with collectives overlapped; slower if they are not
  slow = candidate(4, 30, 1.2, 0.1)
  ranked = sorted([slow, roomy, tight], key=plan_search.Candidate.rank_key)
  assert ranked == [tight, roomy, slow]
  assert plan_search._best(ranked) is roomy
  assert plan_search._best([tight, slow]) is slow  # any roomy layout before a tight one, even a slower one
  assert plan_search._best([tight]) is tight  # a tight fit is still better than none
  confirmed_tight = candidate(1, 95, 1.0, 0.1, confirmed=True)
  assert plan_search._best([confirmed_tight, roomy]) is confirmed_tight  # a compile beats an estimate
  # Compiled to fit in 90% of the chip's HBM (--hbm_limit_gib), a layout tight under that cap has the room.
  capped = plan_search.Candidate(tight.layout, made_up_plan(88, 90, tight.plan.step_seconds(), chip_hbm=100), True)
  assert capped.roomy and not confirmed_tight.roomy
  assert plan_search._best([capped, dataclasses.replace(roomy, confirmed=True)]) is capped
  # Overlapped bounds that differ below the table's 3 digits tie: the serial bound decides.
  barely_faster = candidate(2, 60, 0.99951, 0.3)
  less_traffic = candidate(2, 60, 1.0004, 0.1)
  assert sorted([barely_faster, less_traffic], key=plan_search.Candidate.rank_key)[0] is less_traffic


def test_the_best_line_compares_the_best_layout_with_the_runs_own():
  def candidate(fsdp, hbm, seconds):
    layout = plan_search.Layout(MESHES[[1, 2, 4].index(fsdp)], 1, "none", False)
    return plan_search.Candidate(layout, made_up_plan(hbm, 100, {"compute": seconds, "HBM": 0, "communication": 0}))

  def said(ranked, own):
    result = plan_search.SearchResult(ranked, plan_search._best(ranked), 3, {}, 3, 1.0, False, "bert.BertConfig",
                                      own.layout)
    return plan_search.against_run_layout(result)

  fast, slow, too_big = candidate(2, 60, 1.0), candidate(1, 70, 1.25), candidate(4, 120, 0.9)
  assert said([fast, slow], slow) == ", 1.25x the speed of the run's own layout (1.25 s -> 1 s)"
  assert said([fast, slow], fast) == ", the run's own layout"
  estimated_too_big = ", where the run's own layout is estimated not to fit (not compiled at full size)"
  assert said([fast, too_big], too_big) == estimated_too_big
  compiled_too_big = dataclasses.replace(too_big, confirmed=True)
  assert said([fast, compiled_too_big], compiled_too_big) == ", where the run's own layout does not fit"


def test_a_search_over_gpus_ranks_layouts_by_their_kernels_one_after_another():
  """Over two described H100s (pretrain.gpu_topology), the meshes data 2 and fsdp 2. A GPU runs one kernel at a
  time: the table's figure for a layout is the plan's kernel-by-kernel estimate of it, not the whole step's
  roofline, and the best layout is the fastest by it."""
  searched = run_plan("--search", "--confirm=2", "--topology=h100:2", *TINY)
  assert searched.returncode == 0, searched.stdout[-3000:] + searched.stderr[-3000:]
  rows = [row for row in table_rows(searched.stdout) if row[3].startswith("confirmed") and "gelu=" not in row[0]]
  assert sorted(layout for layout, *_ in rows) == ["data=2 mb=1 remat=none unrolled",
                                                  "fsdp=2 mb=1 remat=none unrolled"], searched.stdout
  assert [row[2] for row in rows] == sorted(row[2] for row in rows) and all(fits for _, fits, *_ in rows)
  for layout, _, seconds, _ in rows:
    mesh = "{'fsdp': 2}" if layout.startswith("fsdp") else "{'data': 2}"
    planned = run_plan("--topology=h100:2", f"--gin.MESH_SHAPE={mesh}", *TINY)
    kernels = re.search(r"one after another, .* step >= ([\d.e+-]+) s with collectives overlapped", planned.stdout)
    assert kernels and float(kernels.group(1)) == pytest.approx(seconds, rel=1e-2), (layout, planned.stdout)
    # Each device sends at least half of every f32 gradient. XLA's GPU program makes every collective asynchronous
    # (reduce-scatter-start, ...): under fsdp it reduce-scatters the sharded gradients, and the embedding's goes
    # through an all-to-all; the rest are all-reduced.
    sent, _, _ = collective_figures(planned.stdout)
    parameters, = figure(r"([\d.]+)M parameters", planned.stdout)
    gradients = sum(sent.get(kind, 0) for kind in ("reduce-scatter", "all-reduce", "all-to-all"))
    assert gradients >= 0.5 * 4 * parameters * 1e6 * 0.9, sent  # (parameters as printed, to 0.1M)
    assert ("reduce-scatter" in sent) == layout.startswith("fsdp"), (layout, sent)
  assert re.search(rf"^best: {re.escape(rows[0][0])}\b", searched.stdout, re.MULTILINE), searched.stdout


def test_max_minutes_stops_the_search_and_reports_what_it_has():
  result = run_plan("--search", "--max_minutes=0.0001", *TINY)  # over before the first compile
  assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
  assert re.search(r"48 layouts, 0 compiles in \d+ s \(stopped at --max_minutes\)", result.stdout), result.stdout
  last = result.stderr.strip().splitlines()[-1]
  assert last == "pretrain.plan: no layout fits: --max_minutes ran out before any layout was found to fit: allow more"


def test_an_estimates_compiles_at_once_trace_the_model_one_at_a_time(model_traces_at_once):
  """Its 2- and 3-layer compiles run in two threads, each setting up its layout and tracing its step."""
  with tiny_bert_search(["bert.BertConfig.num_layers = 4", "BATCH_SIZE = 16"], jobs=2) as search:
    mesh = (("replica", 1), ("data", 8), ("fsdp", 1), ("model", 1))
    candidate = search.estimate(plan_search.Layout(mesh, 1, "none", False))
  assert search.compiles == 2 and candidate.fits
  assert not model_traces_at_once, model_traces_at_once


def test_a_mesh_that_does_not_divide_an_array_is_refused_with_the_arrays_shape_not_the_whole_mesh():
  """jax's refusal names the whole mesh, which would make each refused mesh a reason of its own in the table."""
  with tiny_bert_search(["bert.BertConfig.vocab_size = 2047"]) as search:
    mesh = (("replica", 1), ("data", 4), ("fsdp", 1), ("model", 2))
    with pytest.raises(ValueError) as refused:
      plan_search.state_bytes_per_device(search.setup(plan_search.Layout(mesh, 1, "none", False)))
  reason = plan_search.invalid_reason(refused.value)
  assert re.fullmatch(r"an array of shape \(2047, \d+\) does not split as P\('model', .*\)", reason), reason
  # Other refusals keep their first line, shortened at a word where it is long.
  long_refusal = ValueError("bi_data pairs forward and backward rows, but " + "the batch gives 1 row " * 20 + "\nmore")
  reason = plan_search.invalid_reason(long_refusal)
  assert reason.endswith(" row ...") and len(reason) <= 160 and "more" not in reason, reason


def test_confirming_passes_over_a_scanned_twin_whose_unrolled_layout_fits_with_room_and_has_time_of_its_own():
  """Scanning saves memory, not time: where the unrolled layout fits at full size with room, the compile goes
  to the next mesh instead. Where it does not, its scanned twin is compiled. Confirming has the part of
  --max_minutes that estimating leaves."""
  def estimate(fsdp, scan, hbm):
    layout = plan_search.Layout(MESHES[[1, 2, 4].index(fsdp)], 1, "none", scan)
    return plan_search.Candidate(layout, made_up_plan(hbm, 100, {"compute": 1.0 + fsdp / 10, "HBM": 0.0,
                                                                   "communication": 0.0}))

  class Confirming(MadeUpSearch):
    FULL_SIZE_HBM = {(1, False): 70, (2, False): 98}  # as compiled: fsdp 2 unrolled has 2% free

    def confirm(self, candidate, twin):
      self.estimated.append(candidate.layout)
      key = (candidate.layout.mesh_shape["fsdp"], candidate.layout.scan_layers)
      plan = made_up_plan(self.FULL_SIZE_HBM.get(key, 60), 100, candidate.plan.step_seconds())
      return plan_search.Candidate(candidate.layout, plan, confirmed=True, estimate=candidate.plan)

  def confirmed(search):
    ranked = sorted([estimate(fsdp, scan, 60) for fsdp in (1, 2, 4) for scan in (False, True)],
                    key=plan_search.Candidate.rank_key)
    search.confirm_fastest(ranked, 3)
    compiled = [(layout.mesh_shape["fsdp"], layout.scan_layers) for layout in search.estimated]
    return compiled, [c.confirmed for c in ranked]

  assert confirmed(Confirming()) == ([(1, False), (2, False), (2, True)], [True, False, True, True, False, False])

  # --max_minutes: estimating ends first, and what is left of the time goes to confirming.
  search = Confirming()
  search.estimating_ends = 0.0  # passed
  assert confirmed(search)[0] == [(1, False), (2, False), (2, True)] and not search.stopped_early
  search = Confirming()
  search.confirming_ends = 0.0
  assert confirmed(search) == ([], [False] * 6) and search.stopped_early


def test_once_a_confirmed_layout_needs_less_than_its_estimate_a_faster_one_estimated_over_by_as_much_is_confirmed():
  """As BART-large on a v5litepod-256: its fastest layout was estimated at 18.8 GiB of 15.75 and compiled at
  11.0; the fitting layout confirmed first had been estimated 29% over. Where no estimate fits, the least is
  compiled to calibrate the rest."""
  def estimate(fsdp, microbatches, hbm, seconds):
    layout = plan_search.Layout(MESHES[[1, 2, 4].index(fsdp)], microbatches, "none", False)
    return plan_search.Candidate(layout, made_up_plan(hbm, 100, {"compute": seconds, "HBM": 0.0,
                                                                   "communication": 0.0}))

  class Confirming(MadeUpSearch):
    def __init__(self, full_size_share):
      super().__init__()
      self.full_size_share = full_size_share  # of each estimate's HBM

    def confirm(self, candidate, twin):
      self.estimated.append(candidate.layout)
      plan = made_up_plan(candidate.plan.figures.hbm_total * self.full_size_share[candidate.layout.microbatches],
                          100, candidate.plan.step_seconds())
      return plan_search.Candidate(candidate.layout, plan, confirmed=True, estimate=candidate.plan)

  def confirmed(full_size_share, estimates=((4, 2, 90, 1.2), (4, 4, 60, 1.4), (2, 1, 130, 1.0), (1, 1, 200, 0.9))):
    ranked = sorted([estimate(*figures) for figures in estimates], key=plan_search.Candidate.rank_key)
    search = Confirming(full_size_share)
    search.confirm_fastest(ranked, 2)
    best = plan_search._best(sorted(ranked, key=plan_search.Candidate.rank_key))  # as LayoutSearch.run ranks them
    return ([(layout.mesh_shape["fsdp"], layout.microbatches) for layout in search.estimated],
            best and best.layout.microbatches)

  # The fitting layout compiles at 70% of its estimate: 130 × 0.7 = 91 may fit, 200 × 0.7 = 140 cannot.
  assert confirmed({1: 0.6, 2: 0.7, 4: 1.0}) == ([(4, 2), (2, 1)], 1)
  # It compiles over its estimate (94.5, too tight to be the best): nothing estimated too big is compiled; the
  # next fitting one is.
  assert confirmed({1: 0.6, 2: 1.05, 4: 1.0}) == ([(4, 2), (4, 4)], 4)
  # The one estimated over compiles too big after all: the fitting one stays the best.
  assert confirmed({1: 0.9, 2: 0.7, 4: 1.0}) == ([(4, 2), (2, 1)], 2)
  # Every estimate too big, as that BART search begun from its run file's layout: the one that needs the least
  # HBM is compiled (at 60%: it fits), and the faster one estimated over by less than that is compiled next.
  every_one_over = ((4, 2, 110, 1.2), (2, 1, 130, 1.0), (1, 1, 200, 0.9))
  assert confirmed({1: 0.6, 2: 0.6, 4: 0.6}, every_one_over) == ([(4, 2), (2, 1)], 1)
  # Where the least compiles too big too, the next least is compiled; nothing fits in the end.
  assert confirmed({1: 1.0, 2: 1.0, 4: 1.0}, every_one_over) == ([(4, 2), (2, 1)], None)


def test_faster_layouts_left_unconfirmed_that_may_fit_are_named_with_the_command_that_plans_them(capsys):
  """As the search of BART-large on a v5litepod-256 that --confirm=2 ended: its third layout, estimated 68% over
  the HBM but faster, fitted when planned by hand. And as BERT-Large's on a v5litepod-256 found, a layout
  estimated a little faster than the best is not named where full compiles took longer than their estimates by
  more than that."""
  from pretrain import cli, plan

  def candidate(fsdp, microbatches, hbm, seconds, full_size=None, full_seconds=None, scan=False):
    layout = plan_search.Layout(MESHES[[1, 2, 4].index(fsdp)], microbatches, "none", scan)
    estimate = made_up_plan(hbm, 100, {"compute": seconds, "HBM": 0.0, "communication": 0.0})
    if full_size is None:
      return plan_search.Candidate(layout, estimate)
    compiled = made_up_plan(full_size, 100, {"compute": full_seconds, "HBM": 0.0, "communication": 0.0})
    return plan_search.Candidate(layout, compiled, True, estimate)

  best = candidate(4, 2, 100, 1.0, full_size=70, full_seconds=1.25)  # 70% of its estimate's HBM, 1.25x its time
  also_compiled = candidate(4, 4, 60, 1.2, full_size=60, full_seconds=1.5)  # 1.25x again
  over_by_as_much = candidate(2, 1, 140, 0.9)  # 140 × 0.7 = 98: may fit, and 0.9 × 1.25 < 1.25
  not_fast_enough = candidate(1, 2, 50, 1.1)  # faster by its estimate, not at 1.25x it
  too_big = candidate(1, 1, 150, 0.8)  # 105
  scanned = candidate(2, 1, 140, 0.9, scan=True)  # its unrolled twin's estimate
  result = plan_search.SearchResult(
      sorted([best, also_compiled, over_by_as_much, not_fast_enough, too_big, scanned],
             key=plan_search.Candidate.rank_key), best, 6, {}, 2, 1.0, False, "bert.BertConfig")
  assert plan_search.worth_confirming(result) == [over_by_as_much]
  # The table ranks estimates as worth_confirming weighs them: among the fitting layouts, 1.1 s at 1.25x after the
  # best's 1.25 s (by their figures alone, before it).
  assert result.candidates.index(not_fast_enough) < result.candidates.index(best)
  ranked = list(result.candidates)
  plan_search.rank_by_speed(ranked)
  assert ranked[:3] == [best, not_fast_enough, also_compiled], [c.layout.label() for c in ranked]
  row = plan_search.table_lines(dataclasses.replace(result, candidates=ranked))[2]
  assert row.endswith(" | 1.1 s / 1.1 s | 0.0% | 0 s | estimate, ranked at 1.38 s (1.25x, as full compiles here took)")
  assert plan_search.worth_confirming(dataclasses.replace(result, best=over_by_as_much)) == []  # an estimate
  # Where the full compiles took their estimates' time, the estimate faster than the best is named too.
  as_estimated = candidate(4, 2, 100, 1.25, full_size=70, full_seconds=1.25)
  as_estimated_result = dataclasses.replace(result, candidates=[as_estimated, over_by_as_much, not_fast_enough],
                                            best=as_estimated)
  assert plan_search.worth_confirming(as_estimated_result) == [over_by_as_much, not_fast_enough]
  assert not [row for row in plan_search.table_lines(as_estimated_result) if "ranked at" in row]

  flags = {"topology": "v3:2x2", "hbm_cap": 14 * roofline.GIB}
  plan.print_worth_confirming(result, {"microbatch_rows_per_group": None}, flags, 1, ["runs/a b.gin"],
                              ["BATCH_SIZE = 32"])
  said, command = capsys.readouterr().out.splitlines()
  assert said == ("1 layout(s) not compiled at full size may fit and be faster than the best (full compiles here "
                  "needed at most 0.70x their estimated HBM and took at least 1.25x their estimated step time): "
                  "search with a larger --confirm, or plan each:")
  words = shlex.split(command)
  assert words[:3] == ["python", "-m", "pretrain.plan"]
  files, bindings, rest = cli.split_gin_args(words[3:])
  assert files == ["runs/a b.gin"] and rest == ["--topology=v3:2x2", "--hbm_limit_gib=14"]
  # The search's own bindings, then the layout's, which gin applies last.
  assert bindings == ["BATCH_SIZE = 32", *over_by_as_much.layout.gin_bindings("bert.BertConfig")]


def test_a_confirmed_layout_the_compiler_refused_keeps_its_estimate_compile_time_and_mark_in_the_table():
  layout = plan_search.Layout(MESHES[0], 1, "dots", False)
  estimate = made_up_plan(9.5 * roofline.GIB, 15.75 * roofline.GIB, {"compute": 1.45, "HBM": 0.0, "communication": 0.0})
  refused = plan_search.Candidate(layout, types.SimpleNamespace(figures=None, compile_seconds=512.0), confirmed=True,
                                  estimate=estimate)
  for run_layout, mark in ((None, ""), (layout, "; the run's own layout")):
    result = plan_search.SearchResult([refused], None, 1, {}, 3, 600.0, False, "bert.BertConfig", run_layout)
    row = plan_search.table_lines(result)[1]
    assert row == (f"1 | {layout.label()} | no: the compiler refused it | - | - | 512 s | "
                   f"confirmed (estimate 9.50 GiB, 1.45 s){mark}")


def test_compiles_at_once_default_to_what_both_the_cpus_and_the_ram_hold():
  """A compile holds a CPU and up to COMPILE_HOST_BYTES of RAM: 3 at once swapped on a 2-CPU, 23 GiB machine."""
  gib = 2**30
  assert plan_search.default_jobs(cpus=2, memory_bytes=23 * gib) == 2
  assert plan_search.default_jobs(cpus=16, memory_bytes=23 * gib) == 2  # the RAM bounds it
  assert plan_search.default_jobs(cpus=16, memory_bytes=128 * gib) == plan_search.MAX_JOBS
  assert plan_search.default_jobs(cpus=1, memory_bytes=128 * gib) == 1
  assert plan_search.default_jobs(cpus=8, memory_bytes=4 * gib) == 1  # never none


@pytest.mark.parametrize("flags, said", [
    (("--search", "--jobs=4"), "--jobs=4: expected a whole number from 1 to 3"),
    (("--jobs=2",), "--jobs only with --search")])
def test_a_bad_search_flag_is_named_in_one_line(flags, said):
  result = run_plan(*flags)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == f"pretrain.plan: error: {said}"
