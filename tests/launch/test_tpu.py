"""launch.tpu against a recording stand-in `gcloud` and a simulated host: exact command lines, what the hosts run
to install, the preemption restart loop and its goodput records, errors."""
import json
import os
import pathlib
import re
import sys

import pytest

from helpers import run_module
from launch import hosts, run_events
from pretrain import goodput

SLICE = ["--name=pod", "--zone=europe-west4-a"]
ZONE = "--zone=europe-west4-a"
INSTALL = hosts.install_command(None, "3.11")
WHEEL_CACHE = "gs://bucket/wheels"
TRAIN = ("cd ~/pod-pretrain || exit 1; : > ~/pod-pretrain.log; "
         "nohup $HOME/.pod-pretrain-venv/bin/python -m pretrain.train --gin_file=gin_configs/runs/a.gin "
         "--gin_file=b.gin "
         "'--gin.MODEL_DIR=\"gs://bucket/run1\"' --gin.TRAIN_STEPS=100 --seed=3 "
         ">> ~/pod-pretrain.log 2>&1 < /dev/null & pid=$!; "
         "tail -n +1 -f --pid=$pid ~/pod-pretrain.log; wait $pid")
RUN_FLAGS = ["--gin_file=gin_configs/runs/a.gin", "--gin_file=b.gin", "--model_dir=gs://bucket/run1",
             "--gin_bindings=TRAIN_STEPS=100"]
# What the simulated host runs (its home shown as HOME) to make the environment and install in it.
VENV_PYTHON = "HOME/.pod-pretrain-venv/bin/python"
AT_LEAST_3_11 = "-c import sys; sys.exit(sys.version_info < (3, 11))"
UV_VENV_3_11 = [f"python3 {AT_LEAST_3_11}", "python3 -m pip install --user uv",
                "python3 -m uv venv --seed --python=3.11 HOME/.pod-pretrain-venv"]
FINGERPRINT = f"{VENV_PYTHON} -V"
PIP_INSTALL = f"{VENV_PYTHON} -m pip install -e .[tpu]"
# Restarting without the second look at a READY slice, for tests about what comes before or after it.
RESTART_AT_ONCE = ["--accelerator_type=v3-512", "--restart_on_preemption", "--preemption_grace_seconds=0"]

