"""One run per MODEL_DIR: a second run refuses to start while the first one's lease is fresh; the lease of
a run that died (stale, or its process gone from this host) is taken over with a line saying so."""
import json
import socket
import subprocess
import sys
import time

import gin
import pytest

from helpers import ROOT, small_bert_flags
from pretrain import cli, lease
from pretrain.errors import Interrupted
from pretrain import train as train_program


def test_a_second_run_on_a_held_model_dir_fails_with_one_line(tmp_path, capsys):
  first = lease.Lease(str(tmp_path), heartbeat_seconds=0.2)
  assert first.acquire() is None
  try:
    beat = json.loads(first.path.read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads(first.path.read_text())["heartbeat"] > beat  # the holder keeps it fresh
    gin.clear_config()
    with pytest.raises(SystemExit) as exited:
      cli.run("pretrain.train", lambda: train_program.main(["pretrain.train", *small_bert_flags(tmp_path, 2)]))
    assert exited.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"pretrain.train: error: {tmp_path} is in use by another run (host {socket.gethostname()}"
                           ), last
  finally:
    first.release()
  assert not first.path.exists()  # released: the next run starts


def test_a_stop_raised_once_the_lease_is_taken_unwinds_through_its_release(tmp_path, monkeypatch):
  """As when SIGTERM's stop is raised in the main thread as acquire() returns: the run's `held` block releases
  the lease on the way out (test_multihost saw RUNNING left after a stop in the start-up)."""
  taken = lease.Lease.acquire

  def taken_then_stopped(self):
    taken(self)
    raise Interrupted("stopped by SIGTERM while starting", 143)
  monkeypatch.setattr(lease.Lease, "acquire", taken_then_stopped)
  with pytest.raises(Interrupted):
    with lease.held(str(tmp_path), is_process_zero=True):
      pass
  assert not (tmp_path / lease.LEASE_FILE).exists()


def test_a_signal_right_after_the_lease_is_written_releases_it(tmp_path, monkeypatch):
  """As when SIGTERM arrives while acquire() checks what it wrote: the signal's exit path releases the lease
  before its heartbeat has started, and the file goes."""
  taker = lease.Lease(str(tmp_path))
  read, signalled = taker.holder, []

  def read_with_a_signal_once_written():
    if taker.path.exists() and not signalled:
      signalled.append(True)
      taker.release()  # what pretrain.signals runs on the way out
      raise KeyboardInterrupt
    return read()
  monkeypatch.setattr(taker, "holder", read_with_a_signal_once_written)
  with pytest.raises(KeyboardInterrupt):
    taker.acquire()
  assert signalled and not taker.path.exists()


def test_a_signal_while_the_lease_is_written_releases_the_file_it_cut_short(tmp_path, monkeypatch):
  """As when SIGTERM arrives while acquire() writes the lease (test_multihost saw RUNNING left, empty, after a stop in
  the start-up): the file is made but nothing is written into it; the signal's exit path removes it."""
  taker = lease.Lease(str(tmp_path))
  write_text = type(taker.path).write_text

  def cut_short(path, text, *args, **kwargs):
    write_text(path, "", *args, **kwargs)  # opened for writing: the file is there, empty
    raise KeyboardInterrupt
  monkeypatch.setattr(type(taker.path), "write_text", cut_short)
  with pytest.raises(KeyboardInterrupt):
    taker.acquire()
  assert taker.path.exists() and taker.path.read_text() == ""
  taker.release()  # what pretrain.signals runs on the way out
  assert not taker.path.exists()


def test_a_stale_lease_from_another_host_is_taken_over(tmp_path):
  (tmp_path / lease.LEASE_FILE).write_text(json.dumps({"host": "gone-host", "pid": 1, "heartbeat": time.time() - 61}))
  taker = lease.Lease(str(tmp_path))
  note = taker.acquire()
  taker.release()
  assert note == (f"took over the lease of {tmp_path} from a run that stopped without releasing it "
                  "(host gone-host, pid 1)")


def test_a_fresh_lease_from_another_host_is_respected(tmp_path):
  (tmp_path / lease.LEASE_FILE).write_text(json.dumps({"host": "busy-host", "pid": 1, "heartbeat": time.time() - 5}))
  with pytest.raises(lease.ConfigError, match="in use by another run \\(host busy-host, pid 1, last heartbeat 5 s ago"):
    lease.Lease(str(tmp_path)).acquire()


def test_the_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pretrain import lease; "
                             "lease.Lease(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)",
                             str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  held_by = json.loads((tmp_path / lease.LEASE_FILE).read_text())
  with pytest.raises(lease.ConfigError, match=f"pid {held_by['pid']}"):
    lease.Lease(str(tmp_path)).acquire()
  holder.kill()
  holder.wait()
  taker = lease.Lease(str(tmp_path))
  assert f"pid {held_by['pid']}" in taker.acquire()
  taker.release()


def test_a_lease_released_while_others_read_it_reads_as_free(tmp_path, monkeypatch):
  """Process 0 releases the job's lease as the other processes end: what each of them reads is a holder or
  none, never an error (the file really goes and comes back while they read), and their release leaves it alone."""
  import threading
  # The churn below catches about one read in seven half-written: each would wait the full pause before reading again.
  monkeypatch.setattr(lease, "_REREAD_AFTER_SECONDS", 0.001)
  holder, other = lease.Lease(str(tmp_path)), lease.Lease(str(tmp_path))
  done = threading.Event()

  def come_and_go():
    while not done.is_set():
      holder._beat()
      holder.path.unlink()

  churn = threading.Thread(target=come_and_go)
  churn.start()
  try:
    for _ in range(5000):  # before the fix, a read that met the file going raised FileNotFoundError
      read = other.holder()
      assert read is None or "heartbeat" in read, read
      other.release()
  finally:
    done.set()
    churn.join()
  holder._beat()
  other.release()
  assert holder.path.exists()  # not its lease


def test_a_lease_read_while_its_heartbeat_rewrites_it_names_its_holder(tmp_path):
  """The heartbeat rewrites the file in place: a reader that catches it half-written reads again."""
  import threading
  first = lease.Lease(str(tmp_path))
  record = {"host": "elsewhere", "pid": 4321, "token": "t", "heartbeat": time.time()}
  text = json.dumps(record)
  first.path.write_text(text[:len(text) // 2])  # as a reader sees a write under way

  def finish_the_write():
    time.sleep(0.03)
    first.path.write_text(text)

  writer = threading.Thread(target=finish_the_write)
  writer.start()
  try:
    assert lease.Lease(str(tmp_path)).holder() == record
  finally:
    writer.join()
