"""Orbax checkpoints: train state (sharded, async), each process's data-iterator position, run config.

Layout: MODEL_DIR/checkpoints/<step>/{state, data_iterator/process_<i>, run_config} (the run config
is `pretrain.model_dir.RunConfig`'s JSON). The data
iterator is a tf.data iterator saved with tf.train.Checkpoint, one file per process, so a resumed
run continues each host's data stream exactly where it stopped. A weights-only checkpoint (from
`pretrain.import_hf`) has state = {params} and no data_iterator.
"""
import dataclasses
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorflow as tf
from etils import epath


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves and restores this process's tf.data iterator beside the sharded state."""

  def save(self, directory: epath.Path, args: "DataIteratorSave"):
    path = epath.Path(directory) / f"process_{jax.process_index()}"
    tf.train.Checkpoint(iterator=args.iterator).write(str(path))

  def restore(self, directory: epath.Path, args: "DataIteratorRestore"):
    path = epath.Path(directory) / f"process_{jax.process_index()}"
    tf.train.Checkpoint(iterator=args.iterator).read(str(path)).assert_consumed()
    return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  iterator: Any


def checkpoint_dir(model_dir: str) -> epath.Path:
  return epath.Path(model_dir) / "checkpoints"


def make_manager(model_dir: str, max_to_keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                         create=True)
  return ocp.CheckpointManager(checkpoint_dir(model_dir), options=options)


def save(manager: ocp.CheckpointManager, step: int, state, data_iterator, run_config: dict) -> None:
  """Asynchronous for the state; the iterator and config are small and written before returning."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data_iterator=DataIteratorSave(data_iterator),
      run_config=ocp.args.JsonSave(run_config)))


def restore(manager: ocp.CheckpointManager, step: int, abstract_state, data_iterator):
  """Restores the state into the shardings of `abstract_state` and the iterator in place."""
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data_iterator=DataIteratorRestore(data_iterator)))
  return restored.state


def save_weights(model_dir: str, params, run_config: dict) -> None:
  """A weights-only checkpoint at step 0 (`pretrain.import_hf`), written before returning."""
  manager = make_manager(model_dir, max_to_keep=1, async_save=False)
  manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params}),
                                          run_config=ocp.args.JsonSave(run_config)))
  manager.wait_until_finished()
  manager.close()


def has_data_iterator(model_dir: str, step: int) -> bool:
  """False for a weights-only checkpoint (written by `pretrain.import_hf`)."""
  return (checkpoint_dir(model_dir) / str(step) / "data_iterator").exists()


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