# Logs each call as a JSON line (in $FAKE_HOST_LOG when a host calls it). Calls with --format (state checks) print
# the next line of the states file (the last line repeats; "!REASON" fails with "ERROR: REASON" on stderr, as gcloud
# does). `storage cp` copies between local paths and gs://BUCKET/PATH, kept as $FAKE_GCS/BUCKET/PATH. The slice is
# one simulated host, a home directory that create and delete empty: scp copies there, and ssh runs the command
# there with bash, with the fake python3 (and uv) and git of HOST_TOOL. The Nth ssh running pretrain.train appends
# a start's goodput records to its MODEL_DIR and exits with the Nth code in $FAKE_TRAIN_RCS (the last repeats); one
# reading the log does nothing. An scp records what the staged source directory holds.
STAND_IN = """#!{python}
import glob, json, os, re, shutil, subprocess, sys, time, uuid
argv = sys.argv[1:]
home = os.environ["FAKE_HOST_HOME"]
local = lambda path: os.path.join(os.environ["FAKE_GCS"], path[len("gs://"):]) if path.startswith("gs://") else path
entry = {{"argv": argv}}
if argv[:2] != ["storage", "cp"] and argv[3] == "scp":
  entry["staged"] = sorted(os.listdir(argv[4]))
with open(os.environ["FAKE_HOST_LOG" if "FAKE_ON_HOST" in os.environ else "FAKE_GCLOUD_LOG"], "a") as log:
  log.write(json.dumps(entry) + "\\n")
if argv[:2] == ["storage", "cp"]:
  *sources, destination = [a for a in argv[2:] if not a.startswith("--")]
  sources = [p for source in sources for p in glob.glob(local(source))]
  if not sources:
    sys.exit("ERROR: (gcloud.storage.cp) The following URLs matched no objects or files")
  for source in sources:
    target = local(destination) + (os.path.basename(source) if destination.endswith("/") else "")
    if not ("--no-clobber" in argv and os.path.exists(target)):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.copy(source, target)
  sys.exit(0)
if any(a.startswith("--format=") for a in argv):
  path = os.environ["FAKE_GCLOUD_STATES"]
  states = open(path).read().split()
  if len(states) > 1:
    open(path, "w").write("\\n".join(states[1:]))
  if states[0].startswith("!"):
    sys.exit("ERROR: (gcloud.compute.tpus) " + states[0][1:])
  print(states[0])
elif argv[3] in ("create", "delete"):
  shutil.rmtree(home)
  os.mkdir(home)
elif argv[3] == "scp":
  shutil.copytree(argv[4], os.path.join(home, os.path.basename(argv[4])), dirs_exist_ok=True)
elif argv[3] == "ssh" and "pretrain.train" in argv[-1]:
  start = uuid.uuid4().hex
  with open(os.path.join(local(re.search('MODEL_DIR="([^"]+)"', argv[-1])[1]), "goodput.jsonl"), "a") as records:
    for kind in ("start", "end"):
      record = {{"start": start, "kind": kind, "time": time.time(), "how": "preempted", "step": 0}}
      records.write(json.dumps(record) + "\\n")
  codes = os.environ["FAKE_TRAIN_RCS"].split()
  runs = sum("pretrain.train" in line for line in open(os.environ["FAKE_GCLOUD_LOG"]))
  sys.exit(int(codes[min(runs, len(codes)) - 1]))
elif argv[3] == "ssh" and "pod-pretrain.log" not in argv[-1]:
  host_path = os.environ["FAKE_HOST_BIN"] + os.pathsep + os.environ["PATH"]
  env = dict(os.environ, HOME=home, PATH=host_path, FAKE_ON_HOST="1")
  sys.exit(subprocess.run(["bash", "-c", argv[-1][len("--command="):]], env=env).returncode)
"""
# The host's python3 and git (only `clone`), and the python of each virtual environment, logging to $FAKE_HOST_LOG
# (a python in the home by its path, others by name). A python is Python $FAKE_HOST_PYTHON_VERSION, or its
# environment's version; `-c CODE` runs CODE with that sys.version_info. `-m venv DIR`, and uv's
# `-m uv venv --python=VERSION DIR`, make an environment whose python is this script (`-m pip install --user uv`
# does nothing). `pip wheel` builds two wheels into --wheel-dir; `pip install --no-index` fails unless --find-links
# holds a wheel.
HOST_TOOL = """#!{python}
import glob, json, os, shutil, sys
me = sys.argv[0]
argv = [me if me.startswith(os.environ["HOME"] + os.sep) else os.path.basename(me)] + sys.argv[1:]
with open(os.environ["FAKE_HOST_LOG"], "a") as log:
  log.write(json.dumps({{"argv": argv}}) + "\\n")
flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
venv_version = os.path.join(os.path.dirname(os.path.dirname(me)), "version")
version = open(venv_version).read() if os.path.exists(venv_version) else os.environ["FAKE_HOST_PYTHON_VERSION"]

def make_venv(path, version):
  os.makedirs(os.path.join(path, "bin"))
  shutil.copy(me, os.path.join(path, "bin", "python"))
  open(os.path.join(path, "version"), "w").write(version)

if argv[0] == "git":
  os.makedirs(os.path.expanduser(argv[-1]))
  open(os.path.join(os.path.expanduser(argv[-1]), "setup.py"), "w").write("cloned")
elif argv[1] == "-c":
  sys.version_info = tuple(map(int, version.split(".")))
  exec(argv[2])
elif argv[1] == "-V":
  print("Python " + version)
elif argv[1:3] == ["-m", "venv"]:
  make_venv(argv[-1], version)
elif argv[1:4] == ["-m", "uv", "venv"]:
  make_venv(argv[-1], flags["--python"])
elif argv[1:4] == ["-m", "pip", "wheel"]:
  for name in ("dep-1.0-py3-none-any.whl", "pod_pretrain-0.1.0-py3-none-any.whl"):
    open(os.path.join(flags["--wheel-dir"], name), "w").close()
elif "--no-index" in argv and not glob.glob(os.path.join(flags["--find-links"], "*.whl")):
  sys.exit("ERROR: No matching distribution found for dep")
"""


