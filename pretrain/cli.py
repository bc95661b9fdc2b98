"""Shared command-line plumbing: T5X-style gin flags, gin-bound arguments, one-line errors."""
import copy
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import gin

from pretrain.errors import USER_ERRORS, ConfigError, one_line, user_settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_UNSET_ARGUMENT = "No values supplied by Gin or caller for arguments"  # gin's words for a missing binding


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
        raise ConfigError(f"{arg}: expected --gin.KEY=VALUE")
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
      raise ConfigError(f"--gin_file={f}: no such file")
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings), finalize_config=False)
  except (ValueError, SyntaxError) as e:  # an unknown configurable or parameter, a malformed binding
    raise ConfigError(one_line(e)) from e


def bound_arguments(fn: Callable, names: Optional[Sequence[str]] = None) -> dict:
  """`fn`'s gin-bound arguments (default: all of them), evaluated as a call through gin would.

  Evaluating them builds what they reference (model configs, tasks, optimizers) from the user's
  settings, so a value those constructors reject, or a macro nobody set, is a ConfigError.
  """
  bound = gin.get_bindings(fn, resolve_references=False)
  signature = inspect.signature(fn).parameters
  arguments = {}
  for name in names or signature:
    if name in bound:
      arguments[name] = _evaluate(name, bound[name])
    elif signature[name].default is not inspect.Parameter.empty:
      arguments[name] = signature[name].default
    else:
      raise ConfigError(f"{fn.__module__}.{fn.__name__}.{name} is not bound: include gin_configs/runs/pretrain.gin "
                        "in the run")
  return arguments


def _evaluate(name: str, value):
  with user_settings():
    try:
      return copy.deepcopy(value)  # deepcopy is how gin evaluates @references and %MACROS
    except TypeError as e:
      if _UNSET_ARGUMENT not in str(e):
        raise
      macro = re.search(r"configurable 'macro' .* in scope '([\w.]+)'", str(e))
      raise ConfigError(f"macro {macro.group(1)} is not set: bind it in a gin file or with --gin.{macro.group(1)}=..."
                        if macro else f"{name}: {one_line(e)}") from e


def fail(error: BaseException, program: str) -> None:
  if os.environ.get("POD_PRETRAIN_DEBUG"):  # the full traceback, for developers
    raise error
  print(f"{program}: error: {one_line(error)}", file=sys.stderr)
  sys.exit(1)


def run(program: str, main: Callable[[], None]) -> None:
  """Runs an entry point: what the user caused ends it with one line and exit code 1; a bug, with its
  traceback."""
  try:
    main()
  except USER_ERRORS as e:
    fail(e, program)
