"""Sentence-pair objectives: next-sentence prediction (BERT) and sentence-order prediction (ALBERT).

Follows the BERT reference's `create_instances_from_document`: sentences are gathered into a chunk
until it reaches the target length (the maximum, or with probability short_seq_prob a random
shorter one), the chunk is split at a random sentence boundary into A and B, and

- NSP: with probability 0.5 (always for a one-sentence chunk, such as a one-sentence document) B
  is replaced by sentences from a random other document (label 1) and the unused sentences are put
  back; else label 0.
- SOP: A and B are swapped with probability 0.5 (label 1). A one-sentence chunk has no order to
  swap: as in ALBERT's reference, its B comes from another document (here the one before it in
  the stream), label 1.

Two deliberate differences from the references: B never comes from the document itself or a copy
of it (the reference falls back to the document itself after 10 draws, which labels a true
continuation random), so a one-sentence chunk with no other document to draw from is skipped and a
corpus of one one-sentence document makes no pair; and a lone sentence left over at the end of a
longer document is skipped rather than made a forced random pair, so labels stay balanced (the
reference gives ~70% random pairs on documents of two sentences).
Then the pair is truncated to the length budget, removing tokens from the front or the back of
the longer segment at random.
"""
import seqio
import tensorflow as tf

from data_pipelines.objectives import graphs
from data_pipelines.objectives.random_ops import randint, split_seed

NSP, SOP = "nsp", "sop"


def _random_continuation(lengths, target_tokens, seed):
  """Sentence range [start, end) of a document starting at a random sentence, with >= target_tokens."""
  count = tf.size(lengths)
  start = randint(seed, 0, count - 1)
  cumulative = tf.cumsum(lengths)
  wanted = cumulative[start] - lengths[start] + target_tokens
  end = tf.cast(tf.searchsorted(cumulative, [wanted], side="left")[0], tf.int32) + 1
  return start, tf.clip_by_value(end, start + 1, count)


def plan_pairs(lengths, other_lengths, seed, *, max_num_tokens: int, short_seq_prob: float, mode: str,
               other_is_distinct=True):
  """Sentence ranges of every pair one document yields.

  lengths: int32 [num_sentences] of this document; other_lengths: of another document, where a
  random-next B comes from (NSP's random pairs, and both objectives' one-sentence chunks).
  other_is_distinct: False when that document is this very one (or a copy): then no random-next
  pair is made, since its B would be a true continuation labelled random.
  Returns int32 [num_pairs, 7]: a_start, a_end, b_from_other, b_start, b_end, label, and a
  per-pair seed component.
  """
  num_sentences = tf.size(lengths)
  short_seed, target_seed = split_seed(seed, 2)
  short = tf.random.stateless_uniform([], short_seed) < short_seq_prob
  target = tf.where(short, randint(target_seed, 2, max_num_tokens), max_num_tokens)

  def body(step, i, chunk_start, chunk_tokens, pairs):
    chunk_tokens += lengths[i]
    closes = (i == num_sentences - 1) | (chunk_tokens >= target)
    # Seeded by the loop step, not by i: NSP revisits sentences it put back, and a revisit must
    # draw afresh (reusing i's coin made every later pair of a random-next chunk random-next too).
    cut_seed, coin_seed, other_seed, _ = split_seed(tf.random.experimental.stateless_fold_in(seed, step), 4)
    n = i - chunk_start + 1
    a_end = chunk_start + tf.where(n >= 2, randint(cut_seed, 1, tf.maximum(n - 1, 1)), 1)
    coin = tf.random.stateless_uniform([], coin_seed) < 0.5
    a_tokens = tf.reduce_sum(lengths[chunk_start:a_end])
    other_start, other_end = _random_continuation(other_lengths, target - a_tokens, other_seed)
    random_pair = [chunk_start, a_end, 1, other_start, other_end, 1, step]
    in_order = [chunk_start, a_end, 0, a_end, i + 1, 0, step]
    # A lone sentence can only pair with another document's text: skipped when there is none, and when it
    # is left over at the end of a longer document, which keeps labels balanced on short documents.
    emit = closes & ((n >= 2) | (other_is_distinct & ((i < num_sentences - 1) | (num_sentences == 1))))
    if mode == NSP:
      random_next = (n == 1) | (coin & other_is_distinct)
      pair = tf.where(random_next, random_pair, in_order)
      next_i = tf.where(random_next, a_end, i + 1)  # unused sentences go back to the pool
    else:
      swapped = [a_end, i + 1, 0, chunk_start, a_end, 1, step]
      pair = tf.where(n == 1, random_pair, tf.where(coin, swapped, in_order))
      next_i = i + 1
    pairs = tf.cond(emit, lambda: tf.concat([pairs, pair[None]], 0), lambda: pairs)
    return (step + 1, tf.where(closes, next_i, i + 1), tf.where(closes, next_i, chunk_start),
            tf.where(closes, 0, chunk_tokens), pairs)

  *_, pairs = tf.while_loop(
      lambda step, i, *_: i < num_sentences, body,
      (tf.constant(0), tf.constant(0), tf.constant(0), tf.constant(0), tf.zeros([0, 7], tf.int32)),
      shape_invariants=(tf.TensorShape([]),) * 4 + (tf.TensorShape([None, 7]),))
  return pairs


