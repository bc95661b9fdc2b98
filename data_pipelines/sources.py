"""Data sources: every source yields documents as {'text': sentences joined by '\\n'}.

Plain text files follow the BERT reference format: one sentence per line, a blank line between
documents. TFDS datasets (wikipedia, bookcorpus, c4, ...) are read with `seqio.TfdsDataSource`
and normalised to the same document format by `tfds_to_documents`.
"""
from typing import Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf
from absl import logging

from data_pipelines import storage

_BLANK_LINES = r"\n[ \t\r]*\n[\s]*"  # one or more blank (or whitespace-only) lines
_DOCUMENT_BREAK = "\x1e"  # ASCII record separator: cannot occur in decoded text lines
# Far longer than any sentence or paragraph; tokenizing a line holds a few hundred times its size in memory.
MAX_LINE_BYTES = 2**20


@tf.autograph.experimental.do_not_convert  # plain TF ops: converting it for tf.data took most of a pipeline's build
def split_documents(file_content: tf.Tensor, file_name: tf.Tensor) -> tf.data.Dataset:
  """One file's bytes -> dataset of {'text'} documents.

  Bytes that are not UTF-8 become U+FFFD rather than failing the pipeline; whitespace-only lines
  end a document like blank lines do; empty documents are dropped. Lines longer than MAX_LINE_BYTES
  are no sentences (a file without line breaks, say): they are dropped, counted in a warning on stderr
  each time the file is read.
  """
  # Line breaks first, on the bytes as they are (the regex passes bytes that are not UTF-8 through), so that
  # the slow transcoding skips the lines dropped.
  lines = tf.strings.split(tf.strings.regex_replace(file_content, "\r\n?", "\n"), "\n")
  too_long = tf.strings.length(lines) > MAX_LINE_BYTES
  num_too_long = tf.reduce_sum(tf.cast(too_long, tf.int32))
  warned = tf.cond(num_too_long > 0, lambda: _warn_long_lines(num_too_long, file_name), lambda: tf.constant(True))
  with tf.control_dependencies([warned]):
    text = tf.strings.reduce_join(tf.boolean_mask(lines, ~too_long), separator="\n")
  text = tf.strings.unicode_transcode(text, "UTF-8", "UTF-8", errors="replace")
  text = tf.strings.regex_replace(text, _BLANK_LINES, _DOCUMENT_BREAK)
  documents = tf.strings.strip(tf.strings.split(text, _DOCUMENT_BREAK))
  documents = tf.boolean_mask(documents, tf.strings.length(documents) > 0)
  return tf.data.Dataset.from_tensor_slices({"text": documents})


def _warn_long_lines(count: tf.Tensor, file_name: tf.Tensor) -> tf.Tensor:
  with tf.control_dependencies([tf.print("warning: skipping", count, f"line(s) longer than {MAX_LINE_BYTES} bytes in",
                                         file_name, "(one sentence per line expected)")]):
    return tf.constant(True)


class TextDocumentSource(seqio.DataSource):
  """Plain-text files in the BERT reference format; shards by file when there are enough files."""

  def __init__(self, split_to_filepattern: Mapping[str, Union[str, Sequence[str]]], setting: str = "TRAIN_FILES"):
    super().__init__(splits=tuple(split_to_filepattern))
    self._patterns = dict(split_to_filepattern)
    self._setting = setting
    self._files = {}
    self._sizes = {}

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def list_shards(self, split: str) -> Sequence[str]:
    if split not in self._files:
      self._files[split] = self._resolve(split)
    return self._files[split]

  def _resolve(self, split: str) -> Sequence[str]:
    """Non-empty files matching the split's pattern; empty ones are skipped and counted."""
    if split not in self._patterns:
      raise ValueError(f"{self._setting}: no files configured for split {split!r} (have {sorted(self._patterns)})")
    pattern = self._patterns[split]
    files = storage.list_files(pattern)
    if not files:
      raise FileNotFoundError(f"{self._setting}={pattern!r} matches no files")
    stats = {f: storage.stat(f) for f in files}
    directories = [f for f in files if stats[f].is_directory]
    if directories:
      raise ValueError(f"{self._setting}={pattern!r} matches the directory {directories[0]}: expected text files, "
                       f"e.g. {self._setting}='{directories[0].rstrip('/')}/*.txt'")
    self._sizes[split] = {f: stats[f].length for f in files}
    empty = [f for f in files if self._sizes[split][f] == 0]
    if empty:
      logging.warning("skipping %d empty file(s) of %s, e.g. %s", len(empty), pattern, empty[0])
      print(f"warning: skipping {len(empty)} empty file(s) matching {pattern!r}, e.g. {empty[0]}")
    files = [f for f in files if f not in empty]
    if not files:
      raise ValueError(f"{self._setting}={pattern!r}: every matching file is empty")
    return files

  def describe(self, split: str) -> str:
    """The split's files, for messages: its pattern and how many non-empty files match it."""
    return f"{self._patterns[split]!r}, {len(self.list_shards(split))} file(s)"

  def total_bytes(self, split: str) -> int:
    return sum(self._sizes[split][f] for f in self.list_shards(split))  # sizes from the listing

  def get_dataset(self, split: str = "train", shuffle: bool = True, seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None, *, sequence_length=None, use_cached=False,
                  num_epochs=1) -> tf.data.Dataset:
    del sequence_length, use_cached, num_epochs
    files = list(self.list_shards(split))
    if shard_info:
      files = files[shard_info.index::shard_info.num_shards]
    files = [storage.tf_readable(f) for f in files]  # tf.data reads them
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shuffle:
      ds = ds.shuffle(len(files), seed=seed)
    return ds.flat_map(lambda file_name: split_documents(tf.io.read_file(file_name), file_name))


def tfds_to_documents(dataset: tf.data.Dataset, text_key: str = "text") -> tf.data.Dataset:
  """seqio preprocessor: TFDS records -> {'text': one sentence per line}.

  Wikipedia-style text has a paragraph per line; sentences are split after . ! ? followed by a
  capital letter (a heuristic: good enough for pretraining pairs, not for linguistics).
  """
  def to_document(example):
    text = tf.strings.regex_replace(example[text_key], r"([.!?]) +([A-Z])", "\\1\n\\2")
    text = tf.strings.regex_replace(text, r"\n\s*\n", "\n")
    return {"text": tf.strings.strip(text)}

  return dataset.map(to_document, num_parallel_calls=tf.data.AUTOTUNE).filter(
      lambda ex: tf.strings.length(ex["text"]) > 0)


def tfds_source(tfds_name: str, splits: Optional[Mapping[str, str]] = None,
                data_dir: Optional[str] = None) -> seqio.TfdsDataSource:
  """A TFDS dataset by name, e.g. 'wikipedia/20230601.en:1.0.0', read from data_dir (local or gs://)."""
  source = seqio.TfdsDataSource(tfds_name=tfds_name, splits=splits, tfds_data_dir=data_dir)
  if not source.splits:  # TFDS finds no prepared files, and nothing is downloaded at run time
    raise FileNotFoundError(f"TFDS dataset {tfds_name!r} is not prepared in TFDS_DATA_DIR={data_dir!r}: "
                            "build it there first (tfds build, or the builder's download_and_prepare)")
  return source
