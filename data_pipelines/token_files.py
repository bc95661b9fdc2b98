"""Token files: a split of a corpus tokenized once, then read at any position (XLNet's row streams).

A token directory holds one split. `tokens-<i>-of-<n>.int32` per source shard (a text file, a TFDS
file shard): the shard's documents one after another as little-endian int32 ids, where a token that
starts a sentence is stored as its bitwise complement (negative), so one array carries the ids and
the sentence boundaries the objective splits at. The first token of every document starts a
sentence. `info.json`, written last, lists the parts with their token counts and the task and
vocabulary that made them: a directory without it is unfinished, and `write` continues it, keeping
the parts already written. Paths may be local or gs:// (data_pipelines.storage).
"""
import hashlib
import json
import os
import threading
import uuid
from typing import IO, Dict, List, Optional

import numpy as np
import seqio
import tensorflow as tf
from etils import epath
from tqdm import tqdm

from data_pipelines import storage
from data_pipelines.example_check import NoExamples

INFO_FILE = "info.json"
_BYTES_PER_TOKEN = 4
_WRITE_CHUNK_TOKENS = 1 << 20


class DamagedFile(ValueError):
  """A data file that does not hold what it should: a token part cut short or with ids outside the vocabulary
  (what its info.json says), a record whose checksum fails (`input_pipeline.ShardIterators`)."""


def part_name(index: int, count: int) -> str:
  return f"tokens-{index:05d}-of-{count:05d}.int32"


def _temporary(path: str) -> str:
  """A name to write `path` under before renaming it: unique, as processes on one machine may write the same."""
  return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


@tf.autograph.experimental.do_not_convert
def _encode(example) -> tf.Tensor:
  """{'sentences': ragged [num_sentences, None]} -> int32 [num_tokens], sentence starts complemented."""
  sentences = example["sentences"]
  ids = tf.cast(sentences.flat_values, tf.int32)
  sentence = tf.cast(sentences.value_rowids(), tf.int32)
  starts = sentence != tf.concat([[-1], sentence[:-1]], 0)
  return tf.where(starts, tf.bitwise.invert(ids), ids)


def decode(encoded: np.ndarray):
  """int32 as stored -> (ids, sentence_start bool)."""
  starts = encoded < 0
  return np.where(starts, ~encoded, encoded), starts


