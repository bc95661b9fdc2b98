"""Per-host batches of a seqio task: this process's part of the global batch, fixed shapes, a data
position that does not depend on the number of processes.

Tasks of independent examples (BERT, ALBERT, BART, T5): the global batch is made of
`num_data_shards` equal parts, each read from its own seqio shard (`ShardInfo(index,
num_data_shards)`); a process reads the contiguous run of shards its rows belong to. By default
there is one shard per process. Fixing the number of shards keeps the global batch the same however
many processes read it (1 process × 4 devices = 2 processes × 2 devices). A mixture samples its tasks
with a seed of its own per shard, so the rows of a batch do not all draw the same task at once. Each
shard has its own iterator, saved on its own (`ShardIterators`).

Tasks whose examples continue one text stream (XLNet): every row reads its own stream of the task's
token file, in one pipeline per process however many rows it has (`row_streams`); a batch is made
from the step number alone, so the data position is the number of batches taken (`StepIterator`).
With `bi_data`, odd rows read the text of the row before them right to left.
"""
import json
import os
import re
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import jax
import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import example_check, record_files, sources, storage, tasks
from data_pipelines.feature_converters import FixedShapeFeatureConverter
from data_pipelines.row_streams import RowStreams
from data_pipelines.token_files import DamagedFile, TokenFile

REREAD_WARNING_BYTES = 2**30  # a host reading its text more than once beyond this is worth a warning


