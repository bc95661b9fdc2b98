"""launch.local starts real JAX processes that join one job; a failing child stops the rest."""
import sys
import time

from helpers import run_module

JOIN_AND_GATHER = """
import os
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from pretrain import distributed

distributed.initialize()
assert jax.device_count() == 4 and jax.local_device_count() == 2 and jax.process_count() == 2
gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))
# One write: a pipe takes it whole, so Gloo's own writes to this stdout cannot split it.
os.write(1, f"gathered {gathered.ravel().tolist()} on {jax.process_index()}\\n".encode())
"""


def launch_local(*args):
  return run_module("launch.local", *args, timeout=60)


def test_two_processes_join_and_allgather():
  done = launch_local("--num_processes=2", "--devices_per_process=2", "--", sys.executable, "-c", JOIN_AND_GATHER)
  assert done.returncode == 0, done.stdout + done.stderr
  # Gloo's C++ runtime writes its connection log to the child's own stdout through a buffer of its own, so
  # a line of it can be cut by the result's (one write, whole): look for each result within that process's
  # lines, not for a whole line.
  for process in (0, 1):
    own = [line for line in done.stdout.splitlines() if line.startswith(f"[process {process}] ")]
    assert any(f"gathered [10, 11] on {process}" in line for line in own), done.stdout


def test_a_childs_stdout_lines_stay_whole_while_its_stderr_is_written_piecewise():
  # Like the C++ runtime's logs (gloo, XLA), which reach stderr a few bytes per write.
  script = ("import os\nfor i in range(50):\n  os.write(2, b'log ')\n  os.write(1, b'out ')\n"
            "  os.write(2, b'piece\\n')\n  os.write(1, b'line %d\\n' % i)\n")
  done = launch_local("--num_processes=2", "--", sys.executable, "-c", script)
  assert done.returncode == 0, done.stderr
  for i in range(2):
    assert [line for line in done.stdout.splitlines() if line.startswith(f"[process {i}]")] == [
        f"[process {i}] out line {n}" for n in range(50)]
    assert done.stderr.splitlines().count(f"[process {i}] log piece") == 50


def test_failing_child_stops_the_others():
  script = "import os, sys, time\nif os.environ['JAX_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(60)"
  start = time.monotonic()
  done = launch_local("--num_processes=2", "--", sys.executable, "-c", script)
  assert time.monotonic() - start < 15  # process 0 was terminated, not waited for
  assert done.returncode == 3
  assert done.stderr.splitlines() == ["launch.local: process 1 exited with code 3; stopped the others"]


def test_missing_command_is_one_line_error():
  done = launch_local("--num_processes=2")
  assert done.returncode == 2
  assert done.stderr.splitlines() == [
      "launch.local: error: give the command to run after --, e.g. -- python -m pretrain.train ..."]
