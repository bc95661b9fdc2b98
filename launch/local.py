"""Run N processes of one command on this machine as a multi-process JAX job on CPU devices.

  python -m launch.local --num_processes=N [--devices_per_process=K] [--port=P] -- <command...>
  python -m launch.local --num_processes=2 -- python -m pretrain.train \\
      --gin_file=gin_configs/runs/bert_tiny_demo.gin --gin.MODEL_DIR="'/tmp/bert_2_processes'"

Each child gets the parent's environment plus:
  JAX_COORDINATOR_ADDRESS       127.0.0.1:PORT (PORT: --port, else a free one)
  JAX_COORDINATOR_BIND_ADDRESS  127.0.0.1:PORT, so the coordinator listens on loopback only
  JAX_NUM_PROCESSES             N
  JAX_PROCESS_ID                0 .. N-1
  JAX_PLATFORMS                 cpu
  XLA_FLAGS                     existing flags + --xla_force_host_platform_device_count=K
The command joins the job with `pretrain.distributed.initialize()`, where these names are defined
(pretrain.train calls it). Every line child i writes to stdout (stderr) is
printed to our stdout (stderr) as "[process i] line". The two streams stay apart because a child's
C++ runtime writes its logs to stderr piecewise, which would split its stdout lines if they shared
one pipe. If a child exits non-zero the others are terminated and we exit non-zero naming it.
SIGTERM and SIGINT (Ctrl-C) are passed on to every child, which decides what they mean (pretrain.train:
a preemption, or a stop before the first step; a second Ctrl-C stops at once). Each child runs in a
process group of its own, so that a terminal's Ctrl-C reaches it once, through us.
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from pretrain.distributed import (COORDINATOR_ADDRESS_ENV, COORDINATOR_BIND_ADDRESS_ENV, LOOPBACK,
                                  NUM_PROCESSES_ENV, PROCESS_ID_ENV, free_port)

_TERMINATE_GRACE_SECONDS = 5
_PASSED_ON = (signal.SIGTERM, signal.SIGINT)


class _OneLineErrorParser(argparse.ArgumentParser):

  def error(self, message):
    print(f"launch.local: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """Returns the flags and the command after `--`."""
  parser = _OneLineErrorParser(prog="python -m launch.local", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--devices_per_process", type=int, default=1)
  parser.add_argument("--port", type=int, help="coordinator port; a free one by default")
  flags, command = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  args = parser.parse_args(flags)
  if not command:
    parser.error("give the command to run after --, e.g. -- python -m pretrain.train ...")
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num_processes and --devices_per_process must be >= 1")
  if args.port is not None and not 0 < args.port < 65536:
    parser.error(f"--port={args.port} is not a TCP port")
  return args, command


def child_env(process_id: int, num_processes: int, devices_per_process: int, port: int) -> dict[str, str]:
  env = dict(os.environ)
  # Keep any XLA flags the user set; ours only adds the host device count.
  xla_flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_per_process}"
  env.update({
      COORDINATOR_ADDRESS_ENV: f"{LOOPBACK}:{port}",
      COORDINATOR_BIND_ADDRESS_ENV: f"{LOOPBACK}:{port}",
      NUM_PROCESSES_ENV: str(num_processes),
      PROCESS_ID_ENV: str(process_id),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": xla_flags.strip(),
  })
  return env


def _copy_prefixed(source, destination, prefix: str, lock: threading.Lock) -> None:
  for line in source:
    with lock:  # whole lines only, never two children interleaved within one line
      destination.write(prefix + line)
      destination.flush()


def _terminate(children: list[subprocess.Popen]) -> None:
  for child in children:
    if child.poll() is None:
      child.terminate()
  for child in children:
    try:
      child.wait(timeout=_TERMINATE_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()


def _first_failure(children: list[subprocess.Popen]) -> tuple[int, int] | None:
  for i, child in enumerate(children):
    code = child.poll()
    if code not in (None, 0):
      return i, code
  return None


def _pass_on(children: list[subprocess.Popen]):
  """A signal handler that sends the signal it gets to every child still running."""
  def handler(signum, frame):
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)
  return handler


def launch(command: list[str], num_processes: int, devices_per_process: int, port: int) -> int:
  """Runs the children until all succeed (returns 0) or one fails (returns non-zero)."""
  lock = threading.Lock()
  children, copiers = [], []
  previous = {signum: signal.signal(signum, _pass_on(children)) for signum in _PASSED_ON}
  try:
    for i in range(num_processes):
      child = subprocess.Popen(command, env=child_env(i, num_processes, devices_per_process, port),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, process_group=0)
      children.append(child)
      for source, destination in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
        copier = threading.Thread(target=_copy_prefixed, args=(source, destination, f"[process {i}] ", lock))
        copier.start()
        copiers.append(copier)
    while any(child.poll() is None for child in children) and not _first_failure(children):
      time.sleep(0.1)
    failure = _first_failure(children)
  finally:
    if any(child.poll() is None for child in children):
      _terminate(children)
    for copier in copiers:
      copier.join()
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  if failure:
    i, code = failure
    print(f"launch.local: process {i} exited with code {code}; stopped the others", file=sys.stderr)
    return code if code > 0 else 1
  return 0


def main(argv: list[str]) -> int:
  args, command = parse_args(argv)
  try:
    return launch(command, args.num_processes, args.devices_per_process, args.port or free_port())
  except OSError as e:
    print(f"launch.local: error: cannot start {command[0]!r}: {e.strerror}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