class InputPipeline:
  """Batches for one run. `model_features`: name -> (per-example shape, dtype)."""

  def __init__(self, task_name: str, feature_lengths: Mapping[str, int], global_batch_size: int,
               model_features, data_parallel_groups: int = 1, seed: int = 0, num_data_shards: Optional[int] = None,
               bi_data: bool = False, process_index: Optional[int] = None,
               process_count: Optional[int] = None, first_example_seconds: float = example_check.FIRST_EXAMPLE_SECONDS):
    self.task = tasks.get_task_or_mixture(task_name)
    if isinstance(self.task, seqio.Mixture) and tasks.continues_across_examples(self.task):
      raise ValueError(f"mixture {task_name!r} mixes tasks whose examples continue one text stream (XLNet): "
                       "mixing would interleave the streams; give one task all the corpora's files instead")
    self.feature_lengths = dict(feature_lengths)
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    self.reads_streams = tasks.continues_across_examples(self.task)
    if self.reads_streams and num_data_shards:
      raise ValueError(f"DATA_SHARDS={num_data_shards} does not apply to {task_name!r}: each of its rows reads a "
                       "stream of its token file; leave DATA_SHARDS unset")
    if bi_data and not self.reads_streams:
      raise ValueError(f"bi_data needs a task whose rows read text streams (xlnet_plm); {task_name!r} is not one")
    self.num_data_shards = num_data_shards or self.process_count
    for divisor, what in ((self.process_count, "processes"), (data_parallel_groups, "data-parallel groups of the mesh"),
                          (self.num_data_shards, "data shards")):
      if global_batch_size % divisor:
        raise ValueError(f"BATCH_SIZE={global_batch_size} is not divisible by the {divisor} {what}")
    if self.num_data_shards % self.process_count:
      raise ValueError(f"DATA_SHARDS={self.num_data_shards} is not a multiple of the {self.process_count} processes")
    self.global_batch_size = global_batch_size
    self.host_batch_size = global_batch_size // self.process_count
    self.shards_per_process = self.num_data_shards // self.process_count
    self.converter = FixedShapeFeatureConverter(model_features)
    self.seed = seed
    self.bi_data = bi_data
    if bi_data and global_batch_size % 2:
      raise ValueError(f"bi_data pairs forward and backward rows: BATCH_SIZE={global_batch_size} must be even")
    self._token_files: Dict[str, TokenFile] = {}
    self.first_example_seconds = first_example_seconds
    self._checked_splits: Set[str] = set()
    self._held_out: Dict[Tuple[str, int], tf.data.Dataset] = {}
    if self.process_index == 0 and not self.reads_streams:
      self._warn_if_shards_reread("train")

  @property
  def vocabulary(self) -> seqio.Vocabulary:
    return tasks.vocabulary(self.task)

  def has_split(self, split: str) -> bool:
    return split in self.task.splits

  def _warn_if_shards_reread(self, split: str) -> None:
    """Text sources shard by file: with fewer files than shards every shard reads all of them."""
    for task in seqio.get_subtasks(self.task):
      source = task.source
      if not isinstance(source, sources.TextDocumentSource) or split not in source.splits:
        continue
      num_files = len(source.list_shards(split))
      if num_files >= self.num_data_shards:
        continue
      size = source.total_bytes(split)
      per_host = size * self.shards_per_process
      if per_host > REREAD_WARNING_BYTES:
        print(f"warning: {task.name} reads {num_files} file(s) ({size / 2**30:.2f} GiB) as {self.num_data_shards} "
              f"data shards, so each shard reads all of them: {per_host / 2**30:.1f} GiB per host per pass. Split "
              f"the text into {self.num_data_shards} files: "
              f"python -m data_pipelines.split_text --num_files={self.num_data_shards}")

  def _data_shards(self) -> List[seqio.ShardInfo]:
    first = self.process_index * self.shards_per_process
    return [seqio.ShardInfo(index=index, num_shards=self.num_data_shards)
            for index in range(first, first + self.shards_per_process)]

  def check_examples(self, split: str, say=print) -> None:
    """Raises example_check.NoExamples if this process's share of `split` makes no example, instead of
    reading it forever; a stream task's token file is opened (tokenized first if it is not yet). Once
    per split."""
    if split in self._checked_splits:
      return
    if self.reads_streams:
      self._token_file(split, say)
    else:
      for shard in self._data_shards():
        tasks.check_examples(self.task, split, shard, self.first_example_seconds)
    self._checked_splits.add(split)

  def shard_datasets(self, split: str, shuffle: bool) -> Dict[int, tf.data.Dataset]:
    """Data shard index -> batches of its rows, repeated, for each data shard this process reads."""
    rows_per_shard = self.host_batch_size // self.shards_per_process
    datasets = {}
    for shard in self._data_shards():
      shard_seed = int(np.random.SeedSequence((self.seed, shard.index)).generate_state(1)[0])
      ds = tasks.get_dataset(self.task, self.feature_lengths, features=self.converter.model_features, split=split,
                             shuffle=shuffle, num_epochs=None, shard_info=shard, seed=shard_seed)
      datasets[shard.index] = self.converter(ds, self.feature_lengths).batch(rows_per_shard, drop_remainder=True)
    return datasets

  def stream_batches(self, split: str, first_step: int, say=print) -> tf.data.Dataset:
    """This process's rows of the row streams' batches from `first_step` on."""
    first_row = self.process_index * self.host_batch_size
    rows = range(first_row, first_row + self.host_batch_size)
    examples = stream_examples(self.task, self.feature_lengths, self._token_file(split, say), rows,
                               num_rows=self.global_batch_size, bi_data=self.bi_data, seed=self.seed,
                               first_step=first_step)
    return self.converter(examples, self.feature_lengths).batch(self.host_batch_size, drop_remainder=True)

  def _token_file(self, split: str, say=print) -> TokenFile:
    """Opened once: every evaluation reads the held-out split again."""
    if split not in self._token_files:
      self._token_files[split] = tasks.token_file(self.task, split, say=say)
    return self._token_files[split]

  def iterator(self, split: str = "train", say=print):
    """This process's batches, read on, in an iterator whose position can be saved and restored. The input
    is checked here, not at the first batch (`check_examples`)."""
    self.check_examples(split, say)
    if self.reads_streams:
      return StepIterator(lambda first_step: self.stream_batches(split, first_step, say).prefetch(2),
                          write=self.process_index == 0)
    datasets = self.shard_datasets(split, shuffle=True)
    return ShardIterators({index: iter(ds.prefetch(2)) for index, ds in datasets.items()}, self.num_data_shards,
                          record_paths=lambda: self._source_files(split, seqio.TfdsDataSource),
                          text_paths=lambda: self._source_files(split, sources.TextDocumentSource))

  def _source_files(self, split: str, kind: type) -> List[str]:
    """The files that the split's sources of a kind read: TFDS's record files, or text files."""
    return [path for task in seqio.get_subtasks(self.task)
            if isinstance(task.source, kind) and split in task.source.splits
            for path in task.source.list_shards(split)]

  def take(self, split: str, num_batches: int):
    """The same first `num_batches` batches every call: a fixed held-out set for evaluation. Its pipeline is
    built once (building traces the objective's functions: seconds) and read from its start at each call."""
    if (split, num_batches) not in self._held_out:
      self.check_examples(split)
      if self.reads_streams:
        batches = self.stream_batches(split, 0)
      else:
        batches = tf.data.Dataset.zip(tuple(self.shard_datasets(split, shuffle=False).values())).map(
            lambda *parts: {k: tf.concat([part[k] for part in parts], axis=0) for k in parts[0]})
      self._held_out[split, num_batches] = batches.take(num_batches)
    return self._held_out[split, num_batches].as_numpy_iterator()


def task_examples(task, feature_lengths: Mapping[str, int], split: str, seed: int = 0,
                  say=print) -> tf.data.Dataset:
  """A task's examples as training makes them, unshuffled; a stream task's are one row's, step after step.
  Raises example_check.NoExamples where the text makes none."""
  if tasks.continues_across_examples(task):
    return stream_examples(task, feature_lengths, tasks.token_file(task, split, say=say), [0], num_rows=1,
                           bi_data=False, seed=seed)
  tasks.check_examples(task, split)
  return tasks.get_dataset(task, feature_lengths, split=split, shuffle=False, seed=seed, num_epochs=1)


