"""Per-host batches of a seqio task: this process's shard, fixed shapes, checkpointable iterators."""
from typing import Iterator, Mapping, Optional

import jax
import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import tasks
from data_pipelines.feature_converters import FixedShapeFeatureConverter


class InputPipeline:
  """Batches for one run. `model_features`: name -> (per-example shape, dtype)."""

  def __init__(self, task_name: str, feature_lengths: Mapping[str, int], global_batch_size: int,
               model_features, batch_shards: int = 1, seed: int = 0,
               process_index: Optional[int] = None, process_count: Optional[int] = None):
    self.task = tasks.get_task_or_mixture(task_name)
    self.feature_lengths = dict(feature_lengths)
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    for divisor, what in ((self.process_count, "processes"), (batch_shards, "batch shards of the mesh")):
      if global_batch_size % divisor:
        raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by the {divisor} {what}")
    self.host_batch_size = global_batch_size // self.process_count
    self.converter = FixedShapeFeatureConverter(model_features)
    self.seed = seed

  @property
  def vocabulary(self) -> seqio.Vocabulary:
    return self.task.output_features["input_ids"].vocabulary

  def has_split(self, split: str) -> bool:
    return split in self.task.splits

  def dataset(self, split: str, shuffle: bool, repeat: bool) -> tf.data.Dataset:
    shard = seqio.ShardInfo(index=self.process_index, num_shards=self.process_count)
    ds = seqio.get_dataset(self.task.name, self.feature_lengths, self.converter, dataset_split=split,
                           shuffle=shuffle, num_epochs=None if repeat else 1, shard_info=shard, seed=self.seed,
                           verbose=False)
    return ds.batch(self.host_batch_size, drop_remainder=True).prefetch(2)

  def iterator(self, split: str = "train") -> Iterator:
    """A tf.data iterator (checkpointable with tf.train.Checkpoint) of numpy-convertible batches."""
    return iter(self.dataset(split, shuffle=True, repeat=True))

  def take(self, split: str, num_batches: int):
    """The same first `num_batches` batches every call: a fixed held-out set for evaluation."""
    for batch in self.dataset(split, shuffle=False, repeat=True).take(num_batches):
      yield {k: np.asarray(v) for k, v in batch.items()}