def _script(path: pathlib.Path, text: str) -> None:
  path.write_text(text.format(python=sys.executable))
  path.chmod(0o755)


class FakeGcloud:

  def __init__(self, tmp_path: pathlib.Path):
    bin_dir, host_bin = tmp_path / "bin", tmp_path / "host_bin"
    bin_dir.mkdir()
    host_bin.mkdir()
    _script(bin_dir / "gcloud", STAND_IN)
    for tool in ("python3", "git"):
      _script(host_bin / tool, HOST_TOOL)
    self.log, self.host_log = tmp_path / "calls.jsonl", tmp_path / "host_calls.jsonl"
    self.states = tmp_path / "states"
    self.bucket = tmp_path / "gcs" / "bucket"
    (self.bucket / "run1").mkdir(parents=True)
    self.host_home = tmp_path / "host"
    self.host_home.mkdir()
    self.env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_GCLOUD_LOG": str(self.log),
                "FAKE_GCLOUD_STATES": str(self.states), "FAKE_GCS": str(tmp_path / "gcs"),
                "FAKE_HOST_HOME": str(self.host_home), "FAKE_HOST_BIN": str(host_bin),
                "FAKE_HOST_LOG": str(self.host_log), "FAKE_HOST_PYTHON_VERSION": "3.10"}

  def launch(self, *args, states=("READY",), train_rc=0, path=None):
    """train_rc: the exit code of every run, or a tuple of each run's in turn."""
    self.states.write_text("\n".join(states))
    env = dict(self.env, FAKE_TRAIN_RCS=" ".join(map(str, train_rc if isinstance(train_rc, tuple) else [train_rc])))
    if path is not None:
      env["PATH"] = path
    return run_module("launch.tpu", *args, env=env, timeout=60)

  def entries(self, log=None):
    log = log or self.log
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

  def calls(self):
    return [e["argv"] for e in self.entries()]

  def host_calls(self):
    """What the host ran since the last call, each as one line with its home as HOME; then forgets them."""
    calls = [" ".join(e["argv"]).replace(str(self.host_home), "HOME") for e in self.entries(self.host_log)]
    self.host_log.unlink(missing_ok=True)
    return calls


@pytest.fixture
def gcloud(tmp_path):
  return FakeGcloud(tmp_path)


def tpus(*words):
  return ["compute", "tpus", *words]


def verb(call):
  return " ".join(call[:2]) if call[0] == "storage" else f"{call[2]} {call[3]}"


@pytest.mark.parametrize("flags, expected_tail", [
    ([], []),
    (["--spot"], ["--spot"]),
    (["--preemptible", "--project=my-proj"], ["--preemptible"]),
])
def test_create_tpu_vm(gcloud, flags, expected_tail):
  done = gcloud.launch("create", *SLICE, "--accelerator_type=v3-512", *flags)
  assert done.returncode == 0, done.stderr
  project = [f for f in flags if f.startswith("--project")]
  assert gcloud.calls() == [tpus("tpu-vm", "create", "pod", ZONE, *project, "--accelerator-type=v3-512",
                                 "--version=tpu-ubuntu2204-base", *expected_tail)]