def stream_examples(task, feature_lengths: Mapping[str, int], token_file: TokenFile, rows: Sequence[int], *,
                    num_rows: int, bi_data: bool, seed: int, first_step: int = 0) -> tf.data.Dataset:
  """The examples of `rows` of a stream task's `num_rows` row streams over `token_file`, step after step,
  in row order."""
  reading = tasks.stream_reading(task, feature_lengths)
  streams = RowStreams(token_file, num_rows=num_rows, bi_data=bi_data, step_len=reading.step_len,
                       window_len=reading.window_len, seed=seed)
  return streams.dataset(rows, first_step, reading.example)


class ShardIterators:
  """A process's batches as one tf.data iterator per data shard, in shard order.

  Where a shard stands is saved in a file of its own (`shard_<index>_of_<count>`), so a run saved by N
  processes continues each shard's stream exactly on M processes, as long as the data shards are the
  same: the global batch is made of the same shards whichever process reads them.

  A read that fails moves a tf.data iterator past what it was reading (the file, and the batch's examples
  taken before it), so after a failure the position saved would skip them. And a position saved in the
  batches before a failure surfaced may hold it: tf.data saves what it has read ahead, a failed read among them.
  """

  position_survives_failure = False

  def __init__(self, iterators: Mapping[int, Iterator], num_shards: int,
               record_paths: Callable[[], Sequence[str]] = list, text_paths: Callable[[], Sequence[str]] = list):
    """`record_paths`: where to look for a record that tf.data found corrupted, to name its file; `text_paths`:
    the text files read, for `mended_file`."""
    self.iterators, self.num_shards = dict(iterators), num_shards
    self.record_paths, self.text_paths = record_paths, text_paths

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    try:
      batches = [next(iterator) for iterator in self.iterators.values()]
    except tf.errors.DataLossError as e:
      corrupted = re.search(r"corrupted record at (\d+)", str(e))
      path = corrupted and record_files.corrupted_record_file(self.record_paths(), int(corrupted.group(1)))
      if not path:
        raise
      raise DamagedFile(f"{path} is damaged: the record whose data starts at byte {corrupted.group(1)} fails its "
                        "checksum; restore the file, or prepare the dataset again") from e
    if len(batches) == 1:
      return {k: np.asarray(v) for k, v in batches[0].items()}
    return {k: np.concatenate([np.asarray(b[k]) for b in batches]) for k in batches[0]}

  def mended_file(self, error: Exception) -> Optional[str]:
    """The text file that a failed read names, if the whole of it reads now: the input was mended since."""
    for path in self.text_paths():
      if path in str(error):
        try:
          with storage.open_file(path, "rb") as f:
            f.read()
        except (OSError, tf.errors.OpError):
          return None
        return path
    return None

  def _file(self, directory, index: int) -> str:
    return os.path.join(str(directory), f"shard_{index}_of_{self.num_shards}")

  def save(self, directory) -> None:
    staged = storage.StagedDirectory(str(directory))  # tf.train.Checkpoint writes with TensorFlow's filesystem
    try:
      for index, iterator in self.iterators.items():
        tf.train.Checkpoint(iterator=iterator).write(self._file(staged.path, index))
      staged.sync()
    finally:
      staged.close()

  def restore(self, directory) -> Optional[str]:
    """Restores every shard's position if all were saved; else restores none and says why."""
    missing = [index for index in self.iterators if not storage.exists(self._file(directory, index) + ".index")]
    if missing:
      return (f"it holds no position of data shard {missing[0]} of {self.num_shards} (DATA_SHARDS, or one per "
              "process when unset)")
    staged = storage.StagedDirectory(str(directory))
    try:
      staged.download()
      for index, iterator in self.iterators.items():
        tf.train.Checkpoint(iterator=iterator).read(self._file(staged.path, index)).assert_consumed()
    finally:
      staged.close()
    return None


class StepIterator:
  """Batches made from the step number alone (row streams): the data position is the number of batches
  taken, one number for the whole run, written by process 0. A batch that fails is not counted, so the
  position saved after it makes that batch again."""

  FILE = "batches_taken.json"
  position_survives_failure = True

  def __init__(self, batches_from: Callable[[int], tf.data.Dataset], write: bool):
    self._batches_from, self._write = batches_from, write
    self.batches_taken, self._iterator = 0, None

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    if self._iterator is None:  # made on first use: a restore before it moves the start
      self._iterator = self._batches_from(self.batches_taken).as_numpy_iterator()
    batch = next(self._iterator)
    self.batches_taken += 1
    return batch

  def save(self, directory) -> None:
    if self._write:
      storage.makedirs(str(directory))
      with storage.open_file(os.path.join(str(directory), self.FILE), "w") as f:
        json.dump({"batches_taken": self.batches_taken}, f)

  def restore(self, directory) -> Optional[str]:
    path = os.path.join(str(directory), self.FILE)
    if not storage.exists(path):
      return "it holds the positions of data shards, not of row streams (saved by an earlier version)"
    with storage.open_file(path) as f:
      self.batches_taken = int(json.load(f)["batches_taken"])
    self._iterator = None
    return None
