"""What a user causes is a ConfigError; anything else is a bug, and keeps its traceback.

The entry points print a ConfigError (or a missing file, or a run that stopped itself) as one line
and exit non-zero. `models/`
and `data_pipelines/` know nothing of this module and reject bad settings with ValueError; pretrain
turns those into ConfigErrors only where it hands them the user's settings (`user_settings`), so
that a ValueError from a bug anywhere else still surfaces as one.
"""
import contextlib
import re


class ConfigError(ValueError):
  """A setting, file or argument the user gave is wrong; the message names it, in one line."""


class TrainingStopped(Exception):
  """The run stopped itself (its updates kept failing); the message says why and where to resume."""


class Interrupted(BaseException):
  """A signal stopped the run before its first step (pretrain.signals); its one line is already out. A
  BaseException, as KeyboardInterrupt: code that handles faults (`except Exception`) must not take it for one."""

  def __init__(self, line: str, exit_code: int):
    super().__init__(line)
    self.exit_code = exit_code


# Missing or unreadable paths are the user's to fix too (a checkpoint directory, a vocabulary file).
USER_ERRORS = (ConfigError, TrainingStopped, FileNotFoundError, NotADirectoryError, PermissionError)


@contextlib.contextmanager
def user_settings():
  """A ValueError raised inside the block rejected a value the user set: re-raise it as a ConfigError."""
  try:
    yield
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e


def one_line(error: BaseException) -> str:
  """An error's first line: gin appends 'In call to configurable ...' lines and file context, tensorstore
  whole specs; TensorFlow wraps its ops' messages in '{{function_node ...}} ... [Op:...]' and tf.data's in
  where they came from."""
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  text = re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\](\s+name:\s*\S*)?$", "", text.strip())
  # tf.data names the transformation and iterator an error came from, and tf.debugging.Assert brackets its data
  text = re.sub(r"^Error in user-defined function passed to \S+ transformation with iterator: \S+: ", "", text)
  text = re.sub(r"^assertion failed: \[(.*)\]$", r"\1", text)
  return text.strip('"')