@pytest.mark.parametrize("accelerator_type, runtime", [
    ("v2-8", "tpu-ubuntu2204-base"), ("v3-512", "tpu-ubuntu2204-base"), ("v4-128", "tpu-ubuntu2204-base"),
    ("v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-8", "v2-alpha-tpuv5"), ("v6e-8", "v2-alpha-tpuv6e"),
])
def test_create_asks_for_the_chips_runtime(gcloud, tmp_path, accelerator_type, runtime):
  done = gcloud.launch("create", *SLICE, f"--accelerator_type={accelerator_type}", "--dry_run", path=str(tmp_path))
  assert done.returncode == 0, done.stderr
  assert done.stdout == (f"+ gcloud compute tpus tpu-vm create pod --zone=europe-west4-a "
                         f"--accelerator-type={accelerator_type} --version={runtime}\n")


def test_create_queued_waits_until_active(gcloud):
  done = gcloud.launch("create", *SLICE, "--accelerator_type=v3-512", "--queued", "--spot",
                       "--runtime_version=v2-alpha", "--poll_seconds=0",
                       states=("WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"))
  assert done.returncode == 0, done.stderr
  describe = tpus("queued-resources", "describe", "pod", ZONE, "--format=value(state.state)")
  assert gcloud.calls() == [
      tpus("queued-resources", "create", "pod", ZONE, "--node-id=pod", "--accelerator-type=v3-512",
           "--runtime-version=v2-alpha", "--spot"),
      describe, describe, describe,
  ]
  assert "queued resource pod is WAITING_FOR_RESOURCES; waiting for ACTIVE" in done.stdout


def test_setup_copies_local_tree_and_installs(gcloud):
  done = gcloud.launch("setup", *SLICE)
  assert done.returncode == 0, done.stderr
  (scp, install) = gcloud.entries()
  assert re.fullmatch(r".+/pod-pretrain", scp["argv"][4])
  assert scp["argv"][:4] + scp["argv"][5:] == tpus("tpu-vm", "scp") + ["pod:~/", ZONE, "--worker=all", "--recurse"]
  assert {"launch", "setup.py"} <= set(scp["staged"])
  assert not {".venv", ".git"} & set(scp["staged"])
  assert install["argv"] == tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=all", f"--command={INSTALL}")
  assert gcloud.host_calls() == [*UV_VENV_3_11, FINGERPRINT, PIP_INSTALL]  # the host's python3 is 3.10
  # The same setup.py and Python on the same host: nothing to make or install.
  done = gcloud.launch("setup", *SLICE)
  assert done.returncode == 0, done.stderr
  assert gcloud.host_calls() == [f"{VENV_PYTHON} {AT_LEAST_3_11}", FINGERPRINT]
  assert "pod-pretrain: already installed for this setup.py and Python" in done.stdout
  (gcloud.host_home / "pod-pretrain" / "setup.py").write_text("changed")  # as a changed tree's copy would be
  done = gcloud.launch("setup", *SLICE, "--repo_url=https://example.com/pod-pretrain.git")
  assert done.returncode == 0, done.stderr
  assert gcloud.host_calls()[-2:] == [FINGERPRINT, PIP_INSTALL]
  # Another Python: a new environment, and the install in it.
  done = gcloud.launch("setup", *SLICE, "--python=3.12")
  assert done.returncode == 0, done.stderr
  assert gcloud.host_calls()[-3:] == ["python3 -m uv venv --seed --python=3.12 HOME/.pod-pretrain-venv",
                                      FINGERPRINT, PIP_INSTALL]


@pytest.mark.parametrize("host_python, made_with", [
    ("3.10", UV_VENV_3_11[1:]),  # tpu-ubuntu2204-base's
    ("3.12", ["python3 -m venv HOME/.pod-pretrain-venv"]),
])
def test_setup_makes_a_venv_that_run_trains_with(gcloud, host_python, made_with):
  gcloud.env["FAKE_HOST_PYTHON_VERSION"] = host_python
  assert gcloud.launch("setup", *SLICE).returncode == 0
  assert gcloud.host_calls() == [f"python3 {AT_LEAST_3_11}", *made_with, FINGERPRINT, PIP_INSTALL]
  assert gcloud.launch("run", *SLICE, *RUN_FLAGS).returncode == 0
  train = gcloud.calls()[-1][-1]
  python = re.search(r"nohup (\S+) -m pretrain.train ", train)[1].replace("$HOME", str(gcloud.host_home))
  assert os.access(python, os.X_OK) and python == VENV_PYTHON.replace("HOME", str(gcloud.host_home))


