"""Manage a Cloud TPU slice and run `pretrain.train` on all its hosts.

  python -m launch.tpu create|setup|run|status|logs|delete --name=NAME --zone=ZONE \\
      [--accelerator_type=v3-512] [--runtime_version=RUNTIME] [--spot|--preemptible] \\
      [--queued] [--project=PROJECT] [--dry_run]
  python -m launch.tpu run --name=xlnet-large --zone=europe-west4-a \\
      --gin_file=gin_configs/runs/xlnet_large_v3_512.gin --model_dir=gs://BUCKET/xlnet_large --dry_run

  create  creates the slice (`tpu-vm create`, or a queued resource with --queued, waiting until ACTIVE), with
          the runtime Google lists for its chip (launch/runtimes.py) unless --runtime_version is given.
  setup   puts the project in ~/pod-pretrain on every host (copies this tree, or clones --repo_url
          [--branch]), makes a virtual environment with Python --python (default 3.11) or newer in
          ~/.pod-pretrain-venv (from the host's python3 where it is new enough, else with uv) and runs
          `pip install -e ".[tpu]"` in it, unless the host has an install for the same setup.py and Python;
          with --wheel_cache=gs://... from that cache's wheels, filling it on the first setup.
  run     runs `~/.pod-pretrain-venv/bin/python -m pretrain.train --gin_file=... --gin.MODEL_DIR="gs://..."
          [--gin.KEY=VALUE...] [args after --]` on every host; output goes to ~/pod-pretrain.log on each
          host and is followed here. With --restart_on_preemption a preempted or lost slice is deleted, recreated,
          set up and the run started again, at most --max_restarts times (see "Preemption" below); each
          restart's detection, delete, create and setup times go to MODEL_DIR/goodput_launcher/ for
          `python -m pretrain.goodput MODEL_DIR`.
  status  describes the slice; logs prints (or --follow-s) the log of --worker (default 0);
  delete  deletes the slice.

--dry_run prints every gcloud command instead of running it.

Preemption: on a preemption notice (SIGTERM) the trainer saves the step it reached and exits 0, so a
preempted slice costs no trained steps, only the time to recreate it, set it up and compile again;
training resumes from that checkpoint in --model_dir. When the run ends, `run --restart_on_preemption`
tells a preemption from the slice's state, not from the exit code:
  - a passing state (STOPPING, REPAIRING, RESTARTING, ...) is polled every --poll_seconds until it
    settles; after --max_settle_seconds (default 1800) it stops with an error;
  - READY (ACTIVE with --queued) is looked at again after --preemption_grace_seconds (default 90,
    0 = don't), because the run ends during GCE's 30 s preemption notice, before the TPU API shows it;
    a slice still READY then means the run ended by itself: finished (exit 0) or failed (not restarted);
  - PREEMPTED or TERMINATED (SUSPENDING, SUSPENDED or FAILED with --queued), or a slice that no longer
    exists, is recreated and the run started again.
"""
import argparse
import pathlib
import re
import shlex
import shutil
import sys
import tempfile
import time

from launch import gcloud, hosts, run_events, runtimes

COMMANDS = ("create", "setup", "run", "status", "logs", "delete")
PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent
REMOTE_LOG = "~/pod-pretrain.log"
# Never ship the local virtualenv, git history or build litter to the hosts.
LOCAL_TREE_EXCLUDES = (".venv*", ".git", "__pycache__", "*.egg-info", ".pytest_cache", "demo_output")

# States in which the slice's hosts are up.
UP_TPU_VM_STATES = frozenset({"READY"})
UP_QUEUED_RESOURCE_STATES = frozenset({"ACTIVE"})
# States meaning the slice is gone for good and must be recreated.
LOST_TPU_VM_STATES = frozenset({"PREEMPTED", "TERMINATED"})
LOST_QUEUED_RESOURCE_STATES = frozenset({"SUSPENDING", "SUSPENDED", "FAILED"})
# Stopped by someone (`tpu-vm stop`): settled, but neither up nor for the launcher to recreate.
STOPPED_STATE = "STOPPED"
# Any other state (STOPPING, REPAIRING, RESTARTING, STARTING, CREATING, DELETING, PROVISIONING...) is
# passing: the slice is on its way to up, stopped or lost, and `run` waits to see which before deciding.

