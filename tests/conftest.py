"""Shared test setup: JAX on the CPU, with XLA's quicker compiling; one demo corpus + sentencepiece model for
every session; one JAX compilation cache per session.

The demo corpus lives in the system temp dir (not a per-session dir) so the ~15 s build happens once per
machine; the builder writes atomically, so concurrent sessions are safe. The compilation cache is JAX's
own persistent cache, in a directory of this session: the many tests that train the same tiny models
(a run and its resume, each process of a multi-process run) compile each program once, while every
session still starts cold, as CI does. All are set at import time so that subprocesses inherit them.
"""
import importlib.metadata
import os
from pathlib import Path
import shutil
import sys
import tempfile
import threading
import time

import pytest

import data_pipelines  # noqa: F401  (before any test module imports TensorFlow: data_pipelines/__init__.py)
from helpers import GPU_PLAN_PACKAGES

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.append(GPU_PLAN_PACKAGES)  # the test workers' own, for the plans compiled for described GPUs


def _jaxlib_version() -> tuple:
  """(major, minor) of the installed jaxlib, read without importing JAX (XLA reads XLA_FLAGS once, as JAX starts)."""
  return tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])


_SESSION_COMPILATION_CACHE = None  # set when this session made it (and so removes it)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _SESSION_COMPILATION_CACHE = tempfile.mkdtemp(prefix="pod_pretrain_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_COMPILATION_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# XLA's CPU backend skips LLVM's optimisations, emits fusions with its older (quicker to compile) emitters, and
# generates each program as one LLVM module: the tests' programs are tiny and each is compiled about once, so
# compiling is most of their cost (a tiny XLNet train step: 16 s -> 9 s for the first flag; the second takes a
# third off the scanned-stack tests; the third, where XLA's default splits a program into modules to compile
# them in parallel, takes a fifth off a tiny BERT run's cold start on 2 CPUs). Every comparison the tests make
# is between programs compiled alike, or within tolerances. XLA aborts the process at an unknown flag, and the XLA
# of jaxlib 0.11 has only the new emitters (no second flag): each flag goes only to the XLA that has it.
_OLDER_EMITTERS = ["--xla_cpu_use_fusion_emitters=false"] if _jaxlib_version() < (0, 11) else []
_QUICK_COMPILES = " ".join(["--xla_backend_optimization_level=0", *_OLDER_EMITTERS,
                            "--xla_cpu_parallel_codegen_split_count=1"])
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_QUICK_COMPILES}".strip()
os.environ.setdefault("POD_PRETRAIN_CACHE", os.path.join(tempfile.gettempdir(), "pod_pretrain_test_cache"))
# Each data shard's shuffle buffer fills at every start and is saved with every data position: BERT's
# reference size, not the default 1,000, halves the start of a tiny run's input.
os.environ.setdefault("POD_PRETRAIN_SHUFFLE_BUFFER", "100")
# etils.epath picks its gs:// backend once per process, at its first path: gcsfs (which the gs:// tests'
# local server needs) only if this is set by then. Local paths are unaffected.
os.environ["EPATH_USE_TF"] = "false"


@pytest.fixture(scope="session")
def demo_paths() -> dict:
  """{'train', 'validation', 'vocab_model'}: paths of the demo corpus and its vocabulary."""
  from data_pipelines import demo_corpus  # imported lazily: tests that need no data stay free of TF
  return demo_corpus.ensure_demo_corpus()


def _once_per_run(tmp_path_factory, name: str, make) -> Path:
  """A directory `make(directory)` fills once per test run: under pytest-xdist the first worker to ask makes it
  while the others wait, then all share it (so they must only read it)."""
  from filelock import FileLock
  base = tmp_path_factory.getbasetemp()
  if "PYTEST_XDIST_WORKER" in os.environ:
    base = base.parent  # the run's directory, above each worker's own
  directory, made = base / name, base / f"{name}.made"
  with FileLock(str(base / f"{name}.lock")):
    if not made.exists():
      directory.mkdir()
      make(directory)
      made.touch()
  return directory


