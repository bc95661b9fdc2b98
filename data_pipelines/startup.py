"""How every command-line program starts: TensorFlow kept to the host, and no start-up noise on stderr.

Each program imports this module before anything imports TensorFlow or JAX (`pretrain.cli.start` does
it for the gin programs); importing it does the following, once per process:

- TensorFlow only reads and preprocesses data on the host CPU, so it never sees a GPU:
  `tf.config.set_visible_devices([], "GPU")` before its runtime starts. On a GPU machine TensorFlow
  would otherwise take GPU memory that JAX needs; what JAX sees is unchanged.
- `TF_CPP_MIN_LOG_LEVEL=1` unless set: TensorFlow's C++ INFO lines ("This TensorFlow binary is
  optimized to use available CPU instructions ... rebuild TensorFlow with the appropriate compiler
  flags", "Local rendezvous is aborting ... End of sequence") are not shown; its warnings and errors are.
- TensorFlow logs while it loads and while it looks for a GPU, before absl's logging is set up, so no
  log level hides those lines: "WARNING: All log messages before absl::InitializeLog() is called are
  written to STDERR", INFO lines (`I0000 ...`) such as "cudart_stub.cc] Could not find cuda drivers on
  your machine, GPU will not be used" and, twice where TensorFlow turns oneDNN on (CPUs with AVX-512
  VNNI and newer, or TF_ENABLE_ONEDNN_OPTS=1), "port.cc] oneDNN custom operations are on" (only the
  line goes: oneDNN stays as TensorFlow sets it), and "cuda_platform.cc] failed call to cuInit" (about
  TensorFlow's GPU, which it is not given anyway). The import runs with stderr (file descriptor 2) going
  to a temporary file; afterwards every other line in it (warnings, errors) is written to stderr, so a
  real error still shows.
- With libtpu installed (the `tpu` extra) JAX tries the TPU before the CPU, and on a machine without
  one libtpu prints errors about TPU hostnames ("Failed to find host bounds for accelerator type",
  "common_lib.cc] INVALID_ARGUMENT: Error: unexpected worker hostname") before JAX falls back to the
  CPU; with jax's CUDA plugin installed (the `gpu` and `gpu-plan` extras) and no GPU, the plugin prints a
  traceback ("Unable to load cuPTI"). Where no accelerator is attached the CPU is all JAX can use, so there
  `JAX_PLATFORMS=cpu` is set (unless JAX_PLATFORMS is set). JAX tells a TPU chip by its Google PCI vendor id;
  here any Google PCI device, or any GPU device node, counts as a possible accelerator and leaves JAX's choice
  alone.

- With `STORAGE_EMULATOR_HOST` set (a local Cloud Storage server), gs:// paths go there: importing
  `data_pipelines.storage` points etils.epath, gcsfs and tensorstore at it before any of them is used.

`POD_PRETRAIN_DEBUG=1` keeps every line TensorFlow writes while it starts.

`run_absl(main)` is absl's `app.run(main)` with a `--help` that exits 0; `run_program(main, program)` runs a
data program with it, and what the user caused ends the program with one line.
"""
import contextlib
import glob
import importlib.util
import os
import re
import signal
import sys
import tempfile

from absl import app

_START_UP_LINES = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|^I\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "  # an INFO line of absl's format: I<mmdd> <time> <thread> <file:line>]
    r"|cuda_platform\.cc:\d+\] failed call to cuInit: ")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD, WSL2
_HELP_FLAGS = ("-h", "--help", "--helpshort", "-?")


