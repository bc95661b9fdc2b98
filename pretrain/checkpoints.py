"""Orbax checkpoints: train state (sharded, async), the data position, run config.

Layout: MODEL_DIR/checkpoints/<step>/{state, data_iterator, run_config, checksums} (the run config is
`pretrain.run_files.RunConfig`'s JSON). The data position does not depend on the number of processes:
one tf.data iterator per data shard (`shard_<i>_of_<n>`, saved by the process that reads it), or for
row streams (XLNet) the number of batches taken (`batches_taken.json`). A resumed run continues the
input exactly where it stopped, on any number of processes. A weights-only checkpoint (from
`pretrain.import_hf`) has state = {params} and no data_iterator.

Orbax makes a save atomic (a step directory appears only once complete); `checksums` makes a restore
honest: a sum over each array's bits, taken before the save and compared after the restore, so that
damaged array data is caught rather than trained on.
"""
import dataclasses
import logging
import os
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from pretrain import distributed
from pretrain.errors import ConfigError, TrainingStopped, one_line


class _TracebacksOfHandledFaults(logging.Filter):
  """orbax logs the traceback of a save or restore that failed in one of its threads, then raises the error
  to us, where every such fault is handled (`Saver`, `restore`: one line) or, if not, raised on with its
  own traceback; asyncio logs the failed reads of a restore again as their futures are collected ("exception
  was never retrieved"). So those copies go to the debug log, shown with POD_PRETRAIN_DEBUG=1."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not record.exc_info or os.environ.get("POD_PRETRAIN_DEBUG"):
      return True
    frames = traceback.extract_tb(record.exc_info[2])
    return not ("orbax" in record.pathname or any("orbax" in frame.filename for frame in frames))


_TRACEBACKS_OF_HANDLED_FAULTS = _TracebacksOfHandledFaults()


class _UnraisablesOfFailedReads:
  """When one read of a restore fails, orbax abandons the others (the restore raises, handled by `restore`'s
  callers): as they are collected, their coroutines (`_read_array_index_and_device_put`) raise, and TensorStore
  calls back into orbax's event loop, closed by then ("Event loop is closed"). Python's unraisable hook would
  print a traceback of each, dozens after one set-aside; this one passes on every other unraisable exception."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable) -> None:
    code = getattr(unraisable.object, "cr_code", None)
    frames = [frame.name for frame in traceback.extract_tb(unraisable.exc_traceback)]
    left_by_orbax = code is not None and "orbax" in code.co_filename
    closed_loop = isinstance(unraisable.exc_value, RuntimeError) and "call_soon_threadsafe" in frames
    if not (left_by_orbax or closed_loop):
      self.previous(unraisable)


def _hide_tracebacks_of_handled_faults() -> None:
  """Where a manager is made: warning filters set at import may be reset (pytest resets them per test), and the
  unraisable hook replaced."""
  for logger in ("absl", "asyncio"):  # orbax logs through absl.logging
    logging.getLogger(logger).addFilter(_TRACEBACKS_OF_HANDLED_FAULTS)
  if os.environ.get("POD_PRETRAIN_DEBUG"):
    return
  # The parts of a save that failed before orbax awaited them.
  warnings.filterwarnings("ignore", r"coroutine '\w+CheckpointHandler\.async_save' was never awaited", RuntimeWarning)
  if not isinstance(sys.unraisablehook, _UnraisablesOfFailedReads):
    sys.unraisablehook = _UnraisablesOfFailedReads(sys.unraisablehook)


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves and restores where this process's input stands (`ShardIterators`, `StepIterator`), beside the state."""

  def save(self, directory: epath.Path, args: "DataIteratorSave"):
    args.iterator.save(directory)

  def restore(self, directory: epath.Path, args: "DataIteratorRestore") -> Optional[str]:
    """Restores the iterator in place; None, or why the saved position does not fit it."""
    return args.iterator.restore(directory)


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  iterator: Any


def checkpoint_dir(model_dir: str) -> epath.Path:
  """MODEL_DIR/checkpoints, a local one as an absolute path: orbax's tensorstore refuses a relative one."""
  model_dir = str(model_dir)
  return epath.Path(model_dir if "://" in model_dir else os.path.abspath(model_dir)) / "checkpoints"


TMP_MARK = ".orbax-checkpoint-tmp"  # in the name of a step directory that orbax has not finalised


def unfinished_saves(model_dir: str) -> List[str]:
  """Temporary directories of saves that never completed (a process killed while saving). A manager
  never restores them, and the one that `make_manager` returns removes them before its first save."""
  directory = checkpoint_dir(model_dir)
  return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name) if directory.exists() else []