def pair_cuts(len_a, len_b, total):
  """(cut_a, cut_b): how many tokens the loop `while len_a + len_b > total: trim the longer (b on
  ties)` removes from each segment, in closed form. Shared by BERT's and XLNet's pair truncation."""
  excess = tf.maximum(len_a + len_b - total, 0)
  # Trimming the longer first equalises the lengths, then trimming alternates (b first on ties).
  longer_first = tf.minimum(excess, tf.abs(len_a - len_b))
  rest = excess - longer_first
  a_longer = len_a > len_b
  return (tf.where(a_longer, longer_first, 0) + rest // 2,
          tf.where(a_longer, 0, longer_first) + rest - rest // 2)


def truncate_pair(a, b, max_num_tokens: int, seed):
  """The reference's truncate_seq_pair in closed form: trim the longer segment one token at a time
  (from the front or back at random) until the pair fits."""
  len_a, len_b = tf.size(a), tf.size(b)
  cut_a, cut_b = pair_cuts(len_a, len_b, max_num_tokens)
  seed_a, seed_b = split_seed(seed, 2)
  front_a = tf.cast(tf.random.stateless_binomial([], seed_a, tf.cast(cut_a, tf.float32), 0.5), tf.int32)
  front_b = tf.cast(tf.random.stateless_binomial([], seed_b, tf.cast(cut_b, tf.float32), 0.5), tf.int32)
  return a[front_a:len_a - (cut_a - front_a)], b[front_b:len_b - (cut_b - front_b)]


def _same_document(a: tf.RaggedTensor, b: tf.RaggedTensor) -> tf.Tensor:
  """Equal content: a shuffled stream sometimes hands a document itself (or a duplicate) back."""
  same_shape = (tf.size(a.values) == tf.size(b.values)) & (tf.size(a.row_splits) == tf.size(b.row_splits))
  return tf.cond(same_shape, lambda: tf.reduce_all(a.values == b.values) & tf.reduce_all(a.row_splits == b.row_splits),
                 lambda: tf.constant(False))


@seqio.map_over_dataset(num_seeds=1)
@graphs.traced_once
def _attach_plan(example, seed, **plan_kwargs):
  sentences, other = example["sentences"], example["other"]
  plan = plan_pairs(tf.cast(sentences.row_lengths(), tf.int32), tf.cast(other.row_lengths(), tf.int32), seed,
                    other_is_distinct=tf.logical_not(_same_document(sentences, other)), **plan_kwargs)
  return {**example, "plan": plan, "seed": seed}


def _with_previous_document(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """{'sentences'} -> {'sentences', 'other'}: other is the document before it (the first: itself)."""
  def step(previous, example):
    sentences = example["sentences"]
    values, row_splits = previous  # tf.data's scan keeps no RaggedTensor state
    other = tf.cond(tf.size(row_splits) > 1, lambda: tf.RaggedTensor.from_row_splits(values, row_splits),
                    lambda: sentences)
    return (sentences.values, sentences.row_splits), {"sentences": sentences, "other": other}

  row_splits_dtype = dataset.element_spec["sentences"].row_splits_dtype
  return dataset.scan((tf.zeros([0], tf.int32), tf.zeros([1], row_splits_dtype)), step)


def pair_budget(input_length: int) -> int:
  """Tokens of A + B in `[CLS] A [SEP] B [SEP]` of input_length tokens; at least one each."""
  if input_length < 5:
    raise ValueError(f"input_ids={input_length} is less than 5, the shortest [CLS] A [SEP] B [SEP]")
  return input_length - 3


def sentence_pairs(dataset: tf.data.Dataset, sequence_length, *, mode: str, short_seq_prob: float = 0.1,
                   random_document_buffer: int = 1000) -> tf.data.Dataset:
  """{'sentences': ragged [s, None]} documents -> {'tokens_a', 'tokens_b', 'label'} pairs whose
  tokens fit sequence_length['input_ids'] with [CLS], [SEP], [SEP] added.

  For NSP each document is zipped with a random document from a shuffled copy of the stream; for
  SOP with the document before it.
  """
  max_num_tokens = pair_budget(sequence_length["input_ids"])
  if mode not in (NSP, SOP):
    raise ValueError(f"sentence pair mode={mode!r}: expected {NSP!r} or {SOP!r}")
  if mode == NSP:
    # A fixed shuffle seed keeps the pipeline deterministic; per-example randomness comes from seqio seeds.
    others = dataset.shuffle(random_document_buffer, seed=17).map(lambda ex: ex["sentences"])
    documents = tf.data.Dataset.zip(dataset,
                                    others).map(lambda ex, other: {"sentences": ex["sentences"], "other": other})
  else:  # SOP needs another document only for one-sentence chunks: don't read and tokenize the stream twice
    documents = _with_previous_document(dataset)
  documents = _attach_plan(documents, max_num_tokens=max_num_tokens, short_seq_prob=short_seq_prob, mode=mode)

  @tf.autograph.experimental.do_not_convert
  def pairs_of(example):
    sentences, other = example["sentences"], example["other"]

    def tokens(doc, start, end):
      return doc.values[doc.row_splits[start]:doc.row_splits[end]]

    def build(row):
      a = tokens(sentences, row[0], row[1])
      b = tf.cond(row[2] > 0, lambda: tokens(other, row[3], row[4]), lambda: tokens(sentences, row[3], row[4]))
      a, b = truncate_pair(a, b, max_num_tokens, tf.random.experimental.stateless_fold_in(example["seed"], row[6]))
      return {"tokens_a": a, "tokens_b": b, "label": row[5]}

    return tf.data.Dataset.from_tensor_slices(example["plan"]).map(build)

  return documents.flat_map(pairs_of)