_ACCELERATOR_TYPE = re.compile(r"v\d+[a-z]*-\d+")  # v3-512, v4-128, v5p-8, v5litepod-16, v6e-8
_SLICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_PYTHON_VERSION = re.compile(r"3\.\d+")


class LaunchError(Exception):
  """A failure worth one line on stderr and a non-zero exit."""


class _OneLineErrorParser(argparse.ArgumentParser):

  def error(self, message):
    print(f"launch.tpu: error: {message}", file=sys.stderr)
    sys.exit(2)


def _parser() -> _OneLineErrorParser:
  p = _OneLineErrorParser(prog="python -m launch.tpu", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("command", choices=COMMANDS)
  p.add_argument("--name", required=True, help="TPU slice name (and queued resource id with --queued)")
  p.add_argument("--zone", required=True)
  p.add_argument("--project")
  p.add_argument("--accelerator_type", help="e.g. v3-512; needed to create the slice")
  p.add_argument("--runtime_version", help="create: TPU software version; by default the one for the chip")
  p.add_argument("--spot", action="store_true")
  p.add_argument("--preemptible", action="store_true")
  p.add_argument("--queued", action="store_true", help="create the slice through a queued resource")
  p.add_argument("--poll_seconds", type=float, default=30.0,
                 help="how often to check the state of a slice being waited for (a queued resource "
                      "becoming ACTIVE, a STOPPING slice settling)")
  p.add_argument("--dry_run", action="store_true")
  p.add_argument("--repo_url", help="setup: git clone this instead of copying the local tree")
  p.add_argument("--branch", help="setup: branch or tag of --repo_url")
  p.add_argument("--wheel_cache", help="setup, run: gs:// folder of the install's wheels, filled by the first setup "
                                       "and installed from offline by later ones")
  p.add_argument("--python", default="3.11",
                 help="setup, run: the least Python version of the hosts' virtual environment (setup.py needs 3.11); "
                      "a host whose python3 is older gets this version through uv")
  p.add_argument("--gin_file", action="append", default=[], help="run: repeatable")
  p.add_argument("--gin_bindings", action="append", default=[], help="run: KEY=VALUE, repeatable")
  p.add_argument("--model_dir", help="run: gs:// directory for checkpoints and metrics")
  p.add_argument("--restart_on_preemption", action="store_true")
  p.add_argument("--max_restarts", type=int, default=10)
  p.add_argument("--preemption_grace_seconds", type=float, default=90.0,
                 help="run: when the run ends on a READY slice, look at it again after this long before "
                      "deciding it was not preempted (GCE gives 30 s of notice); 0 = don't look again")
  p.add_argument("--max_settle_seconds", type=float, default=1800.0,
                 help="run: how long to wait for a slice in a passing state (STOPPING, REPAIRING...) to "
                      "become READY or lost")
  p.add_argument("--worker", default="0", help="logs: which host's log to print")
  p.add_argument("--follow", action="store_true", help="logs: keep printing new lines")
  return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """Returns the flags and the arguments after `--` (passed through to pretrain.train)."""
  extra = []
  if "--" in argv:
    argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1:]
  parser = _parser()
  args = parser.parse_args(argv)
  problem = _problem_with(args, extra)
  if problem:
    parser.error(problem)
  return args, extra


