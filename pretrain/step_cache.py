"""The compiled train step, kept under what it is made of: a start that finds it skips tracing the model.

JAX's persistent cache (`pretrain.compilation_cache`) keys an executable by its lowered program, so a start
must trace and lower the train step before it can look it up: with unrolled layers that is most of a cached
start's compile (BERT-base on a CPU: 2 s of Python, beside the restore). This cache keys the step by what the
program is made of instead:
- this code: every source file of models/, pretrain/ and data_pipelines/;
- the versions of JAX, jaxlib, Flax, optax and NumPy; JAX's settings; XLA_FLAGS and LIBTPU_INIT_ARGS;
- the devices (platform, its version, kind) and the mesh's order of them; the process count;
- the family with its model config, the axis rules, the microbatches, and the state's and a batch's shapes,
  dtypes and shardings;
- the optimizer's update and the schedule as JAX traces them for the state's shapes (not the model: their
  hyperparameters are constants in what they trace).
Any change to these misses: the step is traced and compiled as before (through JAX's cache) and kept again,
if XLA compiled it: one that JAX's cache gave is not kept (XLA's CPU executable, loaded and serialized again,
has lost its kernels), so starts trace it until a changed program compiles. Where the cache holds no entry (a
new run), the key is made while XLA compiles, off the way to the first step.
Code outside those packages is not in the key: after changing a model or optimizer defined elsewhere (a module
gin imports), delete COMPILATION_CACHE_DIR/train_step.

Entries are COMPILATION_CACHE_DIR/train_step/<key> (local or gs://; 'none' turns this off with JAX's cache).
Process 0 writes them, and keeps the KEPT newest: each changed setting or edit of the code adds one (an
executable: 11 MB for BERT-base on a CPU), so an unbounded directory would grow with every experiment. Each
holds a SHA-256 of its contents: a partial or corrupt entry is ignored with a warning (and removed by process
0), and the step is compiled. Loading an executable runs code from it, as JAX's own cache does: keep the
cache where only your runs write.
"""
import concurrent.futures
import functools
import hashlib
import importlib.metadata
import os
import pickle
import re
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
from etils import epath
from jax.experimental import serialize_executable

from pretrain import compilation_cache, steps

SUBDIRECTORY = "train_step"
_HEADER = b"pod-pretrain train step\n"
CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "pretrain", "data_pipelines")
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")
_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_WHERE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_")  # where programs are kept, not what they are
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a function's repr: another per process
KEPT = 4  # entries a cache keeps, the newest written
_PARTIAL = ".partial"
_ABANDONED_AFTER_SECONDS = 3600  # a partial write this old was left by a process stopped while writing


def compiled_train_step(setup: steps.Setup, cache_directory: Optional[str], write: bool,
                        warn: Callable[[str], None], traced: Callable[[], None] = lambda: None
                        ) -> Tuple[jax.stages.Compiled, bool]:
  """The train step compiled for `setup`, and whether it came from the cache in `cache_directory` (None: no
  cache) untraced. `write` (process 0): keep a step that XLA compiled here, and remove a damaged entry.
  Problems with an entry go to `warn`. `traced()` is called when this call has no trace ahead that another
  thread's should wait for: at once where the cache holds entries (a miss then traces beside the other thread;
  `traced()` comes again after it), else after lowering the step."""
  directory = None if cache_directory is None else epath.Path(cache_directory) / SUBDIRECTORY
  path = None
  if directory is not None and _has_entries(directory):
    traced()
    path = directory / key(setup)
    loaded = _load(path, setup, warn, remove_damaged=write)
    if loaded is not None:
      return loaded, True
  lowered = steps.lower_train_step(setup)
  traced()
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train-step-key") as beside:
    # An empty cache's key is only needed to keep the step: it is traced while XLA compiles, off the way to the
    # first step.
    keyed = beside.submit(key, setup) if directory is not None and path is None else None
    with compilation_cache.hits_in_this_thread() as hits:
      compiled = lowered.compile()
    if keyed is not None:
      path = directory / keyed.result()
  # An executable that JAX's cache gave is not kept again: XLA's CPU executable, loaded and serialized again,
  # has lost its kernels (running it fails: "Function ... not found"). The next start traces it again.
  if path is not None and write and not hits:
    _keep(path, compiled, warn)
  return compiled, False


def _has_entries(directory: epath.Path) -> bool:
  try:
    return directory.exists() and any(not p.name.endswith(_PARTIAL) for p in directory.iterdir())
  except Exception:  # storage that cannot be listed: looked up entry by entry, where _load says why it fails
    return True


def key(setup: steps.Setup) -> str:
  """The hex digest of what the train step of `setup` is made of (the module's docstring)."""
  digest = hashlib.sha256()
  for part in _ingredients(setup):
    digest.update(_ADDRESS.sub("", part).encode())
    digest.update(b"\0")
  return digest.hexdigest()


