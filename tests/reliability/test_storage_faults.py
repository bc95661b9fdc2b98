"""Storage that refuses a checkpoint: a passing fault is retried until the save lands; a lasting one
stops the run with one line saying which step is not saved and which is. The faults are real: the
checkpoint directory is made immutable (chattr +i), which refuses even root's writes, then its disk (a
small tmpfs) fills up. The faults being handled, no library's traceback of them shows."""
import errno
import gc
import logging
import subprocess
import threading
import time
import warnings

import pytest

from helpers import SMALL_BERT, train
from pretrain import trainer
from pretrain.errors import TrainingStopped


def immutable(path, on: bool):
  if on or path.exists():  # a run that failed early made no metrics.jsonl: its own error is the one to show
    subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
  """A 64 MiB tmpfs of its own, so that filling it up fills nothing else."""
  mount_point = tmp_path / "disk"
  mount_point.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount_point)], check=True,
                 capture_output=True)
  yield mount_point
  subprocess.run(["umount", "--lazy", str(mount_point)], check=True, capture_output=True)


def fill_up(disk):
  try:
    with open(disk / "filler", "wb") as filler:
      while True:
        filler.write(bytes(2**20))
  except OSError as e:
    assert e.errno == errno.ENOSPC, e


def test_a_passing_fault_is_retried_and_a_full_disk_stops_the_run(small_disk, monkeypatch, capsys, caplog):
  """Storage refuses the step-2 save for about a second (retried: it lands); then the disk fills up and
  metrics.jsonl is refused: the run goes on without its metrics (said once), and step 4 cannot be saved.
  orbax's tracebacks of the failed saves, and its warnings about the parts it never awaited, are not shown."""
  model_dir = small_disk / "run"
  checkpoints_dir = model_dir / "checkpoints"
  lines = []

  def said(text):  # the run's own lines, watched to time the faults
    lines.append(text)
    print(text)
    if "failed" in text and len(lines_with("failed")) == 1:
      threading.Timer(0.5, immutable, (checkpoints_dir, False)).start()  # before the 1 s retry
    if text.startswith("saved step"):
      fill_up(small_disk)
      immutable(model_dir / "metrics.jsonl", True)

  def lines_with(word):
    return [line for line in lines if word in line]

  monkeypatch.setattr(trainer, "say", said)

  def refuse_once_made():  # the run makes the directory at its start, long before its first save
    while not checkpoints_dir.is_dir():
      time.sleep(0.01)
    immutable(checkpoints_dir, True)

  threading.Thread(target=refuse_once_made, daemon=True).start()
  try:
    with warnings.catch_warnings(record=True) as warned:  # as shown: the filters in force are kept
      with pytest.raises(TrainingStopped) as stopped:
        train("bert_tiny_demo", model_dir, 6,
              SMALL_BERT + ["CHECKPOINT_EVERY_STEPS = 2", "SAVE_ATTEMPTS = 2", "LOG_EVERY_STEPS = 1"])
      message = str(stopped.value)
      del stopped  # its traceback's frames hold the coroutines never awaited,
      gc.collect()  # which are reported when they are collected: here, under the filters as shown
  finally:
    immutable(checkpoints_dir, False)
    immutable(model_dir / "metrics.jsonl", False)
  out = capsys.readouterr().out
  assert out.count(f"warning: cannot write metrics in {model_dir} (PermissionError") == 1, out
  assert "step      3/6" in out, "the progress line of a step whose metrics were refused"
  retried = lines_with("failed")
  assert "saving step 2 in 1 s (attempt 1 of 2)" in retried[0] and "PermissionError" in retried[0], retried
  assert lines_with("saved step") == [f"saved step 2 in {checkpoints_dir}"]
  assert len(retried) == 3 and all("saving step 4" in line for line in retried[1:]), retried
  assert message.startswith(f"cannot write checkpoints in {checkpoints_dir} (") and "\n" not in message
  assert "No space left on device" in message, message
  assert "the train state of step 4 is NOT saved; the newest saved checkpoint is step 2" in message
  assert sorted(p.name for p in checkpoints_dir.iterdir() if p.name.isdigit()) == ["2"]
  assert [r.getMessage() for r in caplog.records if r.exc_info] == []
  assert [str(w.message) for w in warned if "never awaited" in str(w.message)] == []


def test_library_tracebacks_of_handled_faults_show_with_pod_pretrain_debug(monkeypatch):
  from pretrain import checkpoints
  record = logging.LogRecord("absl", logging.ERROR, "/site-packages/orbax/checkpoint/_src/futures/future.py", 1,
                             "raised", (), (OSError, OSError(28, "No space left on device"), None))
  shown = checkpoints._TracebacksOfHandledFaults().filter
  assert not shown(record)
  monkeypatch.setenv("POD_PRETRAIN_DEBUG", "1")
  assert shown(record)
