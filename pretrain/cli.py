"""Shared command-line plumbing: T5X-style gin flags, multi-host start-up, one-line errors."""
import os
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

import gin

PROJECT_ROOT = Path(__file__).resolve().parents[1]
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, TypeError, NotADirectoryError, SyntaxError)


def split_gin_args(argv: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
  """Pulls `--gin_file=F`, `--gin_bindings=B` and `--gin.KEY=VALUE` out of argv.

  Returns (gin files, bindings, remaining argv) so the rest can go to absl.
  """
  files, bindings, rest = [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    name, has_value, value = arg.partition("=")
    if name in ("--gin_file", "--gin_bindings") and not has_value and i + 1 < len(args):
      value, has_value = args[i + 1], True
      i += 1
    if name == "--gin_file":
      files.append(value)
    elif name == "--gin_bindings":
      bindings.append(value)
    elif name.startswith("--gin."):
      if not has_value:
        raise ValueError(f"{arg}: expected --gin.KEY=VALUE")
      bindings.append(f"{name[len('--gin.'):]} = {value}")
    else:
      rest.append(arg)
    i += 1
  return files, bindings, rest


def parse_gin(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses gin files (searched in the cwd and the project root) and bindings; later ones win."""
  for path in (os.getcwd(), str(PROJECT_ROOT)):
    gin.add_config_file_search_path(path)
  for f in files:
    if not any((Path(base) / f).exists() for base in ("", PROJECT_ROOT)):
      raise FileNotFoundError(f"--gin_file={f}: no such file")
  gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)


def initialize_distributed() -> None:
  """Joins a multi-process JAX job when launched as one (launch.local, or a TPU pod slice)."""
  import jax
  from launch import local

  if local.COORDINATOR_ADDRESS_ENV in os.environ:
    jax.distributed.initialize(coordinator_address=os.environ[local.COORDINATOR_ADDRESS_ENV],
                               num_processes=int(os.environ[local.NUM_PROCESSES_ENV]),
                               process_id=int(os.environ[local.PROCESS_ID_ENV]))
  elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # a multi-host TPU VM slice
    jax.distributed.initialize()


def one_line(error: BaseException) -> str:
  """gin appends 'In call to configurable ...' lines and file context: keep the first line."""
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return text.strip().strip('"')


def fail(error: BaseException, program: str) -> None:
  if os.environ.get("POD_PRETRAIN_DEBUG"):  # the full traceback, for developers
    raise error
  print(f"{program}: error: {one_line(error)}", file=sys.stderr)
  sys.exit(1)
