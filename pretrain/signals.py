"""SIGTERM and Ctrl-C (SIGINT) at any moment of a training run.

Once training runs, SIGTERM belongs to JAX's preemption service (started by `jax.distributed.initialize`):
every process finishes its step, they agree on one, save it and exit 0 (pretrain.trainer). Ctrl-C is
passed on to it as a SIGTERM to this process, so it saves the same way; a second Ctrl-C exits at once.

Before the first step there is nothing to save, and the service would only note a SIGTERM: it acts at a
step, which a start-up may never reach (a hung input, a peer gone). So from the moment the process joins
its job (`hold_until_training`, or for the call of a `handled` function) until `training_begins`, the
first SIGTERM or Ctrl-C says where the start-up was, in one line, and raises `Interrupted` in the main
thread, whose unwinding removes what is half-written and releases the lease. If the main thread is
stuck in native code (a collective whose peer is gone, a compile), a watchdog thread runs the exits
registered with `on_exit` (the lease) and ends the process after GRACE_SECONDS; a second signal ends it
at once.

In a job of several processes, the process a signal stops in its start-up tells the others, which stop as if
they had the signal too ("stopped by SIGTERM to process 0 while ..."), and each process ends only once every
one is ending (`exit_stopped`): see pretrain.distributed.StartUpStops.

The watchdog reads the signals from Python's wakeup file descriptor, which the interpreter writes from its
C signal handler: unlike a Python handler, that reaches a thread whatever the main thread is doing.

Python runs the handler wherever the main thread is, even inside a garbage-collector callback (JAX has one)
or a `__del__`, where an exception cannot propagate: Python drops it with an "Exception ignored" traceback.
A stop dropped so is raised again at once, by the handler called anew (`_Run.dropped`).
"""
import atexit
import contextlib
import ctypes
import functools
import os
import select
import signal
import sys
import threading
import time
import _thread
from typing import Callable, List, Optional

from pretrain.errors import ConfigError, Interrupted, TrainingStopped

GRACE_SECONDS = 3.0  # for the main thread to unwind before the watchdog ends the process for it
PEER_STOP_SECONDS = 5.0  # for the signal that stopped a peer to reach this process too (`stop_behind_failure`)
PEER_WATCH_SECONDS = 0.25  # each wait for a peer's stop: what watching can add to a process's end
_HANDLED = (signal.SIGTERM, signal.SIGINT)
_STOP_WATCHING = 0  # written to the wakeup pipe when the run ends; no signal has this number
_RAISE_AGAIN = 255  # written to it when a stop the handler raised was dropped (`_Run.dropped`); nor this
_PEER_STOPPED = 254  # written to it when another process of the job was stopped in its start-up; nor this
RAISE_AGAIN_SECONDS = 0.05  # for the main thread to leave the place that dropped it
_libc = ctypes.CDLL(None, use_errno=True)
_SIGACTION_BYTES = 256  # more than any platform's struct sigaction, kept whole and never read field by field


def _disposition(signum: int) -> ctypes.Array:
  """How the OS handles `signum` now, whoever set it (JAX's C++ handler too): Python's signal module
  cannot give back a handler that it did not install."""
  saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
  if _libc.sigaction(signum, None, saved) != 0:
    raise OSError(ctypes.get_errno(), f"sigaction({signum})")
  return saved


def _set_disposition(signum: int, saved: ctypes.Array) -> None:
  if _libc.sigaction(signum, saved, None) != 0:
    raise OSError(ctypes.get_errno(), f"sigaction({signum})")


def _is_default(saved: ctypes.Array) -> bool:
  """SIG_DFL (0) or SIG_IGN (1) in sa_handler, the struct's first field."""
  return ctypes.c_void_p.from_buffer(saved).value in (None, 1)