def _problem_with(args: argparse.Namespace, extra: list[str]) -> str | None:
  needs_accelerator = args.command == "create" or (args.command == "run" and args.restart_on_preemption)
  if not _SLICE_NAME.fullmatch(args.name):
    return f"--name={args.name!r} is not a valid TPU name (lowercase letters, digits and '-')"
  if args.accelerator_type and not _ACCELERATOR_TYPE.fullmatch(args.accelerator_type):
    return f"--accelerator_type={args.accelerator_type!r} is not like v3-512"
  if needs_accelerator and not args.accelerator_type:
    return f"--accelerator_type is required to create the slice ({args.command})"
  if needs_accelerator and not args.runtime_version and runtimes.runtime_for(args.accelerator_type) is None:
    return (f"no known runtime for TPU {runtimes.chip(args.accelerator_type)!r} (--accelerator_type="
            f"{args.accelerator_type}; known: {', '.join(runtimes.RUNTIME_BY_CHIP)}); give --runtime_version")
  if args.spot and args.preemptible:
    return "--spot and --preemptible are exclusive"
  if args.queued and args.preemptible:
    return "--preemptible is not available with --queued; use --spot"
  if args.branch and not args.repo_url:
    return "--branch needs --repo_url"
  if min(args.max_restarts, args.poll_seconds, args.preemption_grace_seconds, args.max_settle_seconds) < 0:
    return "--max_restarts, --poll_seconds, --preemption_grace_seconds and --max_settle_seconds must be >= 0"
  if not _PYTHON_VERSION.fullmatch(args.python):
    return f"--python={args.python!r} is not a Python version like 3.11"
  if args.wheel_cache and not args.wheel_cache.startswith("gs://"):
    return f"--wheel_cache must be a gs:// URL that every host can read (got {args.wheel_cache!r})"
  if args.command == "run":
    if not (args.model_dir or "").startswith("gs://"):
      return (f"--model_dir must be a gs:// URL so every host reads and writes the same checkpoints "
              f"(got {args.model_dir!r})")
    bad = [b for b in args.gin_bindings if "=" not in b]
    if bad:
      return f"--gin_bindings={bad[0]!r} is not KEY=VALUE"
  elif extra:
    return f"arguments after -- are only used by run, not {args.command}"
  return None


def _target(args) -> gcloud.Slice:
  return gcloud.Slice(args.name, args.zone, args.project)


def _must(runner: gcloud.Runner, argv: list[str], what: str) -> None:
  code = runner.run(argv)
  if code != 0:
    raise LaunchError(f"{what} failed (gcloud exit code {code})")


def create(args, runner: gcloud.Runner) -> None:
  target = _target(args)
  runtime = args.runtime_version or runtimes.runtime_for(args.accelerator_type)
  if args.queued:
    _must(runner, gcloud.create_queued_resource(target, args.accelerator_type, runtime, spot=args.spot),
          f"creating queued resource {args.name}")
    _wait_until_active(args, runner)
  else:
    _must(runner, gcloud.create_tpu_vm(target, args.accelerator_type, runtime,
                                       spot=args.spot, preemptible=args.preemptible),
          f"creating slice {args.name}")


def _wait_until_active(args, runner: gcloud.Runner) -> None:
  """`queued-resources create` returns once the request is queued; the hosts exist only when ACTIVE."""
  if runner.dry_run:
    return
  last_state = None
  while True:
    state = _state(args, runner)
    if state == "ACTIVE":
      return
    if state is None or state in LOST_QUEUED_RESOURCE_STATES:
      raise LaunchError(f"queued resource {args.name} is {state or 'gone'} instead of ACTIVE")
    if state != last_state:
      print(f"queued resource {args.name} is {state}; waiting for ACTIVE", flush=True)
      last_state = state
    time.sleep(args.poll_seconds)


