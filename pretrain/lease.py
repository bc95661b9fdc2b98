"""One run per MODEL_DIR: a lease that the running job's process 0 keeps fresh.

MODEL_DIR/RUNNING says who holds it (host, pid, when it started) and when it last beat; a thread
rewrites it every `heartbeat_seconds`. Another run refuses to start while the heartbeat is fresh. A
run that dies without releasing it (SIGKILL, a lost host) leaves a lease that goes stale after
`stale_seconds`, or at once if its process is gone from this host, and the next run takes it over
and says so. Plain files, so it works on gs:// as well as on a local disk.
"""
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

from etils import epath

from pretrain import distributed, signals
from pretrain.errors import ConfigError

LEASE_FILE = "RUNNING"

# A heartbeat rewrites the lease in place, so a reader may catch it half-written: it reads again before it
# takes the file as unreadable (held, by nobody it can name).
_READ_ATTEMPTS = 5
_REREAD_AFTER_SECONDS = 0.1


def _alive_here(holder: dict) -> bool:
  """False only when the holder ran on this host and its process is gone."""
  if holder.get("host") != socket.gethostname():
    return True
  try:
    os.kill(int(holder.get("pid", -1)), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, OverflowError):
    pass
  return True


class Lease:

  def __init__(self, model_dir: str, stale_seconds: float = 60.0, heartbeat_seconds: float = 10.0):
    self.path = epath.Path(model_dir) / LEASE_FILE
    self.stale_seconds, self.heartbeat_seconds = stale_seconds, heartbeat_seconds
    self._record = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                    "started": time.time()}
    self._stop = threading.Event()
    self._beating: Optional[threading.Thread] = None
    self._releasing = threading.Lock()
    self._written = False

  def holder(self) -> Optional[dict]:
    """The lease as written, or None if there is none; an unreadable one counts as held until stale."""
    try:
      if not self.path.exists():
        return None
      for attempt in range(_READ_ATTEMPTS):
        try:
          return json.loads(self.path.read_text())
        except (ValueError, OSError):
          if attempt + 1 < _READ_ATTEMPTS:  # read while the holder's heartbeat rewrote it: read again
            time.sleep(_REREAD_AFTER_SECONDS)
      return {"heartbeat": self.path.stat().mtime}
    except FileNotFoundError:  # released between the checks: another process's run ended
      return None

  def acquire(self) -> Optional[str]:
    """Takes the lease and starts beating; returns a line if it took over a dead run's lease.
    Raises ConfigError naming the live holder if another run has it."""
    held, note = self.holder(), None
    if held is not None:
      age = time.time() - float(held.get("heartbeat", 0))
      who = f"host {held.get('host', '?')}, pid {held.get('pid', '?')}"
      if age < self.stale_seconds and _alive_here(held):
        raise ConfigError(f"{self.path.parent} is in use by another run ({who}, last heartbeat {age:.0f} s ago): "
                          f"stop that run, or wait {self.stale_seconds:.0f} s if it has died")
      note = f"took over the lease of {self.path.parent} from a run that stopped without releasing it ({who})"
    self._beat()
    if self.holder().get("token") != self._record["token"]:  # another run wrote in between
      raise ConfigError(f"{self.path.parent} was taken by another run starting at the same time")
    self._beating = threading.Thread(target=self._keep_beating, daemon=True, name="model-dir-lease")
    self._beating.start()
    return note

  def release(self) -> None:
    """Idempotent: a signal's watchdog may release it while the main thread is on its way to (pretrain.signals).
    Removes the file wherever it is this lease's, also when a signal came between its writing and the heartbeat's
    start."""
    with self._releasing:
      self._stop.set()
      if self._beating is not None:
        self._beating.join()
        self._beating = None
      if not self._written:  # another process's lease (process 0 holds it for the job): not this one's to read
        return
      held = self.holder()
      # Ours, or unreadable: a write of ours cut short by the signal now stopping this process (the file made,
      # nothing written). No other run writes the file while this one holds it.
      if held and held.get("token", self._record["token"]) == self._record["token"]:
        self.path.unlink()

  def _beat(self) -> None:
    self._written = True  # before the write: a signal may come while it is under way
    self.path.write_text(json.dumps({**self._record, "heartbeat": time.time()}))

  def _keep_beating(self) -> None:
    while not self._stop.wait(self.heartbeat_seconds):
      try:
        self._beat()
      except OSError:  # a storage hiccup; the lease only goes stale if it lasts stale_seconds
        pass


@contextlib.contextmanager
def held(model_dir: str, is_process_zero: bool):
  """The job's lease on model_dir for the block (process 0 holds it for all); yields the takeover line
  or None. Every process raises the ConfigError if process 0 could not take it."""
  lease, note, refused = Lease(model_dir), None, None
  with signals.on_exit(lease.release):  # from the start: a signal may end the process in the collective below
    try:  # a signal's stop raised in acquire, after the write, unwinds through the release too
      if is_process_zero:
        try:
          note = lease.acquire()
        except ConfigError as e:
          refused = str(e)
      if distributed.any_process(refused is not None):
        raise ConfigError(refused or f"{model_dir} is in use by another run (process 0 says which)")
      yield note
    finally:
      lease.release()
