"""What each start of a run records for `pretrain.goodput`: events appended to MODEL_DIR/goodput.jsonl.

One JSON object a line: `start` (this start's id, so that restarts are told apart), `kind`, `time` (time.time()
when it happened or ended) and, where they apply, `seconds` (how long it took) and `step`. Kinds:
  start       the start began: `time` is the process's start for the first start of a command launched to train
              (`pretrain.train`, `pretrain.demo`: `launched_to_train`), since its imports, joining the job and
              reading the task are a start's cost too; otherwise (a later run in that process, such as `make
              demo`'s second, or train() called from a notebook or a script) when its train() was called
  init        a fresh state (or one around imported weights) at `step` 0, `seconds`
  restore     a resume from the checkpoint at `step`, `seconds`
  compile     `what` ('train_step', or 'eval_step': its first call), `seconds`; the train step compiles beside the
              state's restore or init, so its `seconds` are what the start waited for it: for its trace, which
              goes first, and after them;
              `overall_seconds` its whole compile, and `untraced` whether it was loaded without tracing it
              (`pretrain.step_cache`)
  first_step  the first step, `step`, is dispatched: the train loop is ready
  steps       a logged window up to `step`: `steps` run, `seconds` of wall time, `input_seconds` waiting for input,
              `skipped` updates (non-finite gradients)
  save        a checkpoint's blocking time at `step`, `seconds`
  eval        an eval at `step`, `seconds`
  preemption  the processes agreed to stop at `step`
  end         `how`: 'finished', 'preempted' or 'stopped' (with the `error`'s type), at `step`
Timed records never overlap: time recorded inside another timed block (the eval step's compile in the first eval)
is left out of the outer one's `seconds`.

Only process 0 writes. One file for the run's whole life: on gs:// an append rewrites the object (objects are
immutable; `storage.append_text`), as metrics.jsonl's appends do, and a start writes about a record per logged
window, under a MB in days. An object is replaced whole or not at all, and the lease keeps other runs out, so no
record is torn or lost to a concurrent writer.
"""
import contextlib
import json
import os
import time
import uuid
from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf
from etils import epath

from data_pipelines import storage
from pretrain import goodput
from pretrain.errors import one_line

_IMPORTED = time.time()
_process_start_unclaimed = False  # set by a command launched to train, until its first start takes it


def process_start_time() -> float:
  """When this process started, in time.time()'s terms: on Linux (where runs train) its start in clock ticks since
  boot from /proc, against the clock since boot (psutil adds whole seconds of boot time: up to 1 s off); elsewhere
  when this module was imported."""
  try:
    with open("/proc/self/stat") as stat:
      ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name before ")" may hold spaces
  except OSError:
    return _IMPORTED
  return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def launched_to_train() -> None:
  """Says that this process was launched to train: its first start began at the process's start. Without it a
  start begins at its train() call, so that a notebook's idle time or a script's other work is not start-up."""
  global _process_start_unclaimed
  _process_start_unclaimed = True


def start_time(called_at: float) -> float:
  """When a start whose train() was called at `called_at` began: the process's start for the first start of a
  process launched to train; else `called_at`."""
  global _process_start_unclaimed
  first, _process_start_unclaimed = _process_start_unclaimed, False
  return process_start_time() if first else called_at


class EventLog:
  """A start's records, of a train() called at `called_at` (time.time()). As a context it writes `start` on entry
  and, if the block raises, `end` 'stopped'; the trainer records a normal end. Where not `write` (processes other
  than 0) nothing is written."""

  def __init__(self, model_dir: str, write: bool, called_at: float):
    self.model_dir, self.write, self.called_at = model_dir, write, called_at
    self.path = str(epath.Path(model_dir) / goodput.FILE_NAME)
    self.start_id = uuid.uuid4().hex[:12]
    self.step = 0  # the step the state was at, or the last logged one: for an `end` the trainer did not record
    self._skipped_updates = 0  # the run's count at `step`
    self._inner_seconds = [0.0]  # per open `timed` block, the seconds recorded inside it
    self._failing = False  # the last write failed: its warning is out

  def __enter__(self) -> "EventLog":
    self.record("start", time=start_time(self.called_at))
    return self

  def __exit__(self, error_type, error, traceback) -> None:
    if error is not None:
      self.record("end", how="stopped", error=error_type.__name__, step=self.step)

  def record(self, kind: str, **fields) -> None:
    record = {"start": self.start_id, "kind": kind, "time": time.time(), **fields}
    if not self.write:
      return
    try:
      storage.append_text(self.path, json.dumps(record) + "\n")
      self._failing = False
    except (OSError, tf.errors.OpError) as e:  # a record is not worth a run
      if not self._failing:
        print(
            f"warning: cannot write goodput records in {self.path} ({type(e).__name__}: {one_line(e)}); training "
            "goes on", flush=True)
      self._failing = True

  @contextlib.contextmanager
  def timed(self, kind: str, **fields):
    """Records the block's seconds, less those recorded inside it, even if it raises."""
    began = time.time()
    self._inner_seconds.append(0.0)
    try:
      yield
    finally:
      inner, elapsed = self._inner_seconds.pop(), time.time() - began
      self._inner_seconds[-1] += elapsed
      self.record(kind, seconds=elapsed - inner, **fields)

  def compiled_on_first_call(self, fn: Callable, what: str) -> Callable:
    """`fn`, a jitted function, with its first call (the one that compiles it) recorded as a compile of `what`."""
    calls = 0

    def call(*args):
      nonlocal calls
      calls += 1
      if calls > 1:
        return fn(*args)
      with self.timed("compile", what=what):
        return fn(*args)

    return call

  def state_ready(self, seconds: float, step: int, skipped_updates: int) -> None:
    """The train state is at `step` (0: initialised, else restored), after `seconds`, with the run's count of
    skipped updates so far."""
    self.record("restore" if step else "init", seconds=seconds, step=step)
    self.step, self._skipped_updates = step, skipped_updates

  def window(self, step: int, speed: Dict[str, float], skipped_updates: int) -> None:
    """A logged window up to `step`: `speed` as `pretrain.throughput` measured it, `skipped_updates` the run's count."""
    steps = step - self.step
    seconds = speed["step_time"] * steps
    self.record("steps", step=step, steps=steps, seconds=seconds, input_seconds=speed["input_wait"] * seconds,
                skipped=skipped_updates - self._skipped_updates)
    self.step, self._skipped_updates = step, skipped_updates

  def goodput_shares(self) -> Optional[Tuple[float, float]]:
    """(this start's goodput, the run's so far) from the records written; None where none are, or unreadable."""
    if not self.write:
      return None
    try:
      run = goodput.account(goodput.read_records(self.model_dir))
    except (OSError, tf.errors.OpError) as e:
      print(f"warning: cannot read goodput records in {self.path} ({type(e).__name__}: {one_line(e)})", flush=True)
      return None
    return run.start(self.start_id).goodput_share, run.goodput_share
