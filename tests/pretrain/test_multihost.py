"""Multi-process training on CPU (launch.local): two processes train like one at the same global batch,
only process 0 reports; SIGTERM to process 0 during the start-up stops both within seconds; a preemption
notice to one process makes both save the step they agree on and exit 0; a damaged newest checkpoint is
set aside once and both resume from the same older one; Ctrl-C twice stops both at once, and the last
checkpoint continues exactly, data position included, on one process.

One two-process run serves all the tests: it is stopped by SIGTERM to process 0 as soon as it holds its
lease, starts again and trains until process 1 gets SIGTERM; a bit of the checkpoint saved then is
flipped; it resumes, and trains on until Ctrl-C twice after the next periodic checkpoint. The reference
run and the resume after Ctrl-C train in this process, on its one device.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import gin
import numpy as np
import pytest

from helpers import flip_a_bit, largest_array_file, logged_losses, module_command, run_module, start_module
from pretrain import cli
from pretrain import train as train_program

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

TRAIN_STEPS = 30
PREEMPT_AFTER_STEP = 6  # after the checkpoint of step 5, which the damaged one's resume may fall back on
# DATA_SHARDS=2 fixes the global batch's seqio shards, whatever the number of processes reading them.
RUN = ["--gin_file=gin_configs/runs/bert_tiny_demo.gin", "--gin_bindings=bert.BertConfig.hidden_size = 64",
       "--gin_bindings=bert.BertConfig.mlp_dim = 128",
       "--gin_bindings=TASK_FEATURE_LENGTHS = {'input_ids': 64, 'masked_positions': 10}",
       "--gin.BATCH_SIZE=8", "--gin.LEARNING_RATE=2e-3", "--gin.WARMUP_STEPS=5", "--gin.EVAL_EVERY_STEPS=0",
       "--gin.LOG_EVERY_STEPS=1", "--gin.CHECKPOINT_EVERY_STEPS=5", "--gin.DATA_SHARDS=2",
       "--gin.MESH_SHAPE={'data': 4}"]
RTOL = 2e-5  # one device sums in another order than two processes of two (test_trainer's one versus eight)


def train_args(model_dir, steps):
  return [*RUN, f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}"]


def train_here(model_dir, steps):
  """`python -m pretrain.train` in this process, on its one device, with the schedule of TRAIN_STEPS."""
  gin.clear_config()
  cli.run("pretrain.train", lambda: train_program.main(
      ["pretrain.train", *train_args(model_dir, steps), "--gin.MESH_SHAPE={'data': 1}",
       f"--gin.optimizers.warmup_linear_decay.total_steps={TRAIN_STEPS}"]))


def two_processes(model_dir, steps):
  """launch.local's arguments to train in two processes of two devices each."""
  return ["--num_processes=2", "--devices_per_process=2", "--",
          *module_command("pretrain.train", *train_args(model_dir, steps))]


def lines_of(output, process):
  prefix = f"[process {process}] "
  return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def progress_lines(lines):
  return [line for line in lines if line.startswith("[#") or line.startswith("[.") or "resumed from" in line]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
  """The uninterrupted reference."""
  model_dir = tmp_path_factory.mktemp("one_process")
  train_here(model_dir, TRAIN_STEPS)
  return logged_losses(model_dir)


def _child_with_process_id(parent_pid: int, process_id: int) -> int:
  """The pid of launch.local's child that runs JAX process `process_id`."""
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
      environ = (proc / "environ").read_bytes().split(b"\0")
    except (OSError, IndexError, ValueError):  # the process ended meanwhile
      continue
    if parent == parent_pid and f"JAX_PROCESS_ID={process_id}".encode() in environ:
      return int(proc.name)
  raise AssertionError(f"no child of {parent_pid} runs JAX process {process_id}")