def make_manager(model_dir: str, max_to_keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  # Directories are made before `save` returns: made in the background, a refused one leaves the save
  # waiting for a signal that never comes (20 minutes) instead of failing.
  _hide_tracebacks_of_handled_faults()
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                         create=True, cleanup_tmp_directories=True,
                                         async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))
  return ocp.CheckpointManager(checkpoint_dir(model_dir), options=options)


def save(manager: ocp.CheckpointManager, step: int, state, data_iterator, run_config: dict) -> None:
  """Asynchronous for the state; the iterator, config and checksums are small and written before returning."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data_iterator=DataIteratorSave(data_iterator),
      run_config=ocp.args.JsonSave(run_config),
      checksums=ocp.args.JsonSave(checksums(state))))


class Saver:
  """Saves a run's train states through an orbax manager, and makes sure that they land.

  A save runs in the background; whether it landed is checked after each logged step (`check`), at the next
  save and at the end (`finish`). When one failed, or could not start, the state in hand is saved
  again through a new manager, after waits that double from `first_wait` seconds, up to `attempts`
  times. If storage still refuses, TrainingStopped says which step is not saved and which is the
  newest that is: a run never goes on believing that it checkpoints when it does not.
  """

  def __init__(self, model_dir: str, max_to_keep: int, data_iterator, run_config: dict, say, attempts: int = 4,
               first_wait: float = 1.0):
    self.model_dir, self.max_to_keep, self.say = model_dir, max_to_keep, say
    self.data_iterator, self.run_config = data_iterator, run_config  # saved with every state
    self.attempts, self.first_wait = attempts, first_wait
    self.manager = make_manager(model_dir, max_to_keep)

  def save(self, step: int, state) -> None:
    self._confirmed(lambda: (self.manager.wait_until_finished(), self._save(step, state)), step, state)

  def check(self, step: int, state) -> None:
    """Cheap: if the last save failed, saves this step now."""
    self._confirmed(self.manager.check_for_errors, step, state)

  def finish(self, step: int, state) -> None:
    """Waits for the last save; if it failed, saves this step now."""
    self._confirmed(self.manager.wait_until_finished, step, state)

  def land(self) -> None:
    """Waits for the last save, and never saves again: for a state whose data position has moved past its step.
    A save that failed is left failed; `newest_step` tells what landed."""
    try:
      self.manager.wait_until_finished()
    except WRITE_ERRORS:
      pass

  def _save(self, step: int, state) -> None:
    save(self.manager, step, state, self.data_iterator, self.run_config)

  def _confirmed(self, action, step: int, state) -> None:
    try:
      action()
      error = None
    except WRITE_ERRORS as e:
      error = e
    if distributed.any_process(error is not None):  # every process saves again, or none
      self._save_again(step, state, _described(error) if error is not None else "on another process")

  def _save_again(self, step: int, state, failure: str) -> None:
    where, wait = checkpoint_dir(self.model_dir), self.first_wait
    for attempt in range(1, self.attempts + 1):
      self.say(f"saving a checkpoint in {where} failed ({failure}); saving step {step} in "
               f"{wait:.0f} s (attempt {attempt} of {self.attempts})")
      time.sleep(wait)
      wait *= 2
      try:
        self._reopen()
        self._save(step, state)
        self.manager.wait_until_finished()
        self.say(f"saved step {step} in {where}")
        return
      except WRITE_ERRORS as e:
        failure = _described(e)
    raise TrainingStopped(f"cannot write checkpoints in {where} ({failure}): the train state of step "
                          f"{step} is NOT saved; the newest saved checkpoint is step {newest_step(where)}. "
                          "Fix the storage (space, permissions), then resume")

  def _reopen(self) -> None:
    try:
      self.manager.close()
    except WRITE_ERRORS:  # the failed save's own error again; the new manager removes what it left
      pass
    self.manager = make_manager(self.model_dir, self.max_to_keep)


def saved_steps(directory: epath.Path) -> List[int]:
  """The steps with a directory of their own in a checkpoint directory, in order."""
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def newest_step(directory: epath.Path) -> Optional[int]:
  """The highest step with a directory of its own in a checkpoint directory, or None."""
  steps = saved_steps(directory)
  return steps[-1] if steps else None


def _described(error: Exception, limit: int = 300) -> str:
  """Type and first line; a long line keeps its end, where storage errors say what went wrong."""
  text = one_line(error)
  if len(text) > limit:
    text = f"{text[:limit // 3]} ... {text[-limit // 2:]}"
  return f"{type(error).__name__}: {text}"


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be restored as written; the message says what is wrong, in one line."""


