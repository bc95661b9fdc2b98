"""Per-host batches of a seqio task: this process's shards, fixed shapes, checkpointable iterators.

The global batch is made of `num_data_shards` equal parts, each read from its own seqio shard
(`ShardInfo(index, num_data_shards)`); a process reads the contiguous run of shards its rows
belong to. By default there is one shard per process. Fixing the number of shards keeps the global
batch the same however many processes read it (1 process × 4 devices = 2 processes × 2 devices),
and one shard per batch row gives every row its own continuous stream (XLNet's memory needs that).
With `bi_data` (XLNet), odd shards read the backward task (`<task>_backward`) of the shard before
them: each forward row is paired with the same text read right to left.

A mixture samples its tasks with a seed of its own per shard, so the rows of a batch do not all
draw the same task at once. Each shard has its own iterator, saved on its own: the data position
of a run does not depend on how many processes read it (`ShardIterators`).
"""
import os
from typing import Dict, Iterator, List, Mapping, Optional

import jax
import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import sources, tasks
from data_pipelines.feature_converters import FixedShapeFeatureConverter

REREAD_WARNING_BYTES = 2**30  # a host reading its text more than once beyond this is worth a warning


class InputPipeline:
  """Batches for one run. `model_features`: name -> (per-example shape, dtype)."""

  def __init__(self, task_name: str, feature_lengths: Mapping[str, int], global_batch_size: int,
               model_features, data_parallel_groups: int = 1, seed: int = 0, num_data_shards: Optional[int] = None,
               bi_data: bool = False, process_index: Optional[int] = None,
               process_count: Optional[int] = None):
    self.task = tasks.get_task_or_mixture(task_name)
    if isinstance(self.task, seqio.Mixture) and tasks.continues_across_examples(self.task):
      raise ValueError(f"mixture {task_name!r} mixes tasks whose examples continue one text stream (XLNet): "
                       "mixing would interleave the streams; give one task all the corpora's files instead")
    self.feature_lengths = dict(feature_lengths)
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    self.num_data_shards = num_data_shards or self.process_count
    for divisor, what in ((self.process_count, "processes"), (data_parallel_groups, "data-parallel groups of the mesh"),
                          (self.num_data_shards, "data shards")):
      if global_batch_size % divisor:
        raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by the {divisor} {what}")
    if self.num_data_shards % self.process_count:
      raise ValueError(f"DATA_SHARDS={self.num_data_shards} is not a multiple of the {self.process_count} processes")
    self.host_batch_size = global_batch_size // self.process_count
    self.shards_per_process = self.num_data_shards // self.process_count
    self.converter = FixedShapeFeatureConverter(model_features)
    self.seed = seed
    self.bi_data = bi_data
    if bi_data and self.shards_per_process % 2:
      raise ValueError(f"bi_data needs an even number of data shards per process, got {self.shards_per_process}")
    if self.process_index == 0:
      self._warn_if_shards_reread("train")

  @property
  def vocabulary(self) -> seqio.Vocabulary:
    return tasks.vocabulary(self.task)

  def has_split(self, split: str) -> bool:
    return split in self.task.splits

  def data_shard(self, index: int) -> tuple:
    """(task name, seqio shard) that data shard `index` of the global batch reads.

    With bi_data, shards pair up: both read one of num_data_shards / 2 parts of the data, the even
    one forwards and the odd one backwards.
    """
    if not self.bi_data:
      return self.task.name, seqio.ShardInfo(index=index, num_shards=self.num_data_shards)
    task_name = self.task.name + tasks.BACKWARD_SUFFIX if index % 2 else self.task.name
    return task_name, seqio.ShardInfo(index=index // 2, num_shards=self.num_data_shards // 2)

  def _warn_if_shards_reread(self, split: str) -> None:
    """Text sources shard by file: with fewer files than shards every shard reads all of them."""
    num_shards = self.data_shard(0)[1].num_shards
    for task in seqio.get_subtasks(self.task):
      source = task.source
      if not isinstance(source, sources.TextDocumentSource) or split not in source.splits:
        continue
      num_files = len(source.list_shards(split))
      if num_files >= num_shards:
        continue
      size = source.total_bytes(split)
      per_host = size * self.shards_per_process
      if per_host > REREAD_WARNING_BYTES:
        print(f"warning: {task.name} reads {num_files} file(s) ({size / 2**30:.2f} GiB) as {num_shards} data "
              f"shards, so each shard reads all of them: {per_host / 2**30:.1f} GiB per host per pass. "
              f"Split the text into {num_shards} files: python -m data_pipelines.split_text --num_files={num_shards}")

  def shard_datasets(self, split: str, shuffle: bool, repeat: bool) -> Dict[int, tf.data.Dataset]:
    """Data shard index -> batches of its rows, for each data shard this process reads."""
    rows_per_shard = self.host_batch_size // self.shards_per_process
    shuffle = shuffle and not tasks.continues_across_examples(self.task)
    datasets, first = {}, self.process_index * self.shards_per_process
    for index in range(first, first + self.shards_per_process):
      task_name, shard = self.data_shard(index)
      shard_seed = int(np.random.SeedSequence((self.seed, shard.index)).generate_state(1)[0])
      ds = tasks.get_dataset(seqio.get_mixture_or_task(task_name), self.feature_lengths,
                             features=self.converter.model_features, split=split, shuffle=shuffle,
                             num_epochs=None if repeat else 1, shard_info=shard, seed=shard_seed)
      datasets[index] = self.converter(ds, self.feature_lengths).batch(rows_per_shard, drop_remainder=True)
    return datasets

  def iterator(self, split: str = "train") -> "ShardIterators":
    """This process's batches, read on: one iterator per data shard, each of which can be saved and restored."""
    datasets = self.shard_datasets(split, shuffle=True, repeat=True)
    return ShardIterators({index: iter(ds.prefetch(2)) for index, ds in datasets.items()}, self.num_data_shards)

  def take(self, split: str, num_batches: int):
    """The same first `num_batches` batches every call: a fixed held-out set for evaluation."""
    parts = list(self.shard_datasets(split, shuffle=False, repeat=True).values())
    for batches in tf.data.Dataset.zip(tuple(parts)).take(num_batches):
      yield {k: np.concatenate([np.asarray(b[k]) for b in batches]) for k in batches[0]}


class ShardIterators:
  """A process's batches as one tf.data iterator per data shard, in shard order.

  Where a shard stands is saved in a file of its own (`shard_<index>_of_<count>`), so a run saved by N
  processes continues each shard's stream exactly on M processes, as long as the data shards are the
  same: the global batch is made of the same shards whichever process reads them.
  """

  def __init__(self, iterators: Mapping[int, Iterator], num_shards: int):
    self.iterators, self.num_shards = dict(iterators), num_shards

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    batches = [next(iterator) for iterator in self.iterators.values()]
    if len(batches) == 1:
      return {k: np.asarray(v) for k, v in batches[0].items()}
    return {k: np.concatenate([np.asarray(b[k]) for b in batches]) for k in batches[0]}

  def _file(self, directory, index: int) -> str:
    return os.path.join(str(directory), f"shard_{index}_of_{self.num_shards}")

  def save(self, directory) -> None:
    for index, iterator in self.iterators.items():
      tf.train.Checkpoint(iterator=iterator).write(self._file(directory, index))

  def restore(self, directory) -> List[int]:
    """Restores every shard's position if all were saved; returns the shards that were not (then none is
    restored, and the stream starts from its beginning)."""
    missing = [index for index in self.iterators if not tf.io.gfile.exists(self._file(directory, index) + ".index")]
    if not missing:
      for index, iterator in self.iterators.items():
        tf.train.Checkpoint(iterator=iterator).read(self._file(directory, index)).assert_consumed()
    return missing