@contextlib.contextmanager
def _stderr_without(lines: re.Pattern):
  """Runs the block with file descriptor 2 (C++ libraries' stderr too) going to a temporary file, then
  writes what it got to stderr except the lines that match `lines`."""
  sys.stderr.flush()
  try:
    captured = tempfile.TemporaryFile()
  except OSError:  # no writable temporary directory: stderr stays as it is
    yield
    return
  with captured:
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
              if not lines.search(line)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def _only_a_cpu_here() -> bool:
  """No TPU chip (no Google PCI device at all, to be safe) and no GPU device node; False where PCI
  devices cannot be listed."""
  vendors = glob.glob("/sys/bus/pci/devices/*/vendor")
  if not vendors or any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
    return False
  for path in vendors:
    try:
      with open(path) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return False
    except OSError:
      return False
  return True


def _accelerator_plugin_installed() -> bool:
  """libtpu, or jax's CUDA plugin (its jax_plugins module), is installed."""
  return bool(importlib.util.find_spec("libtpu")) or any(
      importlib.util.find_spec(f"jax_plugins.{name}") for name in ("xla_cuda13", "xla_cuda12")
      if importlib.util.find_spec("jax_plugins"))


def _start() -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  if "JAX_PLATFORMS" not in os.environ and _accelerator_plugin_installed() and _only_a_cpu_here():
    os.environ["JAX_PLATFORMS"] = "cpu"
  quiet = _stderr_without(_START_UP_LINES) if not os.environ.get("POD_PRETRAIN_DEBUG") else contextlib.nullcontext()
  with quiet:
    import tensorflow as tf
    try:
      tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow already ran something in this process: its devices are fixed
      pass
  from data_pipelines import storage  # noqa: F401  (with STORAGE_EMULATOR_HOST, points every library at it)


def run_absl(main) -> None:
  """`app.run(main)`, except that -h, --help or --helpshort print the program's docstring and its own
  flags on stdout and exit 0 (absl's --help exits 1)."""
  if any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
    app.usage(shorthelp=True, writeto_stdout=True)
    sys.exit(0)
  app.run(main)


class _Stopped(KeyboardInterrupt):
  """SIGTERM, raised in the main thread as Ctrl-C is, so that a program unwinds the same way for both."""


def _raise_stopped(signum, frame):
  raise _Stopped()


def run_program(main, program: str, interrupted: str = "") -> None:
  """`run_absl` of a data program's `main()` (every input is a flag): what the user caused ends it with one
  line, `PROGRAM: error: MESSAGE`, and exit code 1. That is an argument that is not a flag, a ValueError (a
  setting's value, an unknown task), or a path that is missing, not a directory or not writable (OSError,
  or TensorFlow's file system's errors). Anything else is a bug, and keeps its traceback, as does
  everything with POD_PRETRAIN_DEBUG=1. The programs print their own progress, so the libraries' INFO logs
  (seqio's "TaskRegistry has 0 tasks") are shown only with --verbosity=0.

  Ctrl-C or SIGTERM unwinds `main` (which removes what it was writing) and ends the program with one line,
  `PROGRAM: stopped by Ctrl-C: INTERRUPTED` (what is left of its output), and exit code 130 or 143."""
  import tensorflow as tf
  from absl import flags, logging
  user_errors = (ValueError, OSError, tf.errors.NotFoundError, tf.errors.PermissionDeniedError,
                 tf.errors.FailedPreconditionError)

  def main_with_one_line_errors(argv):
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
      if len(argv) > 1:
        raise ValueError(f"unexpected arguments {argv[1:]}: every input is a --flag")
      main()
    except user_errors as error:
      if os.environ.get("POD_PRETRAIN_DEBUG"):
        raise
      sys.exit(f"{program}: error: {(str(error).strip().splitlines() or [type(error).__name__])[0]}")
    except KeyboardInterrupt as stop:
      by, name = (signal.SIGTERM, "SIGTERM") if isinstance(stop, _Stopped) else (signal.SIGINT, "Ctrl-C")
      print(f"{program}: stopped by {name}{': ' + interrupted if interrupted else ''}", file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(128 + by)  # now: a library's thread may still be in native code (sentencepiece's training)

  run_absl(main_with_one_line_errors)


_start()
