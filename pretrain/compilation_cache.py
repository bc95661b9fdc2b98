"""JAX's persistent compilation cache for a run, and a count of what it gave.

A run compiles its state's init, the train and eval steps and a few small programs (checksums, data
placement). With the cache, a resumed run with the same settings loads them all instead; a changed setting
changes the programs, which miss the cache and compile. Every executable is cached, however small or quick
to compile.

Where (COMPILATION_CACHE_DIR): a path (local or gs://), or 'none' for no cache. Left unset, a directory JAX
was already given (JAX_COMPILATION_CACHE_DIR or jax.config, e.g. the test suite's or a machine-wide cache)
wins; else MODEL_DIR/compilation_cache, which a pod's hosts share on gs:// (process 0 writes, as JAX does).

JAX reads an entry it cannot use (a partial write, a corrupt file: entries are zlib-checksummed) as a
miss: it warns, compiles, and the run goes on. A cache directory that cannot be written (under a file, no
permission) costs the start its cache, said once in the line after start-up, not the run.
"""
import contextlib
import dataclasses
import os
import threading
from typing import Iterator, Optional

import jax
from etils import epath
from jax.experimental.compilation_cache import compilation_cache

OFF = "none"
DEFAULT_SUBDIRECTORY = "compilation_cache"
COMPILE_REQUEST = "/jax/core/compile/backend_compile_duration"  # every compile, whether the cache serves it or not
CACHE_HIT = "/jax/compilation_cache/cache_hits"
# Settings this module changes for a run, and puts back after it.
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_persistent_cache_enable_xla_caches")


def cache_dir(setting: Optional[str], model_dir: str) -> Optional[str]:
  """The directory a run caches its executables in, None for none (see the module's docstring)."""
  if setting is not None:
    return None if setting.lower() == OFF else setting
  return jax.config.jax_compilation_cache_dir or str(epath.Path(model_dir) / DEFAULT_SUBDIRECTORY)


@dataclasses.dataclass
class Compiles:
  """Executables the run needed so far: `loaded` from the cache, the rest `compiled`; `unwritable`: why the
  directory set could not be used (the cache is then off: `directory` None)."""
  directory: Optional[str]
  unwritable: Optional[str] = None
  requested: int = 0
  loaded: int = 0
  untraced: int = 0  # of those loaded, how many without tracing them (the train step: pretrain.step_cache)

  def count_untraced_load(self) -> None:
    self.requested, self.loaded, self.untraced = self.requested + 1, self.loaded + 1, self.untraced + 1

  @property
  def compiled(self) -> int:
    return self.requested - self.loaded

  def line(self) -> str:
    if self.unwritable:
      return f"no compilation cache ({self.unwritable}): {self.compiled} programs compiled"
    if self.directory is None:
      return f"no compilation cache (COMPILATION_CACHE_DIR={OFF!r}): {self.compiled} programs compiled"
    untraced = f" ({self.untraced} untraced)" if self.untraced else ""
    if not self.compiled:
      return f"compilation cache {self.directory}: all {self.loaded} programs loaded{untraced}, nothing compiled"
    return (f"compilation cache {self.directory}: {self.loaded} programs loaded{untraced}, {self.compiled} "
            "compiled and cached")


@contextlib.contextmanager
def used(setting: Optional[str], model_dir: str) -> Iterator[Compiles]:
  """Within: JAX caches and loads every executable in `cache_dir(setting, model_dir)`, and the yielded
  Compiles counts them. JAX's settings are put back after."""
  directory = cache_dir(setting, model_dir)
  saved = {name: getattr(jax.config, name) for name in _SETTINGS}
  unwritable = _unwritable(directory) if directory is not None else None
  if unwritable:
    directory = None
  compiles = Compiles(directory, unwritable)

  def count(event: str, *_, **__) -> None:
    if event == COMPILE_REQUEST:
      compiles.requested += 1
    elif event == CACHE_HIT:
      compiles.loaded += 1

  _configure(directory, {"jax_persistent_cache_min_compile_time_secs": 0,
                         "jax_persistent_cache_min_entry_size_bytes": 0,
                         # Else JAX puts XLA's GPU autotuning cache in `directory` (C++ file I/O: no gs://) and
                         # that path into every entry's key: a cache could not move, nor be shared by its path.
                         "jax_persistent_cache_enable_xla_caches": OFF})
  jax.monitoring.register_event_listener(count)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_listener(count)
    jax.monitoring.unregister_event_duration_listener(count)
    _configure(saved["jax_compilation_cache_dir"], {k: v for k, v in saved.items() if k != "jax_compilation_cache_dir"})


@contextlib.contextmanager
def hits_in_this_thread() -> Iterator[list]:
  """Within: one item per executable that JAX's persistent cache gives this thread's compiles (others may
  compile beside it: the train step compiles beside the init)."""
  thread, hits = threading.get_ident(), []

  def heard(event: str, *_, **__) -> None:
    if event == CACHE_HIT and threading.get_ident() == thread:
      hits.append(event)
  jax.monitoring.register_event_listener(heard)
  try:
    yield hits
  finally:
    jax.monitoring.unregister_event_listener(heard)


def _unwritable(directory: str) -> Optional[str]:
  """Why a file cannot be written in `directory` (made if missing), or None: JAX would warn at every entry, and
  say nothing of a cache that stays empty."""
  probe = epath.Path(directory) / f".write-check-{os.getpid()}-{threading.get_ident()}"
  try:
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
  except Exception as e:  # local, TensorFlow's and gcsfs's errors alike: the cache is only unusable
    why = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [""])[0]  # not the probe's own name
    return f"{directory} cannot be written: {type(e).__name__}: {why}"
  return None


def _configure(directory: Optional[str], settings: dict) -> None:
  jax.config.update("jax_compilation_cache_dir", directory)
  for name, value in settings.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()  # JAX opens its cache once per process: this makes it open `directory`