def write_part(path: str, documents: tf.data.Dataset) -> None:
  """Writes one part: tokenized documents {'sentences': ragged [num_sentences, None]}, one after another."""
  encoded = documents.map(_encode, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
  temporary = _temporary(path)
  try:
    with storage.open_file(temporary, "wb") as f:
      f.write(b"")  # GFile makes the file at its first write: an empty part must exist too
      pending, pending_tokens = [], 0
      for tokens in encoded.as_numpy_iterator():
        pending.append(tokens)
        pending_tokens += tokens.size
        if pending_tokens >= _WRITE_CHUNK_TOKENS:
          f.write(np.concatenate(pending).astype("<i4").tobytes())
          pending, pending_tokens = [], 0
      if pending:
        f.write(np.concatenate(pending).astype("<i4").tobytes())
  except BaseException:  # an error, or a signal that stops the run (pretrain.signals): no half-written part is left
    epath.Path(temporary).unlink(missing_ok=True)
    raise
  storage.rename(temporary, path, overwrite=True)  # a part that exists is complete


def write(task: seqio.Task, split: str, directory: str, progress: bool = True) -> dict:
  """Tokenizes `split` of `task`'s source into `directory`, continuing an unfinished one; returns its info."""
  shards = task.source.list_shards(split)
  storage.makedirs(directory)
  total = 0
  with tqdm(total=len(shards), unit="part", desc=f"{task.name} {split}", disable=not progress) as bar:
    for index in range(len(shards)):
      path = os.path.join(directory, part_name(index, len(shards)))
      if not storage.exists(path):
        documents = task.source.get_dataset(split, shuffle=False, shard_info=seqio.ShardInfo(index, len(shards)))
        write_part(path, task.preprocess_precache(documents))  # the task's own tokenization
      total += storage.stat(path).length // _BYTES_PER_TOKEN
      bar.set_postfix(tokens=f"{total:,}")
      bar.update()
  if total == 0:
    raise NoExamples(f"the {split} text of {task.name} holds no sentences to tokenize ({len(shards)} file(s), e.g. "
                     f"{shards[0]})")
  vocabulary = next(iter(task.output_features.values())).vocabulary
  return finish(directory, len(shards), task=task.name, split=split, vocab_size=vocabulary.vocab_size,
                vocab_model=getattr(vocabulary, "sentencepiece_model_file", None))


def finish(directory: str, num_parts: int, **about) -> dict:
  """Writes info.json over the directory's `num_parts` written parts, with `about` (task, vocabulary)."""
  parts = []
  for index in range(num_parts):
    name = part_name(index, num_parts)
    parts.append({"file": name, "tokens": storage.stat(os.path.join(directory, name)).length // _BYTES_PER_TOKEN})
  info = {**about, "tokens": sum(part["tokens"] for part in parts), "parts": parts}
  info_path = os.path.join(directory, INFO_FILE)
  temporary = _temporary(info_path)
  with storage.open_file(temporary, "w") as f:
    json.dump(info, f, indent=1)
  storage.rename(temporary, info_path, overwrite=True)
  return info


def fingerprint(task: seqio.Task, split: str) -> str:
  """Names what a token directory of `split` would hold: the task, its source's shards (with their sizes
  and times where they are files) and the vocabulary's bytes."""
  h = hashlib.sha256(f"{task.name}\n{split}\n".encode())
  for shard in task.source.list_shards(split):
    h.update(shard.encode())
    if storage.exists(shard):
      stat = storage.stat(shard)
      h.update(f" {stat.length} {stat.mtime_nsec}\n".encode())
  vocabulary = next(iter(task.output_features.values())).vocabulary
  model_file = getattr(vocabulary, "sentencepiece_model_file", None)
  h.update(storage.open_file(model_file, "rb").read() if model_file else repr(vocabulary).encode())
  return h.hexdigest()[:16]


class TokenFile:
  """A token directory read as one circular array: position p is token p mod `size`."""

  def __init__(self, directory: str):
    info_path = os.path.join(directory, INFO_FILE)
    if not storage.exists(info_path):
      raise FileNotFoundError(f"{directory} has no {INFO_FILE}: not a finished token directory; make it with "
                              "python -m data_pipelines.tokenize (which continues an unfinished one)")
    with storage.open_file(info_path) as f:
      self.info = json.load(f)
    self.directory = directory
    self.size = int(self.info["tokens"])
    self.vocab_size = int(self.info["vocab_size"])
    if self.size < 1:  # rows read it around and around: an empty one would give no window
      raise NoExamples(f"{directory} holds no tokens ({INFO_FILE}): tokenize text that has some")
    counts = [part["tokens"] for part in self.info["parts"]]
    self._starts = np.concatenate([[0], np.cumsum(counts)])
    self._paths = [os.path.join(directory, part["file"]) for part in self.info["parts"]]
    self._files: Dict[int, IO] = {}
    self._lock = threading.Lock()  # a file's seek and read belong together

  def _read_part(self, part: int, offset: int, count: int) -> np.ndarray:
    if part not in self._files:
      self._files[part] = storage.open_file(self._paths[part], "rb")
    f = self._files[part]
    f.seek(offset * _BYTES_PER_TOKEN)
    data = f.read(count * _BYTES_PER_TOKEN)
    if len(data) != count * _BYTES_PER_TOKEN:
      raise DamagedFile(f"{self._paths[part]} is shorter than its {INFO_FILE} says: read {len(data)} bytes at "
                       f"{offset * _BYTES_PER_TOKEN}, wanted {count * _BYTES_PER_TOKEN}; tokenize it again")
    tokens = np.frombuffer(data, "<i4")
    # A stored token is an id or its complement (-id - 1): anything outside [-vocab_size, vocab_size) is damage.
    outside = np.flatnonzero((tokens < -self.vocab_size) | (tokens >= self.vocab_size))
    if outside.size:
      stored = int(tokens[outside[0]])
      raise DamagedFile(f"{self._paths[part]} is damaged: its token {offset + int(outside[0])} reads as id "
                       f"{~stored if stored < 0 else stored}, outside the vocabulary of {self.vocab_size} ids "
                       f"({outside.size} such in the {count} read); tokenize it again")
    return tokens

  def read(self, start: int, count: int) -> np.ndarray:
    """`count` stored tokens from position `start`, around the end to the beginning as often as needed."""
    pieces: List[np.ndarray] = []
    position = start % self.size
    while count > 0:
      part = int(np.searchsorted(self._starts, position, side="right")) - 1
      take = min(count, int(self._starts[part + 1]) - position)
      with self._lock:
        pieces.append(self._read_part(part, position - int(self._starts[part]), take))
      position, count = (position + take) % self.size, count - take
    return np.concatenate(pieces) if pieces else np.zeros([0], np.int32)

  def read_text(self, start: int, count: int, backward: bool = False):
    """(ids, sentence_start) of `count` tokens from `start`. backward: of the text read right to left, in
    which position p is token size-1-p, and a sentence starts where it ends when read forwards."""
    if not backward:
      return decode(self.read(start, count))
    first = self.size - (start % self.size) - count  # the forward tokens [first, first + count), plus one
    ids, starts = decode(self.read(first, count + 1))
    return ids[:count][::-1], starts[1:][::-1]


def cached(task: seqio.Task, split: str, cache_root: str, say=print) -> str:
  """The token directory of `split` under `cache_root`, tokenized on first use."""
  directory = os.path.join(cache_root, f"{task.name}-{split}-{fingerprint(task, split)}")
  if not storage.exists(os.path.join(directory, INFO_FILE)):
    say(f"tokenizing {task.name} ({split}) once into {directory}; for a pod, tokenize ahead with "
        "python -m data_pipelines.tokenize and set TOKEN_DIR")
    write(task, split, directory, progress=False)
  return directory


def open_split(token_dir: Optional[str], task: seqio.Task, split: str, cache_root: str, say=print) -> TokenFile:
  """The token file of `split`: from TOKEN_DIR/<split> when given, else from the cache."""
  if token_dir:
    return TokenFile(os.path.join(token_dir, split))
  return TokenFile(cached(task, split, cache_root, say))