def test_setup_with_a_wheel_cache_fills_it_once_and_installs_offline_from_it(gcloud):
  done = gcloud.launch("setup", *SLICE, f"--wheel_cache={WHEEL_CACHE}")
  assert done.returncode == 0, done.stderr
  offline = f"{VENV_PYTHON} -m pip install --no-index --find-links=HOME/.pod-pretrain-wheels -e .[tpu]"
  cache_get = f"storage cp {WHEEL_CACHE}/*.whl HOME/.pod-pretrain-wheels/"
  assert gcloud.host_calls() == [
      *UV_VENV_3_11, FINGERPRINT, cache_get, offline,  # the cache is empty: the offline install fails
      f"{VENV_PYTHON} -m pip wheel --wheel-dir=HOME/.pod-pretrain-wheels --find-links=HOME/.pod-pretrain-wheels "
      "setuptools wheel .[tpu]", offline,
      f"storage cp --no-clobber HOME/.pod-pretrain-wheels/dep-1.0-py3-none-any.whl {WHEEL_CACHE}/"]  # worker 0
  assert "pod-pretrain: building the wheels the cache lacks" in done.stdout
  assert os.listdir(gcloud.bucket / "wheels") == ["dep-1.0-py3-none-any.whl"]  # not the project's own wheel
  assert gcloud.calls()[-1] == tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=0",
                                    f"--command={hosts.fill_wheel_cache_command(WHEEL_CACHE)}")


