"""Where metrics go: a progress line on stdout, TensorBoard events and MODEL_DIR/metrics.jsonl.

Only process 0 writes; the others stay quiet so a pod's logs are readable.
"""
import json
import time
from typing import Mapping

import jax
import tensorflow as tf
from etils import epath


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def say(text: str) -> None:
  """A line for the user, from process 0 only."""
  if jax.process_index() == 0:
    print(text, flush=True)


class MetricsWriter:
  def __init__(self, model_dir: str, total_steps: int, start_step: int):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self._start = (time.time(), start_step)
    if self.enabled:
      self._jsonl = epath.Path(model_dir) / "metrics.jsonl"
      self._jsonl.parent.mkdir(parents=True, exist_ok=True)
      self._tensorboard = {split: tf.summary.create_file_writer(str(epath.Path(model_dir) / "tensorboard" / split))
                           for split in ("train", "eval")}

  def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
    if not self.enabled:
      return
    record = {
        "step": step, **({"split": split} if split != "train" else {}), **{k: float(v) for k, v in metrics.items()}
    }
    with self._jsonl.open("a") as f:
      f.write(json.dumps(record) + "\n")
    with self._tensorboard[split].as_default(step=step):
      for name, value in metrics.items():
        tf.summary.scalar(name, float(value))
    self._tensorboard[split].flush()
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
    tokens = metrics.get("tokens_per_second", 0.0)
    return (f"[{bar}] step {step:>6d}/{self.total_steps}  {shown}  "
            f"{tokens / 1000:.1f}k tok/s  ETA {_duration(eta) if eta != float('inf') else '?'}")

  def close(self) -> None:
    if self.enabled:
      for writer in self._tensorboard.values():
        writer.close()
