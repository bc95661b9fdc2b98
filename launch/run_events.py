"""What `launch.tpu run --restart_on_preemption` records of each restart, for `pretrain.goodput` to split the time
between starts.

One JSON object a line: `launch` (this launcher's id), `kind`, `time` (time.time() on the launcher's machine, when
it happened or ended) and, for timed kinds, `seconds`. Kinds:
  preemption_detected  the launcher decided that the slice was preempted or lost: `state` ('gone' when it no longer
                       exists) and the run's `exit_code`
  delete               deleting the slice, `seconds`
  create               creating it, until READY (ACTIVE with --queued), `seconds`
  setup                copying the code and installing it on every host, `seconds`
  train_command        the training command is started again

Only restarts are recorded (the first start needs no launcher's view), in MODEL_DIR/goodput_launcher/ID.jsonl, the
object rewritten whole with `gcloud storage cp` as a restart's training command starts or the launcher stops:
gcloud is what the launcher already needs and is logged in with, while this machine may have neither gcsfs nor
credentials for TensorFlow's GCS filesystem; dry runs and the tests' stand-in see the command; and an object of its
own never races with the trainer's appends to goodput.jsonl.
"""
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid

from launch import gcloud

RECORDS_DIR = "goodput_launcher"
PREEMPTION_DETECTED = "preemption_detected"
DELETE = "delete"
CREATE = "create"
SETUP = "setup"
TRAIN_COMMAND = "train_command"


class RunEvents:
  """A launcher's records, kept here and written to `model_dir` by `write`; a failed write is a warning, not
  worth a run."""
  def __init__(self, model_dir: str, runner: gcloud.Runner):
    self.runner = runner
    self.launch_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]  # names sort by time
    self.destination = f"{model_dir.rstrip('/')}/{RECORDS_DIR}/{self.launch_id}.jsonl"
    self.records = []
    self._written = 0  # how many of `records` the object holds

  def record(self, kind: str, **fields) -> None:
    self.records.append({"launch": self.launch_id, "kind": kind, "time": time.time(), **fields})

  @contextlib.contextmanager
  def timed(self, kind: str):
    """Records the block's seconds, even if it raises (the launcher then stops, and writes what it has)."""
    began = time.time()
    try:
      yield
    finally:
      self.record(kind, seconds=time.time() - began)

  def write(self) -> None:
    """Writes the object if it lacks records."""
    if len(self.records) == self._written:
      return
    with tempfile.TemporaryDirectory() as staging:
      local = os.path.join(staging, os.path.basename(self.destination))
      with open(local, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in self.records)
      code = self.runner.run(gcloud.storage_copy(local, self.destination))
    if code == 0:
      self._written = len(self.records)
    else:
      print(
          f"launch.tpu: warning: writing the restart records to {self.destination} failed (gcloud exit code "
          f"{code}); the run goes on", file=sys.stderr, flush=True)
