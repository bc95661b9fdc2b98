"""Build `gcloud compute tpus ...` and `gcloud storage ...` command lines, and run them (or print them: dry run).

Builders return argv lists; `Runner` is the only place that executes anything.
"""
import dataclasses
import shlex
import subprocess


@dataclasses.dataclass(frozen=True)
class Slice:
  """Which TPU slice a command targets. For queued resources the queued resource id equals `name`."""
  name: str
  zone: str
  project: str | None = None


def _tpus(group: str, verb: str, target: Slice, *positionals: str, flags: tuple[str, ...] = ()) -> list[str]:
  argv = ["gcloud", "compute", "tpus", group, verb, *positionals, f"--zone={target.zone}"]
  if target.project:
    argv.append(f"--project={target.project}")
  return argv + list(flags)


def create_tpu_vm(target: Slice, accelerator_type: str, runtime_version: str, *,
                  spot: bool = False, preemptible: bool = False) -> list[str]:
  flags = [f"--accelerator-type={accelerator_type}", f"--version={runtime_version}"]
  if spot:
    flags.append("--spot")
  if preemptible:
    flags.append("--preemptible")
  return _tpus("tpu-vm", "create", target, target.name, flags=tuple(flags))


def create_queued_resource(target: Slice, accelerator_type: str, runtime_version: str, *,
                           spot: bool = False) -> list[str]:
  flags = [f"--node-id={target.name}", f"--accelerator-type={accelerator_type}",
           f"--runtime-version={runtime_version}"]
  if spot:
    flags.append("--spot")
  return _tpus("queued-resources", "create", target, target.name, flags=tuple(flags))


def describe_tpu_vm(target: Slice, output_format: str | None = None) -> list[str]:
  flags = (f"--format={output_format}",) if output_format else ()
  return _tpus("tpu-vm", "describe", target, target.name, flags=flags)


def describe_queued_resource(target: Slice, output_format: str | None = None) -> list[str]:
  flags = (f"--format={output_format}",) if output_format else ()
  return _tpus("queued-resources", "describe", target, target.name, flags=flags)


def delete_tpu_vm(target: Slice) -> list[str]:
  return _tpus("tpu-vm", "delete", target, target.name, flags=("--quiet",))


def delete_queued_resource(target: Slice) -> list[str]:
  # --force also deletes the TPU VM the queued resource created.
  return _tpus("queued-resources", "delete", target, target.name, flags=("--force", "--quiet"))


def ssh(target: Slice, command: str, worker: str = "all") -> list[str]:
  return _tpus("tpu-vm", "ssh", target, target.name, flags=(f"--worker={worker}", f"--command={command}"))


def scp_to_workers(target: Slice, local_path: str, remote_path: str) -> list[str]:
  return _tpus("tpu-vm", "scp", target, local_path, f"{target.name}:{remote_path}",
               flags=("--worker=all", "--recurse"))


def storage_copy(source: str, destination: str) -> list[str]:
  return ["gcloud", "storage", "cp", source, destination]


class Runner:
  """Runs gcloud commands with output streamed to our terminal, or in dry-run mode only prints them."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def _announce(self, argv: list[str]) -> None:
    print("+ " + shlex.join(argv), flush=True)

  def run(self, argv: list[str]) -> int:
    """Runs `argv` and returns its exit code (0 in dry-run mode)."""
    self._announce(argv)
    if self.dry_run:
      return 0
    return subprocess.run(argv, check=False).returncode

  def capture(self, argv: list[str]) -> subprocess.CompletedProcess:
    """Runs `argv` with stdout and stderr captured as text (both empty, exit code 0, in dry-run mode)."""
    self._announce(argv)
    if self.dry_run:
      return subprocess.CompletedProcess(argv, 0, "", "")
    return subprocess.run(argv, check=False, capture_output=True, text=True)
