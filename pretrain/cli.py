"""Shared command-line plumbing: T5X-style gin flags and their --help, gin-bound arguments, one-line errors."""
import contextlib
import copy
import difflib
import inspect
import logging
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple

import gin
from gin import config_parser

from pretrain import signals
from pretrain.errors import USER_ERRORS, ConfigError, Interrupted, one_line, user_settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_UNSET_ARGUMENT = "No values supplied by Gin or caller for arguments"  # gin's words for a missing binding
_RUN = "pretrain.trainer.train"  # what every program's gin files describe a call of
_MACRO = "gin.macro"  # gin holds `NAME = value` as the binding NAME/gin.macro.value

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
    with _quiet_search_misses():
      gin.parse_config_files_and_bindings(list(files), None, finalize_config=False)
    read_in_files = _macros_in(gin.config._CONFIG)  # a command-line binding may replace a file's reader
    gin.parse_config(list(bindings))
  except (ValueError, SyntaxError) as e:  # an unknown configurable or parameter, a malformed binding
    raise ConfigError(one_line(e)) from e
  except OSError as e:  # an include found nowhere: gin's next lines say which file includes it
    where = next((line.strip() for line in str(e).splitlines() if line.strip().startswith("In file ")), "")
    raise ConfigError(f"{one_line(e)} {where}".strip()) from e
  _refuse_unread_settings(bindings, read_in_files)


@contextlib.contextmanager
def _quiet_search_misses():
  """gin logs 'Path not found' at ERROR for each search path an include is not under (the cwd, say, when the project
  root has it), though another may hold it; an include found under none is gin's error, and still one."""
  def keep(record: logging.LogRecord) -> bool:
    return record.msg != "Path not found: %s"

  root = logging.getLogger()
  root.addFilter(keep)
  try:
    yield
  finally:
    root.removeFilter(keep)


Key = Tuple[str, str, str]  # a binding: (scope, configurable's selector, parameter)


def _refuse_unread_settings(command_line: Sequence[str], read_in_files: Set[Tuple[str, str]]) -> None:
  """Gin refuses unknown configurables and parameters but accepts a setting nothing reads. Refused here,
  before anything runs (T5X only logs its operative config afterwards): a command-line binding that
  calling _RUN would not read, and a macro no binding references. A gin file's binding that the run
  does not read stays allowed: files hold defaults for alternatives (data/text_files.gin's TRAIN_FILES
  when data/tfds.gin replaces the task), and `read_in_files` (macros the files' bindings reference,
  some since replaced from the command line) count as read."""
  config = gin.config._CONFIG
  if ("", _RUN) not in config:  # no run described: bound_arguments says which file to include
    return
  read = _bindings_the_run_reads()
  for text in command_line:
    for key in _binding_keys(text):
      if key not in read:
        raise ConfigError(f"{text.strip()}: {_unread(key, read)}")
  referenced = read_in_files | _macros_in(config)
  for key in _bindings():
    if key[1] == _MACRO and key[:2] not in referenced:
      raise ConfigError(f"in a gin file: {_unread(key, read)}")


def _unread(key: Key, read: Set[Key]) -> str:
  """Why nothing reads the binding `key`, with the macros the run does read that it may have meant."""
  scope, selector, _ = key
  if selector != _MACRO:
    return f"the run never calls {_configurable_name(scope, selector)}"
  readers = [_binding_name(k) for k in _bindings() if key[:2] in _macros_in(gin.config._CONFIG[k[:2]][k[2]])]
  if readers:  # set for an alternative the run's files do not choose, e.g. TRAIN_FILES with data/tfds.gin
    return f"no setting reads the macro {scope}: only {', '.join(readers)}, a binding this run does not use"
  similar = _similar(scope, {k[0] for k in read if k[1] == _MACRO})
  return f"no setting reads the macro {scope}" + (f"; similar macros the run reads: {', '.join(similar)}"
                                                 if similar else "")


def _bindings_the_run_reads() -> Set[Key]:
  """Every binding a call of _RUN would read, found as gin calls: a configurable called in scope S takes the
  bindings of S and of its outer scopes (the innermost wins), and calls what they reference in the scope
  the reference names (a macro's is its name), else in S."""
  config, read, done, calls = gin.config._CONFIG, set(), set(), [((), _RUN)]
  while calls:
    call = calls.pop()
    if call in done:
      continue
    done.add(call)
    scope, selector = call
    source = {}
    for depth in range(len(scope) + 1):
      outer = ("/".join(scope[:depth]), selector)
      source.update(dict.fromkeys(config.get(outer, ()), outer))
    for param, (bound_scope, _) in source.items():
      read.add((bound_scope, selector, param))
      calls += [(tuple(ref.scopes) or scope, ref.configurable.selector)
                for ref in gin.config.iterate_references(config[bound_scope, selector][param])]
  return read


def _bindings() -> Iterator[Key]:
  return ((scope, selector, param) for (scope, selector), params in gin.config._CONFIG.items() for param in params)


def _macros_in(value) -> Set[Tuple[str, str]]:
  return {ref.config_key for ref in gin.config.iterate_references(value) if ref.configurable.selector == _MACRO}


class _KeysOnly(config_parser.ParserDelegate):
  """Parses bindings for their keys only: gin itself has parsed their values."""

  def configurable_reference(self, scoped_configurable_name, evaluate):
    return None

  def macro(self, macro_name):
    return None


def _binding_keys(text: str) -> Iterator[Key]:
  """The bindings `text` (gin's syntax) sets."""
  for statement in config_parser.ConfigParser(text, _KeysOnly()):
    if not isinstance(statement, config_parser.BindingStatement):
      continue
    if not statement.arg_name:  # `NAME = value` or `scope/NAME = value`: a macro
      yield "/".join(filter(None, (statement.scope, statement.selector))), _MACRO, "value"
    else:
      yield gin.config.ParsedBindingKey.parse(statement[:3]).scope_selector_arg


def _configurable_name(scope: str, selector: str) -> str:
  """A configurable as gin files name it, e.g. books/tasks.text_task."""
  return f"{scope + '/' if scope else ''}{gin.config._REGISTRY.minimal_selector(selector)}"


def _binding_name(key: Key) -> str:
  return f"{_configurable_name(*key[:2])}.{key[2]}"


def _similar(name: str, names: Set[str]) -> List[str]:
  """Up to three of `names` that share a word with `name` or are spelled much like it, closest first."""
  words = set(name.split("_"))
  alike = {n for n in names if words & set(n.split("_"))} | set(difflib.get_close_matches(name, names, cutoff=0.6))
  return sorted(alike, key=lambda n: -difflib.SequenceMatcher(None, name, n).ratio())[:3]


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
  except Interrupted as e:  # stopped by a signal: its line is out; JAX's exit handler would wait minutes for peers
    signals.exit_stopped(e.exit_code)