def _ingredients(setup: steps.Setup) -> Iterator[str]:
  yield source_digest()
  yield repr([(name, importlib.metadata.version(name)) for name in _LIBRARIES])
  yield repr(sorted((name, repr(value)) for name, value in jax.config.values.items()
                    if not name.startswith(_WHERE_SETTINGS)))
  yield repr([os.environ.get(name) for name in _ENVIRONMENT])
  device = setup.mesh.devices.flat[0]
  yield repr((device.platform, device.client.platform_version, device.device_kind, jax.process_count(),
              dict(setup.mesh.shape), [d.id for d in setup.mesh.devices.flat]))
  yield repr((setup.family, setup.rules, setup.microbatches))
  state, batch = setup.sharded_abstract_state(), setup.sharded_batch_shapes()
  yield repr(jax.tree_util.tree_flatten_with_path((state, batch)))
  params = state.params
  yield str(jax.make_jaxpr(setup.optimizer.update)(params, state.opt_state, params))
  yield str(jax.make_jaxpr(setup.schedule)(jax.ShapeDtypeStruct((), jnp.int32)))


@functools.lru_cache(maxsize=None)
def source_digest(root: Path = CHECKOUT) -> str:
  """A digest of the code under `root` (this checkout): its packages' source files, read once per process."""
  digest = hashlib.sha256()
  for path in sorted(p for package in PACKAGES for p in (root / package).rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def _load(path: epath.Path, setup: steps.Setup, warn, remove_damaged: bool) -> Optional[jax.stages.Compiled]:
  """The entry at `path` loaded for `setup`, None if there is none or it cannot serve (said to `warn`); a
  damaged one is removed if `remove_damaged`, so that later starts do not warn again."""
  try:
    if not path.exists():
      return None
    contents = path.read_bytes()
  except Exception as e:  # storage that cannot be read costs a compile, not the run
    warn(f"could not read the cached train step {path} ({type(e).__name__}: {e}); tracing and compiling it")
    return None
  body = contents[len(_HEADER) + 32:]
  if contents[:len(_HEADER)] != _HEADER or contents[len(_HEADER):len(_HEADER) + 32] != hashlib.sha256(body).digest():
    warn(f"ignoring the cached train step {path}: its checksum does not match (a write cut short or a damaged "
         f"file){_removed(path, remove_damaged)}; tracing and compiling it")
    return None
  try:
    payload, in_tree, out_tree = pickle.loads(body)
    devices = list(setup.mesh.devices.flat)  # the program's devices, in its order (not all the backend's)
    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, backend=devices[0].client,
                                                         execution_devices=devices)
  except Exception as e:
    warn(f"could not load the cached train step {path} ({type(e).__name__}: {e}){_removed(path, remove_damaged)}; "
         "tracing and compiling it")
    return None
  wanted = jax.tree.structure(((setup.sharded_abstract_state(), setup.sharded_batch_shapes()), {}))
  if compiled.in_tree != wanted:
    warn(f"ignoring the cached train step {path}: it takes other arguments than this run's state and batch; "
         "tracing and compiling it")
    return None
  return compiled


def _removed(path: epath.Path, remove: bool) -> str:
  """Removes a damaged entry if `remove`: what to add to the warning that names it."""
  if not remove:
    return ""
  try:
    path.unlink(missing_ok=True)
    return ", removed it"
  except Exception as e:
    return f", and could not remove it ({type(e).__name__}: {e})"


def _keep(path: epath.Path, compiled: jax.stages.Compiled, warn) -> None:
  try:
    body = pickle.dumps(serialize_executable.serialize(compiled))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.{uuid.uuid4().hex}{_PARTIAL}"
    partial.write_bytes(_HEADER + hashlib.sha256(body).digest() + body)
    partial.replace(path)  # whole or not at all: a start that reads it meanwhile finds none, or the old one
  except Exception as e:  # a cache that cannot be written costs the next start a trace, not this run
    warn(f"could not keep the compiled train step in {path} ({type(e).__name__}: {e}); the next start traces it "
         "again")
    return
  try:
    prune(path.parent, keep=KEPT, newest=path)
  except Exception as e:
    warn(f"could not remove old train steps from {path.parent} ({type(e).__name__}: {e})")


def prune(directory: epath.Path, keep: int, newest: epath.Path) -> None:
  """Removes from `directory` all entries but `newest` and the keep - 1 written last before it, and the
  partial writes of processes stopped while writing."""
  entries, abandoned, abandoned_before = [], [], time.time() - _ABANDONED_AFTER_SECONDS
  for path in directory.iterdir():
    try:
      modified = path.stat().mtime
    except FileNotFoundError:  # removed or renamed by another process since the listing
      continue
    if path.name.endswith(_PARTIAL):
      if modified < abandoned_before:
        abandoned.append(path)
    elif path.name != newest.name:
      entries.append((modified, path.name, path))
  for path in [path for *_, path in sorted(entries, reverse=True)[keep - 1:]] + abandoned:
    path.unlink(missing_ok=True)
