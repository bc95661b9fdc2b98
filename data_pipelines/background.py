"""Work in a daemon thread, waited for in the caller's: a wait is cut short by a signal's handler, which Python
runs only in the main thread between bytecodes, so Ctrl-C or SIGTERM is not held until native work (an XLA
compile, sentencepiece's training, a tf.data read) returns."""
import threading
import time
from typing import Any, Callable


class Background:
  """`work()`, called in a thread of its own; `result()` waits for its value or raises its error. The thread is a
  daemon: a read that hangs does not keep the process from ending. But a process must not end while the thread
  is in native code that returns to Python (an XLA compile: Python's exit would abort it), so `result()` or
  `wait()` is called before any ordinary exit."""

  def __init__(self, work: Callable[[], Any], name: str):
    self._value, self._error, self._done = None, None, threading.Event()
    self.seconds = 0.0  # what work() took
    threading.Thread(target=self._run, args=(work,), daemon=True, name=name).start()

  def _run(self, work) -> None:
    began = time.time()
    try:
      self._value = work()
    except BaseException as e:  # given to the caller of result()
      self._error = e
    finally:
      self.seconds = time.time() - began
      self._done.set()

  def wait(self) -> None:
    self._done.wait()  # a signal's handler still runs (and may raise) while this waits

  def result(self):
    self.wait()
    if self._error is not None:
      raise self._error
    return self._value