def _finished_checkpoints(model_dir):
  directory = Path(model_dir) / "checkpoints"
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def _preempted(model_dir):
  """Two processes training until process 1 gets SIGTERM once process 0 has logged PREEMPT_AFTER_STEP."""
  launcher = start_module("launch.local", *two_processes(model_dir, TRAIN_STEPS), stderr=subprocess.STDOUT)
  lines, deadline = [], time.time() + 300
  for line in launcher.stdout:
    lines.append(line)
    if line.startswith("[process 0] [") and f"step {PREEMPT_AFTER_STEP:>6d}/" in line:
      os.kill(_child_with_process_id(launcher.pid, 1), signal.SIGTERM)
      break
    assert time.time() < deadline, "".join(lines[-20:])
  output = "".join(lines) + launcher.communicate(timeout=120)[0]
  return {"output": output, "returncode": launcher.returncode, "checkpoints": _finished_checkpoints(model_dir)}


def _stopped_in_start_up(model_dir):
  """Two processes starting, until process 0 gets SIGTERM once it holds the MODEL_DIR's lease: its start-up
  has seconds to go (the input, the state, compiling) while process 1 waits for it in a collective."""
  launcher = start_module("launch.local", *two_processes(model_dir, TRAIN_STEPS), stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while not (Path(model_dir) / "RUNNING").exists():
    assert launcher.poll() is None and time.time() < deadline, "the run ended before it took its lease"
    time.sleep(0.01)
  os.kill(_child_with_process_id(launcher.pid, 0), signal.SIGTERM)
  signalled = time.monotonic()
  output = launcher.communicate(timeout=120)[0]
  return {"output": output, "returncode": launcher.returncode, "seconds": time.monotonic() - signalled}


def _interrupted_twice(model_dir, after_checkpoint: int):
  """Two processes resuming, until Ctrl-C (SIGINT to launch.local) once a checkpoint past `after_checkpoint`
  is complete, and Ctrl-C again once both processes have said what the first one does."""
  launcher = start_module("launch.local", *two_processes(model_dir, TRAIN_STEPS), stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while not any(s > after_checkpoint for s in _finished_checkpoints(model_dir)):
    assert launcher.poll() is None and time.time() < deadline, "the run ended before its next checkpoint"
    time.sleep(0.05)
  launcher.send_signal(signal.SIGINT)
  lines = []
  for line in launcher.stdout:
    lines.append(line)
    if sum("] Ctrl-C: every process finishes its step" in line for line in lines) == 2:
      break
  launcher.send_signal(signal.SIGINT)
  again = time.monotonic()
  output = "".join(lines) + launcher.communicate(timeout=120)[0]
  return {"output": output, "returncode": launcher.returncode, "seconds": time.monotonic() - again,
          "latest": max(_finished_checkpoints(model_dir))}


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
  """Two processes training TRAIN_STEPS steps: stopped in their start-up (SIGTERM to process 0), started
  again and preempted (SIGTERM to process 1); the newest checkpoint damaged; resumed, then stopped by
  Ctrl-C twice after the next checkpoint."""
  model_dir = tmp_path_factory.mktemp("two_processes")
  stopped = _stopped_in_start_up(model_dir)
  left_after_start_up = sorted(p.name for p in model_dir.rglob("*"))
  preempted = _preempted(model_dir)
  damaged = preempted["checkpoints"][-1]
  flip_a_bit(largest_array_file(model_dir / "checkpoints" / str(damaged)))
  interrupted = _interrupted_twice(model_dir, after_checkpoint=damaged)
  return {"model_dir": model_dir, "stopped": stopped, "left_after_start_up": left_after_start_up,
          "preempted": preempted, "damaged": damaged, "output": preempted["output"] + interrupted["output"],
          "interrupted": interrupted, "losses": logged_losses(model_dir), "latest": interrupted["latest"]}


def test_sigterm_during_start_up_stops_both_processes_within_seconds(interrupted_run):
  """Each says where it was (process 1 that process 0 was stopped); the lease is released and nothing is
  half-written. Process 1 stops before process 0 ends: JAX would abort it, with a C++ stack, once process 0's
  end took the job's coordination service down."""
  stopped = interrupted_run["stopped"]
  assert stopped["returncode"] == 128 + signal.SIGTERM, stopped["output"][-3000:]
  assert stopped["seconds"] < 20, stopped["output"][-3000:]
  for process, stopped_by in ((0, "SIGTERM"), (1, "SIGTERM to process 0")):
    said = [line for line in lines_of(stopped["output"], process) if line.startswith("stopped by ")]
    assert len(said) == 1 and said[0].startswith(f"stopped by {stopped_by} while "), stopped["output"][-3000:]
    assert ", before the first step: nothing was saved" in said[0], stopped["output"][-3000:]
  assert "Traceback" not in stopped["output"] and "Check failure" not in stopped["output"], stopped["output"][-3000:]
  assert "RUNNING" not in interrupted_run["left_after_start_up"]
  assert not [name for name in interrupted_run["left_after_start_up"] if ".tmp" in name]


def test_sigterm_to_one_process_makes_both_save_one_step_and_exit_0(interrupted_run):
  preempted = interrupted_run["preempted"]
  assert preempted["returncode"] == 0, preempted["output"][-3000:]
  saved = preempted["checkpoints"][-1]
  assert saved >= PREEMPT_AFTER_STEP
  assert f"preempted: saved a checkpoint at step {saved}" in "\n".join(lines_of(preempted["output"], 0))


def test_a_damaged_newest_checkpoint_is_set_aside_once_and_both_processes_resume_the_older_one(interrupted_run):
  """Set aside by process 0 alone, named once; both processes restore the checkpoint before it (their losses
  from there on are one run's: test_two_processes_train_like_one...). That is step 5 where the preemption's
  save came before the periodic one of step 10, and step 10 where it came later (on a fast machine)."""
  model_dir, damaged = interrupted_run["model_dir"], interrupted_run["damaged"]
  older = interrupted_run["preempted"]["checkpoints"][-2]
  said = lines_of(interrupted_run["interrupted"]["output"], 0)
  named = [line for line in said if " is damaged: " in line]
  assert len(named) == 1 and named[0].startswith(f"checkpoint {model_dir / 'checkpoints' / str(damaged)} is damaged")
  # A flipped bit gives wrong values (checksum mismatch) or, in a compressed chunk, bytes that do not decode.
  assert "checksum mismatch" in named[0] or "unreadable" in named[0]
  assert named[0].endswith(f"set aside in {model_dir / 'damaged' / str(damaged)}")
  # Gloo's connection log shares process 0's stdout and may run into a line of ours: searched, not matched.
  assert any(f"resumed from step {older} in {model_dir / 'checkpoints'}" in line for line in said), said
  assert [p.name for p in (model_dir / "damaged").iterdir()] == [str(damaged)]
  assert not [line for line in lines_of(interrupted_run["interrupted"]["output"], 1) if "damaged" in line]


def test_ctrl_c_makes_both_save_and_a_second_one_stops_both_at_once(interrupted_run):
  interrupted = interrupted_run["interrupted"]
  assert interrupted["returncode"] == 128 + signal.SIGINT, interrupted["output"][-3000:]
  assert interrupted["seconds"] < 5, interrupted["output"][-3000:]
  for process in (0, 1):
    assert "Ctrl-C again: stopping at once; nothing more is saved" in lines_of(interrupted["output"], process)


def test_two_processes_train_like_one_and_only_process_0_reports(interrupted_run, one_process_losses):
  losses, output = interrupted_run["losses"], interrupted_run["output"]
  steps = range(1, max(losses) + 1)
  assert len(steps) > PREEMPT_AFTER_STEP
  np.testing.assert_allclose([losses[s] for s in steps], [one_process_losses[s] for s in steps], rtol=RTOL)
  assert len(progress_lines(lines_of(output, 0))) >= len(steps)
  assert progress_lines(lines_of(output, 1)) == []
  assert any("2 process(es)" in line for line in lines_of(output, 0))
  iterators = interrupted_run["model_dir"] / "checkpoints" / str(interrupted_run["latest"]) / "data_iterator"
  assert (iterators / "shard_0_of_2.index").exists() and (iterators / "shard_1_of_2.index").exists()


def test_after_a_stop_at_once_the_last_checkpoint_continues_exactly_on_one_process(interrupted_run,
                                                                                   one_process_losses):
  """Params, optimizer state and the data position saved by two processes of two devices, stopped at once,
  resume on one process of one device (the same DATA_SHARDS): the next steps' losses are the
  uninterrupted run's."""
  model_dir, latest = interrupted_run["model_dir"], interrupted_run["latest"]
  steps = range(latest + 1, latest + 4)
  assert steps[-1] <= TRAIN_STEPS, "process 1 was killed too late"
  train_here(model_dir, steps[-1])
  losses = logged_losses(model_dir)
  np.testing.assert_allclose([losses[s] for s in steps], [one_process_losses[s] for s in steps], rtol=RTOL)


XLNET_BINDINGS = [
    "xlnet.XLNetConfig.d_model = 32", "xlnet.XLNetConfig.d_head = 16", "xlnet.XLNetConfig.d_inner = 64",
    "xlnet.XLNetConfig.scan_layers = True", "SEQ_LEN = 32", "MEM_LEN = 16", "REUSE_LEN = 16", "NUM_PREDICT = 6",
    "BATCH_SIZE = 4", "WARMUP_STEPS = 2", "LOG_EVERY_STEPS = 1", "CHECKPOINT_EVERY_STEPS = 2", "EVAL_EVERY_STEPS = 2",
    "EVAL_STEPS = 2", "optimizers.warmup_linear_decay.total_steps = 6"]


def test_xlnet_continues_exactly_on_another_number_of_processes_both_ways(tmp_path):
  """XLNet's rows read their streams from the step number, so a run saved by one process continues on
  two, and what two saved continues on one, with the losses of an uninterrupted run (memory included),
  and the same held-out losses: two batches of the validation streams, the second read with memory. The
  layers are scanned; the schedule is pinned to 6 steps, so that stopping early does not change it."""
  from helpers import train

  def on_one_process(model_dir, steps):
    train("xlnet_tiny_demo", model_dir, steps, XLNET_BINDINGS + ["MESH_SHAPE = {'data': 1}"])

  def on_two_processes(model_dir, steps):
    flags = [f"--gin_bindings={b}" for b in XLNET_BINDINGS + ["MESH_SHAPE = {'data': 2}"]]
    result = run_module("launch.local", "--num_processes=2", "--devices_per_process=1", "--", *module_command(
        "pretrain.train", "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin", *flags, f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.TRAIN_STEPS={steps}"))
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout

  reference, relayed = tmp_path / "reference", tmp_path / "relayed"
  on_one_process(reference, 6)
  on_one_process(relayed, 2)  # one process saves at step 2,
  output = on_two_processes(relayed, 4)  # two resume there and save at step 4,
  assert "resumed from step 2" in "\n".join(lines_of(output, 0))
  on_one_process(relayed, 6)  # and one resumes there.
  expected, losses = logged_losses(reference), logged_losses(relayed)
  np.testing.assert_allclose([losses[s] for s in range(1, 7)], [expected[s] for s in range(1, 7)], rtol=2e-5)
  evals = logged_losses(reference, split="eval")
  assert sorted(evals) == [2, 4, 6] and np.isfinite(list(evals.values())).all() and evals[6] != evals[2]
  relayed_evals = logged_losses(relayed, split="eval")
  assert sorted(relayed_evals) == [2, 4, 6]
  np.testing.assert_allclose([relayed_evals[s] for s in (2, 4, 6)], [evals[s] for s in (2, 4, 6)], rtol=2e-5)