def _state(args, runner: gcloud.Runner) -> str | None:
  """The queued resource's state with --queued, else the TPU VM's; None when it does not exist."""
  if args.queued:
    done = runner.capture(gcloud.describe_queued_resource(_target(args), "value(state.state)"))
  else:
    done = runner.capture(gcloud.describe_tpu_vm(_target(args), "value(state)"))
  if done.returncode == 0:
    return done.stdout.strip()
  if "NOT_FOUND" in done.stderr:
    return None
  # Anything else (auth, network) says nothing about the slice: never recreate on a guess.
  reason = (done.stderr.strip().splitlines() or [f"gcloud exit code {done.returncode}"])[-1]
  raise LaunchError(f"checking the state of {args.name} failed: {reason}")


def setup(args, runner: gcloud.Runner) -> None:
  target = _target(args)
  install = hosts.install_command(args.wheel_cache, args.python)
  if args.repo_url:
    branch = f"--branch={shlex.quote(args.branch)} " if args.branch else ""
    clone = (f"rm -rf {hosts.REMOTE_DIR} && git clone --depth=1 {branch}{shlex.quote(args.repo_url)} "
             f"{hosts.REMOTE_DIR}")
    _must(runner, gcloud.ssh(target, f"{clone} && {install}"), "cloning the project on the hosts")
  else:
    with tempfile.TemporaryDirectory() as staging:
      tree = pathlib.Path(staging) / hosts.REMOTE_DIR_NAME
      shutil.copytree(PROJECT_ROOT, tree, symlinks=True, ignore=shutil.ignore_patterns(*LOCAL_TREE_EXCLUDES))
      _must(runner, gcloud.scp_to_workers(target, str(tree), "~/"), "copying the project to the hosts")
    _must(runner, gcloud.ssh(target, install), "installing the project on the hosts")
  if args.wheel_cache:
    _must(runner, gcloud.ssh(target, hosts.fill_wheel_cache_command(args.wheel_cache), worker="0"),
          f"filling the wheel cache {args.wheel_cache}")


def train_command(args, extra: list[str]) -> str:
  """The shell command each host runs for `run`."""
  train = ["-m", "pretrain.train"] + [f"--gin_file={f}" for f in args.gin_file]
  train += [f'--gin.MODEL_DIR="{args.model_dir}"'] + [f"--gin.{b}" for b in args.gin_bindings] + extra
  # nohup keeps training alive if the ssh session drops; tail follows the log until training exits
  # and `wait` hands its exit code back through ssh, so we know when and how the run ended. The python's
  # path is left unquoted for the host's shell to expand.
  return (f"cd {hosts.REMOTE_DIR} || exit 1; : > {REMOTE_LOG}; "
          f"nohup {hosts.REMOTE_PYTHON} {shlex.join(train)} >> {REMOTE_LOG} 2>&1 < /dev/null & pid=$!; "
          f"tail -n +1 -f --pid=$pid {REMOTE_LOG}; wait $pid")


def _up_states(args) -> frozenset[str]:
  return UP_QUEUED_RESOURCE_STATES if args.queued else UP_TPU_VM_STATES


def _lost_states(args) -> frozenset[str]:
  return LOST_QUEUED_RESOURCE_STATES if args.queued else LOST_TPU_VM_STATES


def _settled_state(args, runner: gcloud.Runner) -> str | None:
  """The slice's state once it is up or lost (None: gone), polling while it is in a passing state."""
  deadline = time.monotonic() + args.max_settle_seconds
  state, reported = _state(args, runner), None
  while state is not None and state not in _up_states(args) | _lost_states(args) | {STOPPED_STATE}:
    if state != reported:
      print(f"slice {args.name} is {state}; waiting for it to settle", flush=True)
      reported = state
    if time.monotonic() >= deadline:
      raise LaunchError(f"slice {args.name} is still {state} after {args.max_settle_seconds:g} s "
                        f"(--max_settle_seconds); not restarting")
    time.sleep(args.poll_seconds)
    state = _state(args, runner)
  return state


