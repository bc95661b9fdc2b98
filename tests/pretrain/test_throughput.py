"""The speed shown while training: each device's peak FLOP/s, MFU's arithmetic, a window's figures and
the input-wait warning (no training; a clock the test turns)."""
from types import SimpleNamespace

import numpy as np
import pytest

from pretrain import roofline, throughput
from pretrain.families.bart import BartFamily
from pretrain.families.bert import BertFamily
from pretrain.families.xlnet import XLNetFamily


def device(kind, num_cores=1):
  platform = "cpu" if kind == "cpu" else "tpu" if kind.startswith("TPU") else "gpu"
  return SimpleNamespace(device_kind=kind, num_cores=num_cores, platform=platform)


@pytest.mark.parametrize("kind, num_cores, peak", [
    ("TPU v2", 1, 46e12 / 2),
    ("TPU v3", 1, 123e12 / 2),  # a v3 device is one of the chip's two TensorCores
    ("TPU v4", 2, 275e12),  # megacore: a v4 or v5p device is the whole chip
    ("TPU v4", 1, 275e12 / 2),  # ... unless split into its cores
    ("TPU v5", 2, 459e12),
    ("TPU v5p", 2, 459e12),
    ("TPU v5 lite", 1, 197e12),
    ("TPU v6 lite", 1, 918e12),
    ("NVIDIA A100-SXM4-80GB", 108, 312e12),  # a GPU's num_cores, if any, is not TensorCores
    ("NVIDIA H100 80GB HBM3", 132, 989e12),
    ("NVIDIA H100 PCIe", 114, 756e12),
    ("NVIDIA L4", 58, 121e12),
    ("NVIDIA B200", 148, 2250e12),
    ("NVIDIA GB200", 148, 2500e12),  # its B200s run at more power than an HGX B200's: their own peak
    ("Tesla V100-SXM2-16GB", 80, 125e12),
])
def test_peak_flops_per_device(kind, num_cores, peak):
  assert roofline.peak_flops_per_device(device(kind, num_cores)) == pytest.approx(peak)


@pytest.mark.parametrize("kind", ["cpu", "TPU v4 lite", "NVIDIA L40S", "NVIDIA A10G", "TPU v99"])
def test_an_unknown_device_has_no_peak(kind):
  assert roofline.peak_flops_per_device(device(kind)) is None


def test_mfu_is_model_flops_over_the_devices_peak():
  # 8 v3 cores for 2 s could do 8 × 61.5e12 × 2 = 984e12 FLOPs; the model needed half of that.
  assert throughput.mfu(492e12, 2.0, 8, 61.5e12) == pytest.approx(0.5)


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def eight_devices(monkeypatch, kind, model_flops_per_step, family=None):
  """A Throughput of `family` over 8 devices of `kind` from step 10, batch 32 × 128 tokens, on a clock the
  test turns."""
  clock = Clock()
  monkeypatch.setattr(throughput.time, "perf_counter", clock)
  monkeypatch.setattr(roofline, "model_flops_per_step", model_flops_per_step)
  mesh = SimpleNamespace(size=8, devices=np.array([device(kind)] * 8))
  setup = SimpleNamespace(mesh=mesh, family=family or BertFamily())
  return throughput.Throughput(setup, batch_size=32, tokens_per_step=4096, start_step=10), clock


def test_a_window_gives_step_time_rates_mfu_and_input_wait(monkeypatch):
  meter, clock = eight_devices(monkeypatch, "TPU v3", lambda setup: 246e12)
  for _ in range(4):  # steps 11-14, 0.5 s each, 0.05 s of it getting the batch
    with meter.waiting_for_input():
      clock.now += 0.05
    clock.now += 0.45
  speed = meter.window(14)
  assert speed == pytest.approx({"step_time": 0.5, "examples_per_second": 64, "tokens_per_second": 8192,
                                 "input_wait": 0.1, "mfu": 246e12 / (0.5 * 8 * 61.5e12)})
  clock.now += 3.0  # steps 15 and 16: the next window starts where this one ended
  speed = meter.window(16)
  assert speed["step_time"] == pytest.approx(1.5) and speed["input_wait"] == 0


def test_no_mfu_where_the_peak_is_unknown(monkeypatch):
  meter, clock = eight_devices(monkeypatch, "cpu", lambda setup: pytest.fail("FLOPs counted with no peak"))
  clock.now += 1.0
  speed = meter.window(11)
  assert "mfu" not in speed and speed["step_time"] == pytest.approx(1.0)


WAITS = [(100, 0.01), (200, 0.2), (300, 0.3), (400, 0.02), (500, 0.08)]  # (step, share of the time waiting)


@pytest.mark.parametrize("kind", ["TPU v4", "NVIDIA H100 80GB HBM3"])
def test_the_input_warning_comes_once_while_the_wait_stays_high(monkeypatch, kind):
  meter, _ = eight_devices(monkeypatch, kind, lambda setup: 1e12)
  warnings = [meter.input_warning(step, wait) for step, wait in WAITS]
  assert [w is not None for w in warnings] == [False, True, False, False, True]
  assert "20% of the time up to step 200" in warnings[1] and "benchmarks/input_pipeline.py" in warnings[1]


def test_on_cpus_the_input_wait_is_measured_but_not_warned_of(monkeypatch):
  meter, clock = eight_devices(monkeypatch, "cpu", None)
  with meter.waiting_for_input():
    clock.now += 0.3
  clock.now += 0.7
  assert meter.window(11)["input_wait"] == pytest.approx(0.3)
  assert [meter.input_warning(step, wait) for step, wait in WAITS] == [None] * len(WAITS)


@pytest.mark.parametrize("family, advice, not_advice", [
    (BertFamily(), "more data shards to read in parallel (DATA_SHARDS", "TOKEN_DIR"),
    (BartFamily(), "more data shards to read in parallel (DATA_SHARDS", "TOKEN_DIR"),
    # XLNet refuses DATA_SHARDS: each host reads its rows' streams of one token file
    (XLNetFamily(), "token files (TOKEN_DIR", "more data shards"),
])
def test_the_input_warning_advises_what_the_family_can_change(monkeypatch, family, advice, not_advice):
  meter, _ = eight_devices(monkeypatch, "TPU v4", lambda setup: 1e12, family)
  warning = meter.input_warning(100, 0.07)
  assert advice in warning and not_advice not in warning, warning