# Reading damaged files raises anything from tensorstore's plain Exception to TensorFlow's IndexError
# (a truncated iterator file), so a restore catches them all: the fault is named with its type and
# first line, and nothing is moved or deleted unless an older checkpoint restores intact. Writes fail
# as variously (OSError, tensorstore's ValueError, orbax's TimeoutError) and are only ever retried.
READ_ERRORS = WRITE_ERRORS = (Exception,)


def restore(manager: ocp.CheckpointManager, step: int, abstract_state, data_iterator) -> Tuple[Any, List[str]]:
  """The state of `step`, in the shardings of `abstract_state`, with the iterator restored in place, and
  lines about what could not be restored as saved: the data position (saved for other data shards)
  or the checksums (a checkpoint written before they were). DamagedCheckpoint if the checkpoint cannot be
  read or its arrays differ from what was saved; ConfigError if it holds other arrays than this run's
  state (another optimizer)."""
  notes = []
  if (epath.Path(manager.directory) / str(step) / "checksums").exists():
    saved = _read(manager, step, checksums=ocp.args.JsonRestore()).checksums
    _check_same_arrays(step, saved, abstract_state)
  else:
    saved = None
    notes.append(f"step {step} has no checksums (saved before pod-pretrain wrote them): its arrays are restored "
                 "unverified; the next checkpoint will have them")
  # A checksum is of the bits as saved. Arrays are read in this run's dtypes; only where that leaves checksums
  # differing (or there are none) is orbax's metadata read for the saved dtypes (slow: it opens every array), and
  # arrays saved in another dtype read again as saved, checked, then cast.
  restored = _read(manager, step, state=ocp.args.StandardRestore(abstract_state),
                   data_iterator=DataIteratorRestore(data_iterator))
  state, position_problem = restored.state, restored.data_iterator
  del restored
  differing, recast = _differing(saved, state), []
  if differing or saved is None:
    as_saved = _with_saved_dtypes(manager, step, abstract_state)
    recast = [(jax.tree_util.keystr(path), old.dtype, new.dtype) for (path, old), new in
              zip(jax.tree_util.tree_flatten_with_path(as_saved)[0], jax.tree.leaves(abstract_state))
              if old.dtype != new.dtype]
    if recast and saved is not None:
      state = None  # the devices hold one copy of the state at a time
      state = _read(manager, step, state=ocp.args.StandardRestore(as_saved)).state
      differing = _differing(saved, state)
      state = jax.tree.map(lambda x, wanted: x.astype(wanted.dtype), state, abstract_state)
  if differing:
    more = f" and {len(differing) - 1} more" if len(differing) > 1 else ""
    raise DamagedCheckpoint(f"the data of {differing[0]}{more} differs from what was saved (checksum mismatch)")
  if recast:
    name, old, new = recast[0]
    more = f" and {len(recast) - 1} more" if len(recast) > 1 else ""
    notes.append(f"step {step} holds {name}{more} as {old}; cast to this run's {new}")
  if distributed.any_process(bool(position_problem)):
    why = position_problem or "another process's could not be restored"
    notes.append(f"the data position of step {step} does not fit this run's input: {why}; the input starts again "
                 "from its beginning, so examples are seen again; the checkpoint's DATA_SHARDS would continue it")
  return state, notes


def _differing(saved_checksums: Optional[Dict[str, str]], state) -> List[str]:
  """Names of the arrays of `state` whose checksums are not the saved ones (none where none were saved)."""
  if saved_checksums is None:
    return []
  return [name for name, value in checksums(state).items() if saved_checksums[name] != value]


