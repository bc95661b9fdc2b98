"""Shared command-line plumbing: T5X-style gin flags and their --help, gin-bound arguments, one-line errors."""
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

GIN_FLAGS = """\
  --gin_file=FILE             a gin file: a run (gin_configs/runs/*.gin), then any others; may repeat,
                              later files win. Paths are looked up in the current directory, then the
                              project's.
  --gin.KEY=VALUE             sets one macro or binding, e.g. --gin.TRAIN_STEPS=1000; a string needs
                              inner quotes: --gin.MODEL_DIR="'/tmp/run'"
  --gin_bindings='KEY = VALUE'  the same in gin's syntax; may repeat"""

GIN_MACROS = """\
macros most runs set (defaults in gin_configs/runs/pretrain.gin and the run file):
  MODEL_DIR                   checkpoints, metrics.jsonl, TensorBoard events (local path or gs://)
  TRAIN_STEPS                 steps to train; a run resumes from MODEL_DIR's latest checkpoint
  BATCH_SIZE                  global batch (all hosts together)
  LEARNING_RATE, WARMUP_STEPS, OPTIMIZER ('adamw' or 'lamb'), WEIGHT_DECAY, CLIP_NORM
  TRAIN_FILES, VALIDATION_FILES, VOCAB_MODEL   your text and sentencepiece model (unset: the demo corpus)
  MIXTURE_OR_TASK_NAME, TASK_FEATURE_LENGTHS   the seqio task and its lengths
  LOG_EVERY_STEPS, CHECKPOINT_EVERY_STEPS, EVAL_EVERY_STEPS
  MESH_SHAPE                  e.g. "{'data': -1, 'fsdp': 1, 'model': 1}" (-1: the remaining devices)
  MICROBATCHES or MICROBATCH_ROWS_PER_GROUP, DATA_SHARDS, NUM_SLICES, SEED, PROFILE_STEPS
and any model setting by name, e.g. --gin.bert.BertConfig.num_layers=4 (see gin_configs/models/)."""


def gin_flags_help() -> str:
  """The gin flags and the macros most runs set, for a program that takes them (an argparse epilog)."""
  return f"gin flags:\n{GIN_FLAGS}\n\n{GIN_MACROS}"


def gin_help(doc: str, flags: str = "") -> str:
  """-h/--help of a gin program: its docstring (what it does, with an example command), its own `flags`
  (lines laid out as GIN_FLAGS'), the gin flags and the macros most runs set."""
  own = f"{flags.rstrip()}\n" if flags else ""
  return (f"{doc.strip()}\n\nflags:\n{own}{GIN_FLAGS}\n  -h, --help                  show this help and exit"
          f"\n\n{GIN_MACROS}")


def start(argv: Sequence[str], help_text: str) -> None:
  """What a program does first: with -h or --help in argv[1:], print `help_text` and exit 0; otherwise
  start TensorFlow and JAX quietly (data_pipelines.startup), before anything else imports them."""
  if any(arg in ("-h", "--help") for arg in argv[1:]):
    print(help_text.rstrip("\n"))
    sys.exit(0)
  from data_pipelines import startup  # noqa: F401  (importing it is the start)


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
