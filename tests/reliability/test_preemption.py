"""A preemption notice (SIGTERM) costs no steps: the run saves the step it reached and exits 0, and the
same command resumes there with the losses of a run that was never interrupted."""
import signal
import subprocess
import time

import numpy as np

from helpers import SMALL_BERT, logged_losses, small_bert_flags, start_module, train

TRAIN_STEPS = 400  # far more than run before the signal arrives: the schedule is pinned to this length
SCHEDULE = [f"optimizers.warmup_linear_decay.total_steps = {TRAIN_STEPS}", "LOG_EVERY_STEPS = 1",
            "CHECKPOINT_EVERY_STEPS = 1000"]  # no periodic checkpoint before the preemption


def start_then_preempt(model_dir, after_step: int):
  """Starts pretrain.train, sends SIGTERM once it has logged `after_step`; returns (exit code, output)."""
  flags = [*small_bert_flags(model_dir, TRAIN_STEPS), *[f"--gin_bindings={b}" for b in SCHEDULE]]
  run = start_module("pretrain.train", *flags, stderr=subprocess.STDOUT)
  lines, deadline = [], time.time() + 300
  for line in run.stdout:
    lines.append(line)
    if f"step {after_step:>6d}/" in line:
      run.send_signal(signal.SIGTERM)
      break
    assert time.time() < deadline, "".join(lines[-20:])
  output = "".join(lines) + run.communicate(timeout=120)[0]
  return run.returncode, output


def test_sigterm_saves_the_step_reached_and_the_restart_loses_nothing(tmp_path):
  preempted = tmp_path / "preempted"
  code, output = start_then_preempt(preempted, after_step=3)
  assert code == 0, output[-3000:]
  saved = [int(p.name) for p in (preempted / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and 3 <= saved[0] < TRAIN_STEPS, saved
  step = saved[0]
  assert f"preempted: saved a checkpoint at step {step}" in output
  assert max(logged_losses(preempted)) == step  # it stopped at the step it saved

  resumed = train("bert_tiny_demo", preempted, step + 3, SMALL_BERT + SCHEDULE)
  assert resumed["steps"] == step + 3 and not resumed["preempted"]
  straight = tmp_path / "straight"
  train("bert_tiny_demo", straight, step + 3, SMALL_BERT + SCHEDULE)
  a, b = logged_losses(straight), logged_losses(preempted)
  assert sorted(b) == list(range(1, step + 4))
  np.testing.assert_array_equal([a[s] for s in sorted(a)], [b[s] for s in sorted(a)])  # bitwise on CPU
