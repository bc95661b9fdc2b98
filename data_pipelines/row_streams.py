"""XLNet's batch rows as streams over one token file, each step computed from the step number alone.

The reference cuts a host's token stream into [rows, steps], and each row reads its part window after
window. Here the corpus is one circular token file (`token_files.TokenFile`) that every row of the
global batch reads: stream s of S starts at s/S of the file and moves `step_len` tokens per step
(XLNet: reuse_len). Over
one pass its windows cover its own S-th of the text, and the reuse part of window t+1 is the text right
after window t's, so the model's memory carries over. With bi_data the rows pair up: row 2s reads
stream s forwards and row 2s+1 reads the same S-th right to left, from its end. The random B segment of
a window starts at a random position of the file; it, the A/B split, the masks and the permutation come
from a seed of (seed, row, step). A host thus makes its rows of any step from the step number alone:
the data position is the step, whatever the number of hosts, and a resume reads nothing twice.
"""
from typing import Callable, Dict, Sequence

import numpy as np
import tensorflow as tf

from data_pipelines.token_files import DamagedFile, TokenFile


class RowStreams:
  """Where each row of a global batch of `num_rows` reads, and its windows of `window_len` tokens."""

  def __init__(self, token_file: TokenFile, *, num_rows: int, bi_data: bool, step_len: int, window_len: int,
               seed: int):
    self.token_file, self.bi_data, self.step_len, self.window_len, self.seed = (
        token_file, bi_data, step_len, window_len, seed)
    self.num_streams = num_rows // 2 if bi_data else num_rows

  def _stream_start(self, stream: int) -> int:
    return stream * self.token_file.size // self.num_streams

  def position(self, row: int, step: int) -> tuple:
    """(first token of row's window at `step`, backward): a position in the text as the row reads it."""
    backward = self.bi_data and row % 2 == 1
    stream = row // 2 if self.bi_data else row
    start = self.token_file.size - self._stream_start(stream + 1) if backward else self._stream_start(stream)
    return start + step * self.step_len, backward

  def read(self, rows: Sequence[int], step: int) -> Dict[str, np.ndarray]:
    """The windows of `rows` at `step`: ids / sentence starts of the window and of a random other window,
    [len(rows), window_len] each, and each row's `backward` and seed."""
    out = {key: [] for key in ("ids", "sentence_start", "other_ids", "other_sentence_start", "backward", "seed")}
    for row in rows:
      start, backward = self.position(row, step)
      rng = np.random.default_rng([self.seed, row, step])
      other_start = int(rng.integers(self.token_file.size))
      for prefix, begin in (("", start), ("other_", other_start)):
        ids, starts = self.token_file.read_text(begin, self.window_len, backward)
        out[prefix + "ids"].append(ids)
        out[prefix + "sentence_start"].append(starts)
      out["backward"].append(backward)
      out["seed"].append(rng.integers(np.iinfo(np.int32).max, size=2))
    return {key: np.stack(values) for key, values in out.items()}

  def dataset(self, rows: Sequence[int], first_step: int, example: Callable) -> tf.data.Dataset:
    """Examples of `rows` at step first_step, first_step + 1, ... in row order: `example(window, other,
    backward, seed)` of each row, made in parallel."""
    dtypes = {"ids": tf.int32, "sentence_start": tf.bool, "other_ids": tf.int32, "other_sentence_start": tf.bool,
              "backward": tf.bool, "seed": tf.int64}
    keys = list(dtypes)

    shapes = {k: {"backward": [len(rows)], "seed": [len(rows), 2]}.get(k, [len(rows), self.window_len]) for k in keys}

    def read_or_say_why(step: int) -> list:
      """The step's values and '', or zeros and why the file cannot give them. A damaged file is told through
      the graph: an error raised in here would reach the log with its Python traceback, once per reader."""
      try:
        return [*self.read(rows, step).values(), ""]
      except DamagedFile as e:
        return [*(np.zeros(shapes[k], dtypes[k].as_numpy_dtype) for k in keys), str(e)]

    def read_step(step):
      # stateful: it reads files, so tf.data must not run it in parallel with itself
      *values, damage = tf.numpy_function(lambda s: read_or_say_why(int(s)), [step],
                                          [dtypes[k] for k in keys] + [tf.string], stateful=True)
      with tf.control_dependencies([tf.debugging.Assert(tf.equal(damage, ""), [damage])]):
        return {k: tf.ensure_shape(v, shapes[k]) for k, v in zip(keys, values)}

    @tf.autograph.experimental.do_not_convert
    def make_example(element):
      window = {"ids": element["ids"], "sentence_start": element["sentence_start"]}
      other = {"ids": element["other_ids"], "sentence_start": element["other_sentence_start"]}
      return example(window, other, element["backward"], element["seed"])

    steps = tf.data.Dataset.range(first_step, np.iinfo(np.int64).max)
    return steps.map(read_step).unbatch().map(make_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
