"""Where metrics go: a progress line on stdout, TensorBoard events and MODEL_DIR/metrics.jsonl.

Only process 0 writes; the others stay quiet so a pod's logs are readable.

The progress line is a plain line printed every LOG_EVERY_STEPS steps, not a tqdm or rich bar (both
installed as other packages' dependencies): a bar redraws itself with carriage returns, or needs a
terminal, and runs mostly write to files (launch.tpu's ~/pod-pretrain.log, launch.local's
"[process i]" lines, CI logs), where each redraw becomes a fragment. A full line per logged step reads
the same in a terminal and in a file, greps, and carries the run's own speed figures (throughput.py).
"""
import json
import time
from typing import Mapping

import jax
import tensorflow as tf
from etils import epath

from data_pipelines import storage
from pretrain.errors import one_line


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _speed(metrics: Mapping[str, float]) -> str:
  """'0.31 s/step  52.1k tok/s  MFU 41%  input 2%' from pretrain.throughput's figures."""
  mfu = f"{metrics['mfu']:.0%}" if "mfu" in metrics else "n/a"
  return (f"{metrics['step_time']:.3g} s/step  {metrics['tokens_per_second'] / 1000:.1f}k tok/s  MFU {mfu}  "
          f"input {metrics['input_wait']:.0%}")


def say(text: str) -> None:
  """A line for the user, from process 0 only."""
  if jax.process_index() == 0:
    print(text, flush=True)


class MetricsWriter:
  def __init__(self, model_dir: str, total_steps: int, start_step: int):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self._start = (time.time(), start_step)
    self._failing = False  # the last write failed: its warning is out
    if self.enabled:
      self._jsonl = epath.Path(model_dir) / "metrics.jsonl"
      self._jsonl.parent.mkdir(parents=True, exist_ok=True)
      # tf.summary writes with TensorFlow's filesystem: staged where that cannot reach MODEL_DIR.
      self._event_dirs = {split: storage.StagedDirectory(str(epath.Path(model_dir) / "tensorboard" / split))
                          for split in ("train", "eval")}
      self._tensorboard = {split: tf.summary.create_file_writer(d.path) for split, d in self._event_dirs.items()}

  def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
    if not self.enabled:
      return
    record = {
        "step": step, **({"split": split} if split != "train" else {}), **{k: float(v) for k, v in metrics.items()}
    }
    try:
      storage.append_text(str(self._jsonl), json.dumps(record) + "\n")
      with self._tensorboard[split].as_default(step=step):
        for name, value in metrics.items():
          tf.summary.scalar(name, float(value))
      self._tensorboard[split].flush()
      self._event_dirs[split].sync()
      self._failing = False
    except (OSError, tf.errors.OpError) as e:  # a log is not worth a run: checkpoints say when storage is gone
      if not self._failing:
        print(f"warning: cannot write metrics in {self._jsonl.parent} ({type(e).__name__}: {one_line(e)}); "
              "training goes on and this line still shows them", flush=True)
      self._failing = True
    print(self._progress_line(step, metrics, split), flush=True)

  def _progress_line(self, step: int, metrics: Mapping[str, float], split: str) -> str:
    shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                      if k.endswith(("loss", "accuracy")) or k == "loss")
    if metrics.get("skipped_steps"):
      shown += f"  skipped {int(metrics['skipped_steps'])} non-finite updates"
    if split != "train":
      return f"[eval]  step {step:>6d}  {shown}"
    started, first_step = self._start
    rate = (step - first_step) / max(time.time() - started, 1e-9)
    eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
    width = 20
    done = int(width * step / max(self.total_steps, 1))
    bar = "#" * done + "." * (width - done)
    return (f"[{bar}] step {step:>6d}/{self.total_steps}  {shown}  {_speed(metrics)}  "
            f"ETA {_duration(eta) if eta != float('inf') else '?'}")

  def close(self) -> None:
    if self.enabled:
      for split, writer in self._tensorboard.items():
        writer.close()
        self._event_dirs[split].sync()
        self._event_dirs[split].close()
