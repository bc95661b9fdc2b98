"""A preemption notice (SIGTERM), or Ctrl-C, costs no steps: the run saves the step it reached and exits 0,
and the same command resumes there with the losses of a run that was never interrupted; its goodput records
account for the wall time of both starts. Before the first step a signal stops the run at once, leaving nothing
half-written. (tests/pretrain/test_multihost.py sends them to two processes.)"""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import SMALL_BERT, logged_losses, small_bert_flags, start_module, train
from pretrain import goodput, signals, trainer
from pretrain.errors import Interrupted

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

TRAIN_STEPS = 400  # far more than run before the signal arrives: the schedule is pinned to this length
SCHEDULE = [f"optimizers.warmup_linear_decay.total_steps = {TRAIN_STEPS}", "LOG_EVERY_STEPS = 1",
            "CHECKPOINT_EVERY_STEPS = 1000"]  # no periodic checkpoint before the preemption


def start_then_interrupt(model_dir, after_step: int):
  """Starts pretrain.train, sends SIGINT (Ctrl-C) once it has logged `after_step`; returns (exit code, output)."""
  flags = [*small_bert_flags(model_dir, TRAIN_STEPS), *[f"--gin_bindings={b}" for b in SCHEDULE]]
  run = start_module("pretrain.train", *flags, stderr=subprocess.STDOUT)
  lines, deadline = [], time.time() + 300
  for line in run.stdout:
    lines.append(line)
    if f"step {after_step:>6d}/" in line:
      run.send_signal(signal.SIGINT)
      break
    assert time.time() < deadline, "".join(lines[-20:])
  output = "".join(lines) + run.communicate(timeout=120)[0]
  return run.returncode, output


def test_ctrl_c_saves_the_step_reached_as_a_preemption_and_the_restart_loses_nothing(tmp_path):
  preempted = tmp_path / "preempted"
  launched = time.time()
  code, output = start_then_interrupt(preempted, after_step=3)
  assert code == 0, output[-3000:]
  saved = [int(p.name) for p in (preempted / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and 3 <= saved[0] < TRAIN_STEPS, saved
  step = saved[0]
  assert "Ctrl-C: every process finishes its step, then they save a checkpoint at one step" in output
  assert f"preempted: saved a checkpoint at step {step}" in output
  assert max(logged_losses(preempted)) == step  # it stopped at the step it saved

  resumed_at = time.time()  # train() called in-process: the resume's start begins at the call
  resumed = train("bert_tiny_demo", preempted, step + 3, SMALL_BERT + SCHEDULE)
  assert resumed["steps"] == step + 3 and not resumed["preempted"]
  straight = tmp_path / "straight"
  train("bert_tiny_demo", straight, step + 3, SMALL_BERT + SCHEDULE)
  a, b = logged_losses(straight), logged_losses(preempted)
  assert sorted(b) == list(range(1, step + 4))
  np.testing.assert_array_equal([a[s] for s in sorted(a)], [b[s] for s in sorted(a)])  # bitwise on CPU

  # Ctrl-C reached the run as a SIGTERM to itself: JAX's preemption notice. Goodput: the wall time from the
  # process's start to the resumed run's end adds up, and no step was recomputed.
  goodput.main([str(preempted), f"--png={tmp_path / 'timeline.png'}"])
  run = goodput.account(goodput.read_records(preempted))
  assert [(s.how, s.first_step, s.reached) for s in run.starts] == [("preempted", 0, step),
                                                                     ("finished", step, step + 3)]
  assert launched - 1 <= run.starts[0].began <= launched + 1
  assert resumed_at <= run.starts[1].began <= resumed_at + 1 and run.starts[1].ended <= time.time()
  assert abs(sum(run.seconds.values()) - run.wall_seconds) <= 0.02 * run.wall_seconds
  assert run.seconds["recomputed steps"] == 0 and run.seconds["compile"] > 0 and run.seconds["goodput"] > 0
  assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
  assert resumed["goodput"] == (run.starts[1].goodput_share, run.goodput_share)


def test_sigterm_during_start_up_stops_the_run_leaving_nothing_half_written(tmp_path, demo_paths, monkeypatch):
  """SIGTERM while XLNet tokenizes its corpus on first use (here, in this process): the run stops, saying so,
  with no part of a token file left behind, its MODEL_DIR's lease released and the stop in its goodput records."""
  corpus = tmp_path / "corpus.txt"  # a corpus of its own, so that it is tokenized now, and big enough to take seconds
  corpus.write_text(Path(demo_paths["train"]).read_text() * 6)
  cache, model_dir = tmp_path / "cache", tmp_path / "run"
  monkeypatch.setenv("POD_PRETRAIN_CACHE", str(cache))

  def terminate_once_a_part_is_being_written():
    while not any(p.stat().st_size for p in cache.rglob("*.tmp-*")):
      time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

  def said(line):
    print(line)
    if line.startswith("tokenizing"):
      threading.Thread(target=terminate_once_a_part_is_being_written, daemon=True).start()

  monkeypatch.setattr(trainer, "say", said)
  # The main thread's unwinding is under test, in the test's own process: on a loaded machine it may outlast the
  # watchdog's grace, which would then end the process (tests/pretrain/test_multihost.py times a real one's stop).
  monkeypatch.setattr(signals, "GRACE_SECONDS", 60.0)
  started = time.monotonic()
  with pytest.raises(Interrupted, match="stopped by SIGTERM while opening the train input .*: nothing was saved") as e:
    train("xlnet_tiny_demo", model_dir, 5, [f"TRAIN_FILES = '{corpus}'", f"VOCAB_MODEL = '{demo_paths['vocab_model']}'",
                                            "VALIDATION_FILES = None"])
  assert e.value.exit_code == 128 + signal.SIGTERM and time.monotonic() - started < 60
  assert [p.name for p in cache.rglob("*") if p.is_file()] == []  # the part being written is gone
  assert sorted(p.name for p in model_dir.iterdir()) == ["goodput.jsonl", "vocab.model"]  # no lease, no checkpoint
  assert goodput.read_records(model_dir)[-1]["error"] == "Interrupted"  # the start's time is accounted for


def test_a_stop_raised_inside_a_garbage_collector_callback_is_raised_again(monkeypatch):
  """Python runs the signal's handler wherever the main thread is: here inside a gc callback (JAX has one),
  where the Interrupted it raises is dropped. The stop comes out all the same, at once and with no "Exception
  ignored" report, long before the watchdog would end the process (a two-process start-up failed so)."""
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)
  sent = []

  def in_gc_callback(phase, info):
    if phase == "start" and not sent:
      sent.append(phase)
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(10_000):  # the handler runs at one of these bytecodes, inside this callback
        pass

  @signals.handled
  def start_up():
    signals.at("collecting garbage")
    gc.callbacks.append(in_gc_callback)
    try:
      gc.collect(0)  # the youngest objects only: quick, so the watchdog's grace is all the stop's to use
    finally:
      gc.callbacks.remove(in_gc_callback)
    until = time.monotonic() + signals.GRACE_SECONDS / 2
    while time.monotonic() < until:  # returns (the test fails) if the stop stayed dropped
      time.sleep(0.01)

  with pytest.raises(Interrupted, match="stopped by SIGTERM while collecting garbage, before the first step"):
    start_up()
  assert sent
  assert reported == [] and sys.unraisablehook == reported.append  # the hook is given back