@pytest.fixture(scope="session")
def bert_on_eight_devices(tmp_path_factory):
  """MODEL_DIR of BERT trained EIGHT_DEVICE_STEPS steps (SMALL_BERT, every step logged) on 8 host devices
  (mesh data=4, model=2), in its own process, once per test run; the export tests and the sharding test share
  it. The process's stderr is in the file next to MODEL_DIR named STDERR_FILE. It runs as a user's run from
  another directory: there, with MODEL_DIR 'run' (relative) and the run file found in the project."""
  from helpers import EIGHT_DEVICE_STEPS, STDERR_FILE, host_devices, run_module, small_bert_flags

  def train_on_eight_devices(directory):
    result = run_module("pretrain.train", *small_bert_flags("run", EIGHT_DEVICE_STEPS), "--gin.LOG_EVERY_STEPS=1",
                        "--gin.MESH_SHAPE={'data': 4, 'model': 2}", env=host_devices(8), cwd=directory)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'data': 4" in result.stdout and "'model': 2" in result.stdout, result.stdout[-2000:]
    (directory / STDERR_FILE).write_text(result.stderr)

  return _once_per_run(tmp_path_factory, "bert_eight_devices", train_on_eight_devices) / "run"


@pytest.fixture(scope="session")
def demo_vocab(demo_paths):
  """The demo seqio.SentencePieceVocabulary."""
  from data_pipelines import vocab
  return vocab.load_vocabulary(demo_paths["vocab_model"])


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
  """gs://pod-pretrain-test on a local Cloud Storage server (tests/local_gcs.py) that every library the
  framework uses is pointed at (data_pipelines.storage.use_emulator), for this process and its children;
  stopped, and the variables removed, at the end of the session."""
  from local_gcs import LocalCloudStorage

  from data_pipelines import storage
  saved = dict(os.environ)
  server = LocalCloudStorage(tmp_path_factory.mktemp("cloud_storage") / "objects")
  try:
    storage.use_emulator(server.url)
    yield server.create_bucket("pod-pretrain-test")
  finally:
    server.stop()
    for name in set(os.environ) - set(saved):
      del os.environ[name]
    os.environ.update(saved)


@pytest.fixture
def model_traces_at_once(monkeypatch) -> list:
  """The names of the flax module classes made while another thread made one too, during the test.

  flax makes module classes as it traces a model (lifted scan and remat), and while it makes one, its base
  classes lack some of their fields: a model traced in two threads at once fails, or goes on wrong. Here each
  class made waits a moment for another thread to be making one, which two traces under way at once would do."""
  from flax.linen import kw_only_dataclasses
  making, overlaps, lock = set(), [], threading.Lock()
  real = kw_only_dataclasses._process_class

  def watched(cls, *args, **kwargs):
    with lock:
      making.add(threading.get_ident())
    deadline = time.monotonic() + 0.3
    while len(making) < 2 and time.monotonic() < deadline:
      time.sleep(0.005)
    with lock:
      if len(making) > 1:
        overlaps.append(cls.__name__)
    try:
      return real(cls, *args, **kwargs)
    finally:
      with lock:
        making.discard(threading.get_ident())

  monkeypatch.setattr(kw_only_dataclasses, "_process_class", watched)
  return overlaps


def pytest_collection_modifyitems(config, items):
  """Modules marked `starts_first` (the longest: they train in several processes or many times) run first, so
  that under pytest-xdist (`make test`: two workers, each module whole on one) no worker is left with a long
  module at the end while the other idles."""
  items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)  # stable: file order otherwise


def pytest_sessionfinish(session, exitstatus):
  if _SESSION_COMPILATION_CACHE:
    shutil.rmtree(_SESSION_COMPILATION_CACHE, ignore_errors=True)