def _with_saved_dtypes(manager: ocp.CheckpointManager, step: int, abstract_state):
  """`abstract_state` with each array's dtype as saved in `step` (as is where the metadata does not say)."""
  try:
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(manager.directory) / str(step) / "state").tree
  except READ_ERRORS:  # the restore itself will say what is wrong
    return abstract_state
  dtypes = {_key_names(path): getattr(leaf, "dtype", None)
            for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
  return jax.tree_util.tree_map_with_path(
      lambda path, a: jax.ShapeDtypeStruct(a.shape, dtypes.get(_key_names(path)) or a.dtype, sharding=a.sharding),
      abstract_state)


def _key_names(path) -> tuple:
  """A tree path as plain names: the metadata holds dicts where the state has dataclass fields."""
  return tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def _check_same_arrays(step: int, saved_checksums: Dict[str, str], abstract_state) -> None:
  """ConfigError unless the checkpoint holds the arrays of this run's state: names the first difference."""
  saved = set(saved_checksums)
  wanted = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
  if saved != wanted:
    only_saved, only_wanted = sorted(saved - wanted), sorted(wanted - saved)
    raise ConfigError(f"the train state in step {step} has other arrays than this run's ({len(only_saved)} only in the "
                      f"checkpoint, e.g. {(only_saved or ['none'])[0]}; {len(only_wanted)} only in this run, e.g. "
                      f"{(only_wanted or ['none'])[0]}): resume with the checkpoint's OPTIMIZER and its settings, or "
                      "train in a new MODEL_DIR")


def _read(manager: ocp.CheckpointManager, step: int, **items):
  """These items of `step`; DamagedCheckpoint on every process if any process cannot read them."""
  try:
    restored, problem = manager.restore(step, args=ocp.args.Composite(**items)), None
  except READ_ERRORS as e:
    problem = f"unreadable ({_described(e)})"
  if distributed.any_process(problem is not None):
    raise DamagedCheckpoint(problem or "unreadable on another process")
  return restored


def checksums(tree) -> Dict[str, str]:
  """Array path -> a 32-bit sum of its bits, each element weighted by an odd number from its position:
  any one flipped bit changes it, moved values change it, and it is the same whatever the sharding."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = jax.device_get(_position_weighted_sums([leaf for _, leaf in leaves]))
  return {jax.tree_util.keystr(path): f"{int(total):08x}" for (path, _), total in zip(leaves, sums)}


@jax.jit
def _position_weighted_sums(arrays):
  return [_position_weighted_sum(a) for a in arrays]


@jax.jit  # inside the jit above too: traced once per shape and dtype, not once per array (625 in BERT-base's state)
def _position_weighted_sum(x):
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
  position, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for axis in reversed(range(x.ndim)):  # the flat index, built from iotas so that no reshape regathers x
    position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * np.uint32(stride)
    stride = stride * x.shape[axis] % 2**32
  return jnp.sum(bits * (2 * position + 1), dtype=jnp.uint32)


def set_aside(model_dir: str, step: int, into: str = "damaged") -> epath.Path:
  """Moves a checkpoint out of the manager's sight, kept for inspection: MODEL_DIR/<into>/<step>."""
  target = epath.Path(model_dir) / into / str(step)
  if jax.process_index() == 0:
    _move(checkpoint_dir(model_dir) / str(step), target)
  multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
  return target


def _move(source: epath.Path, target: epath.Path) -> None:
  """Renames a directory. An object store through gcsfs has no directory to rename into (epath wants the
  target's folder to exist, and an empty one cannot): there the files are copied, then the source removed."""
  target.parent.mkdir(parents=True, exist_ok=True)
  if target.parent.exists():
    source.rename(target)
    return
  _copy_tree(source, target)
  source.rmtree()


def _copy_tree(source: epath.Path, target: epath.Path) -> None:
  for entry in source.iterdir():  # not rglob: epath refuses `**` on gs://
    if entry.is_dir():
      _copy_tree(entry, target / entry.name)
    else:
      entry.copy(target / entry.name)


def save_weights(model_dir: str, params, run_config: dict) -> None:
  """A weights-only checkpoint at step 0 (`pretrain.import_hf`), written before returning."""
  manager = make_manager(model_dir, max_to_keep=1, async_save=False)
  manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                          run_config=ocp.args.JsonSave(run_config)))
  manager.wait_until_finished()
  manager.close()


def _data_position(model_dir: str, step: int) -> epath.Path:
  return checkpoint_dir(model_dir) / str(step) / "data_iterator"  # the Composite item's name in `save`


def restore_data_position(model_dir: str, step: int, data_iterator) -> Optional[str]:
  """Only the data position of `step`, into `data_iterator`; None, or why the saved position does not fit it."""
  return data_iterator.restore(_data_position(model_dir, step))


def has_data_iterator(model_dir: str, step: int) -> bool:
  """False for a weights-only checkpoint (written by `pretrain.import_hf`)."""
  return _data_position(model_dir, step).exists()


def restore_params(model_dir: str, step: int, abstract_params=None):
  """Only the params of a checkpoint, whatever mesh wrote it.

  With `abstract_params` (ShapeDtypeStructs with shardings) they land sharded like those; without,
  as numpy arrays in host memory (export, fine-tuning), needing no mesh and no particular devices.
  """
  path = checkpoint_dir(model_dir) / str(step) / "state"
  handler = ocp.PyTreeCheckpointHandler()
  if abstract_params is None:
    abstract_params = handler.metadata(path).tree["params"]
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract_params)
  else:
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
  restored = handler.restore(path, args=ocp.args.PyTreeRestore(
      item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True))
  return restored["params"]
