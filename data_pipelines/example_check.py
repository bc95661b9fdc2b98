"""Whether a split's input can make an example, decided from its tokenized documents before a run reads it.

seqio repeats a task's tokenized documents before its objective: an objective that makes nothing of any
of them (NSP on one document of one sentence, say) would leave tf.data reading the same text forever.
So each split, and each data shard of it, is read first until its documents hold what the objective
needs (a `Requirement`, stated by the objective in `tasks.OBJECTIVES`): at once for usual text. A whole
pass without it, or `seconds` of reading, stops with `NoExamples`, one line that names the files, the
objective and what the documents lacked.
"""
import dataclasses
import time
from typing import Callable, NamedTuple, Optional, Set

import numpy as np
import seqio
import tensorflow as tf

from data_pipelines import sources, storage

FIRST_EXAMPLE_SECONDS = 60.0  # usual text meets a requirement in its first documents, in milliseconds


class NoExamples(ValueError):
  """A split's input makes no example; the message says which files, which objective and why."""


@dataclasses.dataclass
class Documents:
  """What the tokenized documents read so far hold."""
  count: int = 0
  distinct: Set[int] = dataclasses.field(default_factory=set)  # hashes of their token ids
  most_sentences: int = 0
  most_tokens: int = 0

  def add(self, values: np.ndarray, row_splits: np.ndarray) -> None:
    self.count += 1
    self.distinct.add(hash((values.tobytes(), row_splits.tobytes())))
    self.most_sentences = max(self.most_sentences, len(row_splits) - 1)
    self.most_tokens = max(self.most_tokens, len(values))

  def describe(self) -> str:
    if not self.count:
      return "it holds no sentence (blank lines only, or nothing the vocabulary makes pieces of)"
    return (f"its {self.count} document(s), {len(self.distinct)} different, hold at most {self.most_sentences} "
            f"sentence(s) and {self.most_tokens} token(s)")


class Requirement(NamedTuple):
  """What the documents must hold for an objective to make an example of them."""
  met: Callable[[Documents], bool]
  needs: str  # in words: "<objective> needs ..."


def tokenized_documents(task: seqio.Task, split: str, shard_info: Optional[seqio.ShardInfo]) -> tf.data.Dataset:
  """One pass over the task's tokenized documents of a data shard as (ids, sentence row_splits), unshuffled,
  sharded as seqio shards them: by file when there are enough files, else by document."""
  source = task.source
  by_document = (shard_info is not None and not source.supports_arbitrary_sharding
                 and len(source.list_shards(split)) < shard_info.num_shards)
  if by_document:
    dataset = source.get_dataset(split=split, shuffle=False).shard(shard_info.num_shards, shard_info.index)
  else:
    dataset = source.get_dataset(split=split, shuffle=False, shard_info=shard_info)
  options = tf.data.Options()
  options.experimental_optimization.apply_default_optimizations = False  # read once: no time for optimizing
  sentences = task.preprocess_precache(dataset).map(lambda document: document["sentences"])
  return sentences.map(lambda ids: (ids.flat_values, ids.row_splits)).with_options(options)


# Text files (with their sizes and times), split and shard whose documents met their task's requirement in
# this process: a process that trains, resumes and evaluates on the same files reads them once.
_MET: Set[tuple] = set()


def _unchanged_input(task: seqio.Task, split: str, shard_info: Optional[seqio.ShardInfo]) -> Optional[tuple]:
  """What names a text task's input as it is now; None for other sources (checked every time)."""
  if not isinstance(task.source, sources.TextDocumentSource):
    return None
  files = tuple((f, storage.stat(f).length, storage.stat(f).mtime_nsec) for f in task.source.list_shards(split))
  return task.name, split, shard_info, files


def check(task: seqio.Task, split: str, objective: str, requirement: Requirement,
          shard_info: Optional[seqio.ShardInfo] = None, seconds: float = FIRST_EXAMPLE_SECONDS) -> None:
  """Returns once the documents meet `requirement`; raises NoExamples after a pass or `seconds` without."""
  key = _unchanged_input(task, split, shard_info)
  if key in _MET:
    return
  documents, deadline = Documents(), time.monotonic() + seconds
  for ids, row_splits in tokenized_documents(task, split, shard_info).as_numpy_iterator():
    documents.add(ids, row_splits)
    if requirement.met(documents):
      if key:
        _MET.add(key)
      return
    if time.monotonic() > deadline:
      raise NoExamples(f"{_what(task, split, objective, shard_info)} in its first {seconds:g} s of text: "
                       f"{documents.describe()}; {objective} needs {requirement.needs}")
  raise NoExamples(f"{_what(task, split, objective, shard_info)}: {documents.describe()}; {objective} needs "
                   f"{requirement.needs}")


def _what(task: seqio.Task, split: str, objective: str, shard_info: Optional[seqio.ShardInfo]) -> str:
  describe = getattr(task.source, "describe", None)
  files = f" ({describe(split)})" if describe else ""
  shard = (f", data shard {shard_info.index} of {shard_info.num_shards} (its share of the documents)"
           if shard_info and shard_info.num_shards > 1 else "")
  return f"{objective} makes no example from the {split} text of {task.name}{files}{shard}"
