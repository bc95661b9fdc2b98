"""PROFILE_STEPS: a jax.profiler trace of a few training steps, for TensorBoard's profile tab, and a summary
of where their device time goes (pretrain.op_profile) in the run's output.

  --gin.PROFILE_STEPS='(101, 105)'  ->  MODEL_DIR/profile/plugins/profile/<time>/<host>.xplane.pb
                                        MODEL_DIR/profile/train_step.hlo.txt (the step's compiled program)
  tensorboard --logdir=MODEL_DIR/profile   (the tab needs `pip install -e ".[profile]"`)
  python -m pretrain.op_profile TRACE.xplane.pb --hlo=MODEL_DIR/profile/train_step.hlo.txt --steps=5

Only process 0 traces. Every process runs the same program on its own devices, so one host's trace shows
the step, and a slow peer as time spent waiting in collectives; all hosts would write the same picture
N times over (tens of MB each, to MODEL_DIR's storage), in run directories named by each host's clock.
"""
import glob
import os
from typing import Optional, Sequence

import jax
from etils import epath

from data_pipelines import storage
from pretrain import op_profile
from pretrain.errors import ConfigError
from pretrain.metrics import say

SUMMARY_SOURCES = 15


class StepProfiler:
  """Traces the steps first..last of PROFILE_STEPS that this run reaches (a resumed run, those after its
  start). Use as a context: a run that ends or stops inside the range still closes its trace."""

  def __init__(self, model_dir: str, steps: Optional[Sequence[int]]):
    if steps is not None and not (isinstance(steps, (tuple, list)) and len(steps) == 2
                                  and all(isinstance(s, int) for s in steps) and 1 <= steps[0] <= steps[1]):
      raise ConfigError(f"PROFILE_STEPS={steps!r}: expected (first, last) with 1 <= first <= last, e.g. (101, 105)")
    self.steps = steps if jax.process_index() == 0 else None
    self.directory = epath.Path(model_dir) / "profile"
    self._traced = None  # [first, last] steps while tracing
    self._staged = None  # where the profiler writes: the trace is copied to `directory` when it stops
    self._program = None  # the compiled step the traced steps run

  def use_program(self, compiled) -> None:
    """The compiled train step (a jax.stages.Compiled): its text names each kernel's source in the summary."""
    self._program = compiled

  def before(self, step: int) -> None:
    """Traces from `step`, about to be dispatched, if it is in the range."""
    if not (self.steps and self.steps[0] <= step <= self.steps[1]):
      return
    if self._traced is None:
      self._staged = storage.StagedDirectory(str(self.directory))
      jax.profiler.start_trace(self._staged.path)
      self._traced = [step, step]
    self._traced[1] = step

  def after(self, step: int, outputs) -> None:
    """Stops tracing at the last step of the range, once the devices have finished it."""
    if self._traced is not None and step == self.steps[1]:
      jax.block_until_ready(outputs)
      self._stop()

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    first, last = self._traced
    summary = self._summary(last - first + 1)
    self._staged.sync()
    self._staged.close()
    self._traced = None
    say(f"profiled steps {first}-{last} in {self.directory}: tensorboard --logdir={self.directory}, Profile tab")
    if summary:
      say(summary)

  def _summary(self, steps: int) -> Optional[str]:
    """The traced steps' device time by model source, with the program's text written beside the trace; None
    where the trace is not on this host's disk (it is written to gs:// directly) or no program was given."""
    if self._program is None or self._staged.path.startswith("gs://"):
      return None
    program = self._program.as_text()
    with open(os.path.join(self._staged.path, "train_step.hlo.txt"), "w") as f:
      f.write(program)
    traces = glob.glob(os.path.join(self._staged.path, "plugins", "profile", "*", "*.xplane.pb"))
    try:
      return op_profile.summary(max(traces, key=os.path.getmtime), program, steps, top=SUMMARY_SOURCES)
    except (OSError, ValueError) as e:  # the trace stands without its summary
      return f"no summary of the profile: {e}"

  def __enter__(self) -> "StepProfiler":
    return self

  def __exit__(self, *exception) -> None:
    if self._traced is not None:
      self._stop()