def test_setup_clones_repo_url(gcloud):
  done = gcloud.launch("setup", *SLICE, "--repo_url=https://example.com/pod-pretrain.git", "--branch=v1")
  assert done.returncode == 0, done.stderr
  clone = ("rm -rf ~/pod-pretrain && git clone --depth=1 --branch=v1 https://example.com/pod-pretrain.git "
           "~/pod-pretrain && " + INSTALL)
  assert gcloud.calls() == [tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=all", f"--command={clone}")]


def test_run_starts_training_on_all_workers(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--", "--seed=3", train_rc=5)
  assert done.returncode == 5  # the training exit code comes back through ssh
  assert gcloud.calls() == [tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=all", f"--command={TRAIN}")]


def test_run_recreates_preempted_slice_and_runs_again(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, "--spot", "--max_restarts=3", "--", "--seed=3",
                       states=("PREEMPTED", "READY"))
  assert done.returncode == 0, done.stderr
  run = tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=all", f"--command={TRAIN}")
  describe = tpus("tpu-vm", "describe", "pod", ZONE, "--format=value(state)")
  calls = gcloud.calls()
  assert calls[:4] == [run, describe, tpus("tpu-vm", "delete", "pod", ZONE, "--quiet"),
                       tpus("tpu-vm", "create", "pod", ZONE, "--accelerator-type=v3-512",
                            "--version=tpu-ubuntu2204-base", "--spot")]
  assert calls[4][3] == "scp"
  assert calls[5] == tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=all", f"--command={INSTALL}")
  assert calls[6][:3] == ["storage", "cp", calls[6][2]] and calls[6][3].startswith("gs://bucket/run1/goodput_launcher/")
  assert calls[7:] == [run, describe]
  assert "slice pod preempted (PREEMPTED), recreating (restart 1/3)" in done.stdout


def test_run_recreates_vanished_queued_slice_without_deleting(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, "--queued", "--poll_seconds=0", "--", "--seed=3",
                       states=("!NOT_FOUND", "ACTIVE"))
  assert done.returncode == 0, done.stderr
  verbs = [verb(c) for c in gcloud.calls()]
  assert verbs == ["tpu-vm ssh", "queued-resources describe", "queued-resources create",
                   "queued-resources describe", "tpu-vm scp", "tpu-vm ssh", "storage cp", "tpu-vm ssh",
                   "queued-resources describe"]
  assert "slice pod is gone, recreating (restart 1/10)" in done.stdout


def test_run_gives_up_after_max_restarts(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--accelerator_type=v3-512", "--restart_on_preemption",
                       "--max_restarts=1", states=("PREEMPTED",))
  assert done.returncode == 1
  assert done.stderr.splitlines() == [
      "launch.tpu: error: slice pod preempted (PREEMPTED); giving up after 1 restarts (--max_restarts)"]
  assert [c[3] for c in gcloud.calls()].count("create") == 1


def test_run_failure_on_healthy_slice_is_not_restarted(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--accelerator_type=v3-512", "--restart_on_preemption",
                       "--preemption_grace_seconds=0.01", states=("READY",), train_rc=3)
  assert done.returncode == 3
  assert [c[3] for c in gcloud.calls()] == ["ssh", "describe", "describe"]  # READY again after the grace
  assert "run exited with code 3 on a READY slice; not restarting" in done.stderr


@pytest.mark.parametrize("flags, states, lost", [
    ([], ("READY", "PREEMPTED", "READY"), "PREEMPTED"),
    (["--queued"], ("ACTIVE", "SUSPENDED", "ACTIVE"), "SUSPENDED"),
])
def test_run_restarts_slice_preempted_after_training_exits_0(gcloud, flags, states, lost):
  # The trainer saves and exits 0 on the preemption notice, while the slice still reads READY (ACTIVE).
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--accelerator_type=v3-512", "--restart_on_preemption",
                       "--preemption_grace_seconds=0.01", "--poll_seconds=0", *flags, states=states)
  assert done.returncode == 0, done.stderr
  verbs = [c[3] for c in gcloud.calls()]
  assert verbs[:4] == ["ssh", "describe", "describe", "delete"]
  assert verbs.count("create") == 1 and verbs[-3:] == ["ssh", "describe", "describe"]
  up = states[0]
  assert f"run exited with code 0 on a {up} slice; looking again in 0.01 s in case it is being preempted" \
      in done.stdout
  assert f"slice pod preempted ({lost}), recreating (restart 1/10)" in done.stdout
  assert done.stdout.count("run finished") == 1  # only after the second run
  assert done.stdout.strip().endswith(f"run finished (slice pod is still {up})")


def test_run_restarts_slice_that_goes_from_stopping_to_preempted_after_ssh_drops(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, "--poll_seconds=0",
                       states=("STOPPING", "STOPPING", "PREEMPTED", "READY"), train_rc=(255, 0))
  assert done.returncode == 0, done.stderr
  verbs = [c[3] for c in gcloud.calls()]
  assert verbs[:5] == ["ssh", "describe", "describe", "describe", "delete"]
  assert verbs.count("create") == 1
  assert done.stdout.count("slice pod is STOPPING; waiting for it to settle") == 1
  assert "slice pod preempted (PREEMPTED), recreating (restart 1/10)" in done.stdout
  assert "run finished (slice pod is still READY)" in done.stdout


def test_run_waits_for_stopping_slice_and_finishes_when_it_is_ready_again(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--accelerator_type=v3-512", "--restart_on_preemption",
                       "--preemption_grace_seconds=0.01", "--poll_seconds=0", states=("STOPPING", "READY"))
  assert done.returncode == 0, done.stderr
  assert [c[3] for c in gcloud.calls()] == ["ssh", "describe", "describe", "describe"]
  assert [line for line in done.stdout.splitlines() if not line.startswith("+ ")] == [
      "slice pod is STOPPING; waiting for it to settle",
      "run exited with code 0 on a READY slice; looking again in 0.01 s in case it is being preempted",
      "run finished (slice pod is still READY)"]


def test_run_gives_up_on_a_slice_that_does_not_settle(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, "--poll_seconds=0.05",
                       "--max_settle_seconds=0.2", states=("REPAIRING",), train_rc=255)
  assert done.returncode == 1
  assert done.stderr.splitlines() == [
      "launch.tpu: error: slice pod is still REPAIRING after 0.2 s (--max_settle_seconds); not restarting"]
  assert done.stdout.count("slice pod is REPAIRING; waiting for it to settle") == 1
  assert "create" not in [c[3] for c in gcloud.calls()]


def test_run_does_not_recreate_a_slice_that_someone_stopped(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, "--poll_seconds=0.05",
                       states=("STOPPING", "STOPPED"), train_rc=255)
  assert done.returncode == 1
  assert done.stderr.splitlines()[-1].startswith("launch.tpu: error: slice pod was stopped, not preempted; not "
                                                 "restarting")
  assert "create" not in [c[3] for c in gcloud.calls()]


def test_run_does_not_recreate_when_state_is_unknown(gcloud):
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--accelerator_type=v3-512", "--restart_on_preemption",
                       states=("!PERMISSION_DENIED",), train_rc=255)
  assert done.returncode == 1
  assert done.stderr.splitlines() == [
      "launch.tpu: error: checking the state of pod failed: ERROR: (gcloud.compute.tpus) PERMISSION_DENIED"]
  assert [c[3] for c in gcloud.calls()] == ["ssh", "describe"]


@pytest.mark.parametrize("args, expected", [
    (["status"], tpus("tpu-vm", "describe", "pod", ZONE)),
    (["status", "--queued"], tpus("queued-resources", "describe", "pod", ZONE)),
    (["logs"], tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=0", "--command=cat ~/pod-pretrain.log")),
    (["logs", "--worker=3", "--follow"],
     tpus("tpu-vm", "ssh", "pod", ZONE, "--worker=3", "--command=tail -n +1 -f ~/pod-pretrain.log")),
    (["delete"], tpus("tpu-vm", "delete", "pod", ZONE, "--quiet")),
    (["delete", "--queued"], tpus("queued-resources", "delete", "pod", ZONE, "--force", "--quiet")),
])
def test_status_logs_delete(gcloud, args, expected):
  done = gcloud.launch(args[0], *SLICE, *args[1:])
  assert done.returncode == 0, done.stderr
  assert gcloud.calls() == [expected]


def test_dry_run_prints_commands_without_gcloud(gcloud, tmp_path):
  done = gcloud.launch("create", *SLICE, "--accelerator_type=v3-512", "--spot", "--dry_run", path=str(tmp_path))
  assert done.returncode == 0, done.stderr
  assert done.stdout == ("+ gcloud compute tpus tpu-vm create pod --zone=europe-west4-a "
                         "--accelerator-type=v3-512 --version=tpu-ubuntu2204-base --spot\n")
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, "--dry_run", "--", "--seed=3", path=str(tmp_path))
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("+ gcloud compute tpus tpu-vm ssh pod --zone=europe-west4-a --worker=all ")
  assert "nohup $HOME/.pod-pretrain-venv/bin/python -m pretrain.train " in done.stdout
  assert gcloud.calls() == []


@pytest.mark.parametrize("args, message", [
    (["create", *SLICE, "--accelerator_type=v3-512"],
     "launch.tpu: error: gcloud not found on PATH; install the Google Cloud SDK or use --dry_run"),
    (["run", *SLICE, "--model_dir=/tmp/run1", "--dry_run"],
     "launch.tpu: error: --model_dir must be a gs:// URL so every host reads and writes the same "
     "checkpoints (got '/tmp/run1')"),
    (["create", *SLICE, "--accelerator_type=v3_512", "--dry_run"],
     "launch.tpu: error: --accelerator_type='v3_512' is not like v3-512"),
    (["create", "--zone=europe-west4-a", "--accelerator_type=v3-512", "--dry_run"],
     "launch.tpu: error: the following arguments are required: --name"),
    (["create", *SLICE, "--dry_run"],
     "launch.tpu: error: --accelerator_type is required to create the slice (create)"),
    (["create", *SLICE, "--accelerator_type=v9z-8", "--dry_run"],
     "launch.tpu: error: no known runtime for TPU 'v9z' (--accelerator_type=v9z-8; known: v2, v3, v4, v5litepod, "
     "v5p, v6e); give --runtime_version"),
    (["setup", *SLICE, "--python=3", "--dry_run"], "launch.tpu: error: --python='3' is not a Python version like 3.11"),
    (["setup", *SLICE, "--wheel_cache=/tmp/wheels", "--dry_run"],
     "launch.tpu: error: --wheel_cache must be a gs:// URL that every host can read (got '/tmp/wheels')"),
])
def test_bad_input_is_one_line_error(gcloud, tmp_path, args, message):
  done = gcloud.launch(*args, path=str(tmp_path))  # no gcloud on this PATH
  assert done.returncode == 2
  assert done.stderr.splitlines() == [message]
  assert done.stdout == ""


def test_a_restart_records_its_downtime_and_sets_up_from_the_wheel_cache(gcloud):
  assert gcloud.launch("setup", *SLICE, f"--wheel_cache={WHEEL_CACHE}").returncode == 0  # fills the cache
  gcloud.host_calls()
  done = gcloud.launch("run", *SLICE, *RUN_FLAGS, *RESTART_AT_ONCE, f"--wheel_cache={WHEEL_CACHE}",
                       states=("PREEMPTED", "READY"))
  assert done.returncode == 0, done.stderr
  # The recreated host is fresh: it installs, offline from the cache, and builds nothing.
  assert gcloud.host_calls() == [
      *UV_VENV_3_11, FINGERPRINT, f"storage cp {WHEEL_CACHE}/*.whl HOME/.pod-pretrain-wheels/",
      f"{VENV_PYTHON} -m pip install --no-index --find-links=HOME/.pod-pretrain-wheels -e .[tpu]"]

  (records_object,) = (gcloud.bucket / "run1" / run_events.RECORDS_DIR).iterdir()
  write = gcloud.calls()[-3]
  assert write == ["storage", "cp", write[2], f"gs://bucket/run1/{run_events.RECORDS_DIR}/{records_object.name}"]
  launcher_records = goodput.read_launcher_records(str(gcloud.bucket / "run1"))
  assert [(r["kind"], r.get("state")) for r in launcher_records] == [
      ("preemption_detected", "PREEMPTED"), ("delete", None), ("create", None), ("setup", None),
      ("train_command", None)]
  run = goodput.account(goodput.read_records(str(gcloud.bucket / "run1")), launcher_records)
  first, second = run.starts
  downtime = second.downtime(first.ended)
  assert all(downtime[part] > 0 for part in goodput.DOWNTIME), downtime
  assert sum(downtime.values()) == pytest.approx(run.seconds["between starts"], rel=1e-9)
  assert run.downtime == downtime
  assert "    setup " in goodput.report("gs://bucket/run1", run)


def test_dry_run_shows_the_setup_commands_with_a_wheel_cache(gcloud, tmp_path):
  done = gcloud.launch("setup", *SLICE, f"--wheel_cache={WHEEL_CACHE}", "--dry_run", path=str(tmp_path))
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert [line.split()[:6] for line in lines] == [["+", "gcloud", "compute", "tpus", "tpu-vm", verb]
                                                  for verb in ("scp", "ssh", "ssh")]
  assert "python3 -m uv venv --seed --python=3.11 $HOME/.pod-pretrain-venv" in lines[1]
  assert "$HOME/.pod-pretrain-venv/bin/python -m pip install --no-index --find-links=$HOME/.pod-pretrain-wheels" \
      in lines[1]
  assert "--worker=0" in lines[2] and "gcloud storage cp --no-clobber" in lines[2]