def _say(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _name(signum: int) -> str:
  return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class _Run:
  """What the signals do in this process until `_stop`: the watchdog thread decides, the main thread's
  Python handler only raises what it decided."""

  def __init__(self, peers=None):
    self.phase = "starting"
    self.training = False
    self.passes_ctrl_c = False  # to JAX's preemption service, once training runs where it does
    self.stop: Optional[Interrupted] = None  # what the start-up was stopped by
    self.raised = False
    self.interrupted = False  # by Ctrl-C during training: a save is under way
    self.exits: List[Callable[[], None]] = []
    self.calls_again = 0  # handler calls the watchdog made (`dropped`), whose signal numbers it reads too
    self.previous_unraisablehook = sys.unraisablehook
    sys.unraisablehook = self.dropped
    self.previous = {signum: (signal.getsignal(signum), _disposition(signum)) for signum in _HANDLED}
    self.decided = threading.Event()
    self.unwound = threading.Event()
    read_end, self.wakeup = os.pipe()
    os.set_blocking(self.wakeup, False)
    self.previous_wakeup = signal.set_wakeup_fd(self.wakeup, warn_on_full_buffer=False)
    self.watchdog = threading.Thread(target=self.watch, args=(read_end,), daemon=True, name="signal-watchdog")
    self.watchdog.start()
    self.peers = peers  # the other processes of the job (pretrain.distributed.StartUpStops), if any
    self.peer_stop = None  # (signal, process) that stopped another process's start-up
    self.peers_watched = threading.Event()  # set: watching ends
    self.peer_watch = threading.Thread(target=self.watch_peers, daemon=True, name="peer-stop-watch")
    if peers is not None:
      self.peer_watch.start()
      # A daemon thread still waiting in JAX's C++ client when the interpreter ends aborts the process.
      atexit.register(self.stop_watching_peers)
    for signum in _HANDLED:
      signal.signal(signum, self.in_main_thread)

  def in_main_thread(self, signum, frame) -> None:
    if self.training:
      return  # Ctrl-C: the watchdog passes it on
    self.decided.wait(1.0)  # the watchdog reads the same signal at once
    if self.stop is not None and not self.raised:
      self.raised = True
      raise self.stop

  def dropped(self, unraisable) -> None:
    """Python's report of an exception it had to drop: the stop that the handler raised is raised again, by the
    watchdog calling the handler anew once this report is over (inside it, the stop would be dropped too);
    anything else is reported as before."""
    if self.stop is None or unraisable.exc_value is not self.stop or self.unwound.is_set():
      self.previous_unraisablehook(unraisable)
      return
    self.raised = False
    os.write(self.wakeup, bytes([_RAISE_AGAIN]))

  def watch_peers(self) -> None:
    """Waits, until training begins, for another process to be stopped in its start-up: the watchdog then stops
    this one."""
    try:
      while not (self.training or self.peers_watched.is_set()):
        self.peer_stop = self.peers.stopped_process(seconds=PEER_WATCH_SECONDS)
        if self.peer_stop is not None:
          os.write(self.wakeup, bytes([_PEER_STOPPED]))
          return
    except Exception:  # the job is gone: a peer's end is then this process's failure (`stop_behind_failure`)
      return

  def stop_watching_peers(self) -> None:
    self.peers_watched.set()
    if self.peer_watch.is_alive():
      self.peer_watch.join()

  def decide(self, signum: int, to_whom: str = "") -> float:
    """The start-up's stop by `signum`, said in one line; returns when the watchdog ends the process if the main
    thread has not unwound by then."""
    self.stop = Interrupted(f"stopped by {_name(signum)}{to_whom} while {self.phase}, before the first step: "
                            "nothing was saved or left half-written; the same command starts again", 128 + signum)
    _say(str(self.stop))
    self.decided.set()
    return time.monotonic() + GRACE_SECONDS

  def watch(self, wakeup: int) -> None:
    deadline = None
    while True:
      timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([wakeup], [], [], timeout)[0]:  # the main thread did not unwind in time
        self.exit_now(self.stop.exit_code, with_peers=True)
        deadline = None
        continue
      signum = os.read(wakeup, 1)[0]
      if signum == _STOP_WATCHING:
        os.close(wakeup)
        return
      if signum == _RAISE_AGAIN:
        time.sleep(RAISE_AGAIN_SECONDS)
        self.calls_again += 1
        _thread.interrupt_main(self.stop.exit_code - 128)
        continue
      if signum == _PEER_STOPPED:
        if self.stop is None and not self.training:
          peer_signum, process = self.peer_stop
          deadline = self.decide(peer_signum, f" to process {process}")
          self.calls_again += 1
          _thread.interrupt_main(peer_signum)  # the main thread's handler raises the stop
        continue
      if signum in _HANDLED and self.calls_again:
        self.calls_again -= 1
        continue
      if signum not in _HANDLED or (self.training and not self.passes_ctrl_c):
        continue
      if self.training and not self.interrupted:
        self.interrupted = True
        _say("Ctrl-C: every process finishes its step, then they save a checkpoint at one step and stop, as for a "
             "preemption; Ctrl-C again stops at once, saving nothing")
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption service takes it from here
      elif self.training or self.stop is not None:
        _say(f"{_name(signum)} again: stopping at once; nothing more is saved")
        self.exit_now(128 + signum, with_peers=False)
      else:
        deadline = self.decide(signum)
        if self.peers is not None:
          self.peers.announce(signum)

  def stop_behind_failure(self) -> Optional[Interrupted]:
    """The stop that a failure in the start-up follows, if any. In a job of several processes, a peer stopped
    by a signal may break this process's collective (its connection reset) a moment before its announcement or
    the launcher's signal reaches this one: that is waited for, briefly, rather than shown as the failure's
    traceback."""
    if self.training:
      return None
    jax = sys.modules.get("jax")
    if self.stop is None and jax is not None and jax.process_count() > 1:
      self.decided.wait(PEER_STOP_SECONDS)
    if self.stop is not None:
      self.raised = True  # the main thread's handler must not raise it again
    return self.stop

  def exit_now(self, code: int, with_peers: bool) -> None:
    if self.unwound.is_set():  # the main thread got out after all: it ends the process itself
      return
    for release in reversed(self.exits):
      with contextlib.suppress(Exception):  # ending is what matters now
        release()
    exit_stopped(code, with_peers)

  def restore(self, signum: int) -> None:
    """`signum` as it was handled before the run."""
    python_handler, saved = self.previous[signum]
    if python_handler is not None:  # None: one that Python did not install
      signal.signal(signum, python_handler)  # Python's own record of the handler,
    _set_disposition(signum, saved)  # and the OS's, which may be a handler that Python did not install

  def end(self) -> None:
    self.unwound.set()
    self.stop_watching_peers()  # before the wakeup pipe it writes to is closed
    atexit.unregister(self.stop_watching_peers)
    # A hook set on top of ours during the run (the checkpoints' filter of orbax's abandoned reads, which are
    # collected later) stays; ours then only passes reports on.
    if sys.unraisablehook == self.dropped:
      sys.unraisablehook = self.previous_unraisablehook
    for signum in _HANDLED:
      self.restore(signum)
    signal.set_wakeup_fd(self.previous_wakeup)
    os.write(self.wakeup, bytes([_STOP_WATCHING]))
    self.watchdog.join()
    os.close(self.wakeup)


_current: Optional[_Run] = None
_peers = None  # the job's other processes, once this one has joined a job of several


def hold_until_training(peers=None) -> None:
  """Start-up handling from now on in this process (called as it joins its job, which gives SIGTERM to JAX, with
  its `peers` if it has some), until the `handled` function that trains returns; in the main thread only, where
  signals are handled."""
  global _current, _peers
  if peers is not None:
    _peers = peers
  if _current is None and threading.current_thread() is threading.main_thread():
    _current = _Run(_peers)


def exit_stopped(code: int, with_peers: bool = True) -> None:
  """Ends this process, stopped by a signal, with `code`; in a job of several processes, `with_peers` once every
  one is ending too (or after a while): the first to end takes the job down with it."""
  sys.stdout.flush()
  sys.stderr.flush()
  if with_peers and _peers is not None:
    _peers.end_together(seconds=GRACE_SECONDS + PEER_STOP_SECONDS)
  os._exit(code)


def handled(fn):
  """Runs `fn` with SIGTERM and Ctrl-C handled as the module says, from `hold_until_training` if that came
  first; outside the main thread, where signals cannot be handled, as it is."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    global _current
    if threading.current_thread() is not threading.main_thread():
      return fn(*args, **kwargs)
    hold_until_training()
    try:
      return fn(*args, **kwargs)
    except (ConfigError, TrainingStopped):
      raise  # the run's own one-line stops
    except Exception:
      stop = _current.stop_behind_failure()
      if stop is None:
        raise
      raise stop from None
    finally:
      _current.end()
      _current = None

  return wrapper


def at(phase: str) -> None:
  """Where the start-up is, for the line that a signal prints ('compiling the train step')."""
  if _current is not None:
    _current.phase = phase


def training_begins() -> None:
  """From here SIGTERM is JAX's preemption service's again, and Ctrl-C is passed on to it; where the service
  does not run (a process that joined no job), both signals do what they did before."""
  run = _current
  if run is None:
    return
  run.passes_ctrl_c = not _is_default(run.previous[signal.SIGTERM][1])
  run.training = True
  run.restore(signal.SIGTERM)
  if not run.passes_ctrl_c:
    run.restore(signal.SIGINT)


@contextlib.contextmanager
def on_exit(release: Callable[[], None]):
  """Runs `release` if a signal ends the process while the block runs (the block's own exit runs it otherwise)."""
  run = _current
  if run is None:
    yield
    return
  run.exits.append(release)
  try:
    yield
  finally:
    run.exits.remove(release)