def _state_after_run(args, code: int, runner: gcloud.Runner) -> str | None:
  """The settled state of the slice the run just ended on, given time to show a preemption."""
  state = _settled_state(args, runner)
  if state in _up_states(args) and args.preemption_grace_seconds > 0:
    # A preemption notice gives the hosts ~30 s before they stop; the trainer saves and exits 0 (or
    # ssh drops) within them, while the TPU API still says READY. Only a later look tells them apart.
    print(f"run exited with code {code} on a {state} slice; looking again in "
          f"{args.preemption_grace_seconds:g} s in case it is being preempted", flush=True)
    time.sleep(args.preemption_grace_seconds)
    state = _settled_state(args, runner)
  return state


def run(args, extra: list[str], runner: gcloud.Runner) -> int:
  events = run_events.RunEvents(args.model_dir, runner)
  try:
    return _run_until_done(args, gcloud.ssh(_target(args), train_command(args, extra)), events, runner)
  finally:  # a launcher that stops in a restart leaves that restart's records too
    events.write()


def _run_until_done(args, command: list[str], events: run_events.RunEvents, runner: gcloud.Runner) -> int:
  """Runs `command`, and with --restart_on_preemption recreates a preempted slice and runs it again."""
  restarts = 0
  while True:
    code = runner.run(command)
    if not args.restart_on_preemption or runner.dry_run:  # a dry run has no slice to look at
      return code
    state = _state_after_run(args, code, runner)
    if state in _up_states(args):
      if code == 0:
        print(f"run finished (slice {args.name} is still {state})", flush=True)
      else:  # a training failure, not a preemption: restarting would only repeat it
        print(f"launch.tpu: run exited with code {code} on a {state} slice; not restarting", file=sys.stderr)
      return code
    if state == STOPPED_STATE:
      raise LaunchError(f"slice {args.name} was stopped, not preempted; not restarting: start it "
                        "(gcloud compute tpus tpu-vm start) and run again to resume")
    events.record(run_events.PREEMPTION_DETECTED, state=state or "gone", exit_code=code)
    what = f"preempted ({state})" if state else "is gone"
    if restarts == args.max_restarts:
      raise LaunchError(f"slice {args.name} {what}; giving up after {restarts} restarts (--max_restarts)")
    restarts += 1
    print(f"slice {args.name} {what}, recreating (restart {restarts}/{args.max_restarts})", flush=True)
    if state is not None:
      with events.timed(run_events.DELETE):
        delete(args, runner)
    with events.timed(run_events.CREATE):
      create(args, runner)
    with events.timed(run_events.SETUP):
      setup(args, runner)
    print(f"slice {args.name} recreated; running again, training resumes from {args.model_dir}", flush=True)
    events.record(run_events.TRAIN_COMMAND)
    events.write()


def status(args, runner: gcloud.Runner) -> int:
  target = _target(args)
  return runner.run(gcloud.describe_queued_resource(target) if args.queued else gcloud.describe_tpu_vm(target))


def logs(args, runner: gcloud.Runner) -> int:
  show = f"tail -n +1 -f {REMOTE_LOG}" if args.follow else f"cat {REMOTE_LOG}"
  return runner.run(gcloud.ssh(_target(args), show, worker=args.worker))


def delete(args, runner: gcloud.Runner) -> None:
  target = _target(args)
  _must(runner, gcloud.delete_queued_resource(target) if args.queued else gcloud.delete_tpu_vm(target),
        f"deleting slice {args.name}")


def main(argv: list[str]) -> int:
  args, extra = parse_args(argv)
  if not args.dry_run and shutil.which("gcloud") is None:
    print("launch.tpu: error: gcloud not found on PATH; install the Google Cloud SDK or use --dry_run",
          file=sys.stderr)
    return 2
  runner = gcloud.Runner(dry_run=args.dry_run)
  try:
    if args.command == "run":
      return run(args, extra, runner)
    if args.command == "status":
      return status(args, runner)
    if args.command == "logs":
      return logs(args, runner)
    {"create": create, "setup": setup, "delete": delete}[args.command](args, runner)
    return 0
  except LaunchError as e:
    print(f"launch.tpu: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
