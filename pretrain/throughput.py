"""How fast a run trains, over each logging window: seconds per step, examples and tokens per second,
MFU, and the share of the time the train loop waited for its input.

MFU (model FLOPs utilisation) = the model's FLOPs per step / (step time × devices × peak FLOP/s per
device). The model's FLOPs are `roofline.model_flops_per_step` (matmuls of the forward and backward pass,
without remat's recomputation), the peak is `roofline.peak_flops_per_device`; where the peak is unknown
(CPU, an unlisted GPU) there is no MFU.
"""
import contextlib
import time
from typing import Dict, Optional

from data_pipelines import tasks
from pretrain import roofline

INPUT_WAIT_WARNING = 0.05  # above this share of the time, the input rather than the devices may set the pace
# What makes a host's input faster depends on how it reads: seqio data shards, or one pipeline over the
# row streams of a token file (XLNet), which DATA_SHARDS does not split (XLNet refuses it).
SHARDS_ADVICE = ("Give each host more data shards to read in parallel (DATA_SHARDS, a multiple of the process "
                 "count) or faster storage")
ROW_STREAMS_ADVICE = ("Each host reads its rows' streams of one token file in one pipeline (DATA_SHARDS does not "
                      "apply): put the token files (TOKEN_DIR, from python -m data_pipelines.tokenize) on faster "
                      "storage, or give each host more CPU cores (its examples are made in parallel)")


def mfu(model_flops_per_step: float, step_seconds: float, devices: int, peak_flops_per_device: float) -> float:
  return model_flops_per_step / (step_seconds * devices * peak_flops_per_device)


class Throughput:
  """Speed over the steps between two logged steps.

  A window ends when a logged step's metrics reach the host, that is once the step has finished on the
  devices: with steps dispatched ahead of the host, the time between two such moments is whole steps.
  It is wall time, evals and saves included. The input wait is this process's time in
  `waiting_for_input` (next batch, then onto the devices): the devices idle at most that long, less when
  the batch is made while a step runs. Each process measures its own; process 0's is shown.
  """

  def __init__(self, setup, batch_size: int, tokens_per_step: int, start_step: int):
    self.batch_size, self.tokens_per_step = batch_size, tokens_per_step
    self.devices = setup.mesh.size
    device = setup.mesh.devices.flat[0]
    self.peak_flops_per_device = roofline.peak_flops_per_device(device)
    # Traced once (no compile), and only where there is a peak to compare it with.
    self.model_flops_per_step = roofline.model_flops_per_step(setup) if self.peak_flops_per_device else None
    self._input_over_threshold = False
    # On a CPU the batches are made on the cores that run the steps, so a wait there idles no device: its share
    # is shown, but the warning (and its advice, for hosts that feed accelerators) is not given.
    self._warns_of_input_wait = device.platform != "cpu"
    reads_row_streams = any(tasks.OBJECTIVES[objective].stream_reading for objective in setup.family.objectives)
    self._input_advice = ROW_STREAMS_ADVICE if reads_row_streams else SHARDS_ADVICE
    self._start_window(start_step)

  def _start_window(self, step: int) -> None:
    self._window_start, self._window_first_step, self._input_seconds = time.perf_counter(), step, 0.0

  @contextlib.contextmanager
  def waiting_for_input(self):
    start = time.perf_counter()
    yield
    self._input_seconds += time.perf_counter() - start

  def window(self, step: int) -> Dict[str, float]:
    """The speed from the window's start up to `step`, whose metrics have just come back; starts the next
    window. `mfu` only where the devices' peak is known."""
    seconds, steps = time.perf_counter() - self._window_start, step - self._window_first_step
    speed = {"step_time": seconds / steps, "examples_per_second": self.batch_size * steps / seconds,
             "tokens_per_second": self.tokens_per_step * steps / seconds, "input_wait": self._input_seconds / seconds}
    if self.model_flops_per_step:
      speed["mfu"] = mfu(self.model_flops_per_step, speed["step_time"], self.devices, self.peak_flops_per_device)
    self._start_window(step)
    return speed

  def input_warning(self, step: int, input_wait: float) -> Optional[str]:
    """A line when the input wait goes over INPUT_WAIT_WARNING; none while it stays over, nor on CPUs."""
    over, was_over = input_wait > INPUT_WAIT_WARNING, self._input_over_threshold
    self._input_over_threshold = over
    if not over or was_over or not self._warns_of_input_wait:
      return None
    return (f"warning: the train loop waited for input {input_wait:.0%} of the time up to step {step} (over "
            f"{INPUT_WAIT_WARNING:.0%}): the devices may idle. {self._input_advice}; time one host's input with "
            "benchmarks/input_pipeline.py")
