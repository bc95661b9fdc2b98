"""roofline.unrolled_figures: a deep step's figures from steps of two and three layers per stack, on made-up
figures (test_plan.py compiles real ones)."""
import dataclasses

import pytest

from pretrain.collectives import Collectives
from pretrain.roofline import StepFigures, unrolled_figures


@dataclasses.dataclass(frozen=True)
class TwoStacks:
  encoder_layers: int
  decoder_layers: int
  scan_layers: bool = True


def figures_of_depth(config) -> StepFigures:
  """Every figure is a fixed part plus a part per encoder layer and another per decoder layer."""
  e, d = config.encoder_layers, config.decoder_layers
  memory = {"arguments": 10 + e + 2 * d, "outputs": 10 + e + 2 * d, "aliased": 10 + e + 2 * d,
            "temporaries": 5 + 3 * e + 4 * d}
  return StepFigures(memory, 100 + 7 * e + 9 * d, 50 + 5 * e + 6 * d, Collectives({"all-reduce": 1 + e + 2 * d}))


def test_figures_extrapolate_each_stack_to_its_depth_from_three_small_compiles():
  compiled = []

  def figures_of(config):
    assert not config.scan_layers  # costs are an unrolled step's
    compiled.append((config.encoder_layers, config.decoder_layers))
    return figures_of_depth(config)

  deep = TwoStacks(12, 6)
  figures = unrolled_figures(deep, ("encoder_layers", "decoder_layers"), figures_of)
  assert sorted(compiled) == [(2, 2), (3, 2), (3, 3)]  # both stacks deepened, then the encoder alone
  expected = figures_of_depth(deep)
  assert figures.memory == pytest.approx(expected.memory) and figures.hbm_total == pytest.approx(expected.hbm_total)
  assert (figures.flops, figures.bytes_accessed) == pytest.approx((expected.flops, expected.bytes_accessed))
  assert figures.collectives.total == pytest.approx(expected.collectives.total)


def test_stacks_of_at_most_three_layers_are_compiled_as_they_are():
  compiled = []
  figures = unrolled_figures(TwoStacks(3, 2), ("encoder_layers", "decoder_layers"),
                             lambda config: compiled.append(config) or figures_of_depth(config))
  assert compiled == [TwoStacks(3, 2, scan_layers=False)]
  assert figures == figures_of_depth(TwoStacks(3, 2))


def test_a_shallow_stack_is_compiled_at_its_depth_and_only_the_deep_one_extrapolated():
  compiled = []

  def figures_of(config):
    compiled.append((config.encoder_layers, config.decoder_layers))
    return figures_of_depth(config)

  figures = unrolled_figures(TwoStacks(12, 1), ("encoder_layers", "decoder_layers"), figures_of)
  assert sorted(compiled) == [(2, 1), (3, 1)]
  assert figures.memory == pytest.approx(figures_of_depth(TwoStacks(12, 1)).memory)


def test_a_one_layer_steps_peak_off_the_line_of_deeper_steps_does_not_set_the_estimate():
  """Peak temporaries are those of the step's biggest moment: in a 1-layer step that can be a part whose size
  depth does not change (ALBERT-xxlarge on a v5litepod-256: 2.29 GiB with 1 layer, 2.37 with 2, then 0.54 GiB
  per layer). From 1 and 2 layers, 12 would come out at 3.2 GiB instead of 7.8."""
  def figures_of(config):
    figures = figures_of_depth(config)
    layers = config.encoder_layers + config.decoder_layers
    return dataclasses.replace(figures, memory={**figures.memory, "temporaries": max(50.0, 30.0 + 6 * layers)})

  deep = TwoStacks(12, 6, scan_layers=False)
  assert unrolled_figures(deep, ("encoder_layers", "decoder_layers"), figures_of).memory["temporaries"] == (
      pytest.approx(figures_of(deep).memory["temporaries"]))


def test_stacks_of_equal_depth_are_deepened_together_as_their_peak_memory_is_not_additive():
  """Here the deeper stack's activations alone set the peak, so what one more encoder layer and one more decoder
  layer each add does not sum to what both add: BART-large on a v4-128 gained 0.45 GiB with 3+3 layers against
  2+2, and 1.97 GiB from 3+2 and 2+3 together."""
  compiled = []

  def figures_of(config):
    compiled.append((config.encoder_layers, config.decoder_layers))
    figures = figures_of_depth(config)
    peak = 5.0 + max(3 * config.encoder_layers, 4 * config.decoder_layers)
    return dataclasses.replace(figures, memory={**figures.memory, "temporaries": peak})

  deep = TwoStacks(12, 12, scan_layers=False)
  figures = unrolled_figures(deep, ("encoder_layers", "decoder_layers"), figures_of)
  assert sorted(compiled) == [(2, 2), (3, 3)]
  assert figures.memory["temporaries"] == pytest.approx(5.0 + 4 * 12)
  assert figures.flops == pytest.approx(figures_of_depth(deep).flops)


def test_what_a_layer_adds_is_never_below_zero():
  """XLA's byte count of a 2-layer TPU step can be below the 1-layer step's (BERT-Large, data 64 × model 4 on
  a v5e: 1.74e9 against 1.68e9 bytes): extrapolating that to 24 layers would give a step with no HBM traffic."""
  def figures_of(config):
    layers = config.encoder_layers + config.decoder_layers
    return dataclasses.replace(figures_of_depth(config), bytes_accessed=1000 - 10 * layers,
                               collectives=Collectives({"all-reduce": 100 - layers}))

  figures = unrolled_figures(TwoStacks(12, 6), ("encoder_layers", "decoder_layers"), figures_of)
  assert figures.flops == pytest.approx(figures_of_depth(TwoStacks(12, 6)).flops)  # each layer adds FLOPs
  shallowest = figures_of(TwoStacks(2, 2, scan_layers=False))
  assert figures.bytes_accessed == shallowest.bytes_accessed and figures.collectives.total == pytest.approx(
      shallowest.collectives.total)


def test_the_small_compiles_of_an_estimate_can_run_at_once_with_the_same_figures():
  """pretrain.plan --search maps them over `--jobs` threads (LayoutSearch.map): each of the three compiles here
  waits until all three have started, so one after another would time out."""
  import threading
  import types

  from pretrain.plan_search import LayoutSearch
  started = threading.Barrier(3, timeout=30)

  def figures_of(config):
    started.wait()
    return figures_of_depth(config)

  search = types.SimpleNamespace(jobs=3)
  at_once = unrolled_figures(TwoStacks(12, 6), ("encoder_layers", "decoder_layers"), figures_of,
                             lambda function, items: LayoutSearch.map(search, function, items))
  assert at_once == unrolled_figures(TwoStacks(12, 6), ("encoder_layers", "decoder_layers"), figures_of_depth)
