"""BART's denoising objective (Lewis et al. 2019) as pure TensorFlow functions over token ids.

Every function is graph-mode safe (usable inside tf.data / seqio map functions) and takes an explicit
stateless `seed` (int32/int64 tensor of shape [2]): the same seed gives the same output.

Semantics follow fairseq's `denoising` task: documents are cut into blocks of whole sentences
that fit one example (its 'complete_doc' blocks), and infilling spans cover whole words when the
task gives word starts (its mask_whole_words). Two deliberate differences:
- text-infilling spans never overlap or touch (fairseq lets random spans merge), so each mask token
  stands for exactly one span and exactly round(ratio * n) tokens (or words) are masked;
- counts are round(n * ratio) rather than ceil.
The encoder input is [bos] + noised block + [eos]; the decoder target is [bos] + original + [eos]
(bos only when given, as in fairseq/HF BART, whose decoder starts from eos).
"""
import dataclasses
from typing import Optional

import seqio
import tensorflow as tf

from data_pipelines.objectives import documents
from data_pipelines.objectives.random_ops import split_seed


def rounded_count(n, rate: float):
  """round(n * rate) as int32: how many of n items a rate selects."""
  return tf.cast(tf.round(tf.cast(n, tf.float32) * rate), tf.int32)


def random_subset_mask(n, k, seed):
  """bool[n] with exactly k (<= n) True entries at uniformly random positions."""
  return tf.random.experimental.stateless_shuffle(tf.range(n) < k, seed)


def encoder_decoder_features(inputs, targets, encoder_length: int, decoder_length: int,
                             decoder_start_id: int):
  """Fixed-length encoder-decoder features: ids padded with 0 (or trimmed), decoder inputs shifted right."""
  def fit(ids, length):
    ids = ids[:length]
    return tf.reshape(tf.pad(ids, [[0, length - tf.size(ids)]]), [length])

  padded_targets = fit(targets, decoder_length)
  return {
      "encoder_input_ids": fit(inputs, encoder_length),
      "decoder_input_ids": tf.concat([[decoder_start_id], padded_targets[:-1]], 0),
      "decoder_target_ids": padded_targets,
      "decoder_weights": tf.cast(tf.range(decoder_length) < tf.size(targets), tf.float32),
  }


@dataclasses.dataclass(frozen=True)
class DenoisingConfig:
  """Which noise functions to apply; defaults are the paper's final setting."""
  permute_sentence_ratio: float = 1.0  # fraction of sentences shuffled among themselves
  infilling_ratio: float = 0.3         # fraction of tokens replaced by text-infilling spans
  poisson_lambda: float = 3.0          # mean infilling span length
  mask_random_ratio: float = 0.0       # fraction of infilling spans replaced by a random token instead of mask
  token_masking_ratio: float = 0.0     # fraction of tokens replaced by mask, one each
  token_deletion_ratio: float = 0.0    # fraction of tokens deleted
  rotate_ratio: float = 0.0            # probability of rotating a document

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name != "poisson_lambda" and not 0.0 <= value <= 1.0:
        raise ValueError(f"DenoisingConfig.{field.name} must be in [0, 1], got {value}")
    if self.poisson_lambda <= 0:
      raise ValueError(f"DenoisingConfig.poisson_lambda must be > 0, got {self.poisson_lambda}")


def permute_sentences(sentences: tf.RaggedTensor, seed, ratio: float = 1.0) -> tf.RaggedTensor:
  """Shuffles a random round(ratio * n) of the n sentences among their own positions."""
  choice_seed, order_seed = split_seed(seed, 2)
  n = tf.cast(sentences.nrows(), tf.int32)
  chosen = tf.cast(tf.where(random_subset_mask(n, rounded_count(n, ratio), choice_seed)), tf.int32)
  shuffled = tf.random.experimental.stateless_shuffle(chosen[:, 0], order_seed)
  return tf.gather(sentences, tf.tensor_scatter_nd_update(tf.range(n), chosen, shuffled))


def rotate_document(tokens, seed):
  """Rotates the tokens to start at a uniformly random token."""
  n = tf.size(tokens)
  start = tf.random.stateless_uniform([], seed, minval=0, maxval=tf.maximum(n, 1), dtype=tf.int32)
  return tf.roll(tokens, -start, axis=0)


def token_deletion(tokens, seed, ratio: float):
  """Deletes round(ratio * n) random tokens."""
  n = tf.size(tokens)
  return tf.boolean_mask(tokens, ~random_subset_mask(n, rounded_count(n, ratio), seed))


def token_masking(tokens, seed, mask_id: int, ratio: float):
  """Replaces round(ratio * n) random tokens by mask_id, one mask per token."""
  n = tf.size(tokens)
  masked = random_subset_mask(n, rounded_count(n, ratio), seed)
  return tf.where(masked, tf.constant(mask_id, tokens.dtype), tokens)


def sample_span_lengths(budget, seed, poisson_lambda: float):
  """Poisson span lengths summing to exactly `budget`.

  As fairseq: draw lengths until their sum reaches the budget and trim the last one; zero-length
  draws stay (they become pure insertions of a mask).
  """
  # Enough draws that their sum falls short of the budget only with negligible probability;
  # if it still does, the last draw takes the remainder so the budget is always met.
  max_spans = tf.cast(tf.math.ceil(2.0 * tf.cast(budget, tf.float32) / poisson_lambda), tf.int32) + 16
  draws = tf.random.stateless_poisson([max_spans], seed, lam=poisson_lambda, dtype=tf.int32)
  ends = tf.minimum(tf.cumsum(draws), budget)
  num_spans = tf.minimum(tf.reduce_sum(tf.cast(ends < budget, tf.int32)) + 1, max_spans)
  num_spans = tf.where(budget > 0, num_spans, 0)
  ends = tf.concat([ends[:num_spans - 1], [budget]], 0)[:num_spans]
  return ends - tf.concat([[0], ends], 0)[:-1]


def text_infilling(tokens, seed, mask_id: int, ratio: float = 0.3, poisson_lambda: float = 3.0,
                   mask_random_ratio: float = 0.0, vocab_size: Optional[int] = None):
  """Replaces spans covering round(ratio * n) tokens, lengths ~ Poisson(lambda), by one mask token each.

  Spans sit in distinct gaps between kept tokens, so any two masks are separated by a kept token and
  each mask stands for exactly one span (zero-length spans insert a mask). A `mask_random_ratio`
  fraction of spans gets a random id from [1, vocab_size) instead of mask_id.
  """
  lengths_seed, order_seed, gap_seed, random_seed, random_id_seed = split_seed(seed, 5)
  n = tf.size(tokens)
  budget = rounded_count(n, ratio)
  lengths = sample_span_lengths(budget, lengths_seed, poisson_lambda)
  num_kept = n - budget
  # More spans than the num_kept + 1 gaps happens only at very high ratios or tiny documents:
  # the surplus spans join the last one, which keeps the masked count exact.
  num_spans = tf.minimum(tf.size(lengths), num_kept + 1)
  lengths = tf.math.unsorted_segment_sum(
      lengths, tf.minimum(tf.range(tf.size(lengths)), num_spans - 1), num_spans)
  lengths = tf.random.experimental.stateless_shuffle(lengths, order_seed)  # the trimmed span lands anywhere

  has_span = random_subset_mask(num_kept + 1, num_spans, gap_seed)
  gap_length = tf.scatter_nd(tf.cast(tf.where(has_span), tf.int32), lengths, [num_kept + 1])
  # Gap g (before kept token g) holds gap_length[g] original tokens and has_span[g] output masks.
  kept_index = tf.range(num_kept)
  source_position = kept_index + tf.cumsum(gap_length)[:num_kept]
  output_position = kept_index + tf.cumsum(tf.cast(has_span, tf.int32))[:num_kept]

  filler = span_fillers(num_kept + num_spans, (random_seed, random_id_seed), tokens.dtype, mask_id,
                        mask_random_ratio, vocab_size)
  return tf.tensor_scatter_nd_update(filler, output_position[:, None], tf.gather(tokens, source_position))


def span_fillers(count, seeds, dtype, mask_id: int, mask_random_ratio: float, vocab_size: Optional[int]):
  """`count` ids that stand for removed spans: mask_id, or a random id from [1, vocab_size) with
  probability mask_random_ratio."""
  if mask_random_ratio > 0 and vocab_size is None:
    raise ValueError("text infilling: mask_random_ratio > 0 needs vocab_size")
  filler = tf.fill([count], tf.constant(mask_id, dtype))
  if mask_random_ratio == 0:
    return filler
  choice_seed, id_seed = seeds
  random_ids = tf.random.stateless_uniform([count], id_seed, minval=1, maxval=vocab_size, dtype=dtype)
  return tf.where(tf.random.stateless_uniform([count], choice_seed) < mask_random_ratio, random_ids, filler)


def whole_word_infilling(tokens, word_start, seed, mask_id: int, ratio: float = 0.3, poisson_lambda: float = 3.0,
                         mask_random_ratio: float = 0.0, vocab_size: Optional[int] = None):
  """`text_infilling` in units of whole words, as fairseq's BART (mask_whole_words): a span covers
  whole words, its Poisson length counts words, and round(ratio * words) words are masked.

  word_start: bool per token, True where a word begins (the first token always begins one).
  """
  spans_seed, *fill_seeds = split_seed(seed, 3)
  starts = tf.logical_or(tf.cast(word_start, tf.bool), tf.range(tf.size(tokens)) == 0)
  num_words = tf.reduce_sum(tf.cast(starts, tf.int32))
  word_of_token = tf.cumsum(tf.cast(starts, tf.int64)) - 1
  words = tf.RaggedTensor.from_value_rowids(tokens, word_of_token, nrows=tf.cast(num_words, tf.int64))
  # Infill the sequence of word indices; -1 marks a span. Row num_words of the table is the span's id.
  units = text_infilling(tf.range(num_words), spans_seed, -1, ratio, poisson_lambda)
  table = tf.concat([words, tf.RaggedTensor.from_row_lengths(tf.constant([mask_id], tokens.dtype), [1])], 0)
  output = tf.gather(table, tf.where(units < 0, num_words, units))
  is_span = tf.repeat(units < 0, output.row_lengths())
  fillers = span_fillers(tf.size(is_span), fill_seeds, tokens.dtype, mask_id, mask_random_ratio, vocab_size)
  return tf.where(is_span, fillers, output.flat_values)


def noise_document(sentences: tf.RaggedTensor, seed, config: DenoisingConfig, mask_id: int,
                   vocab_size: Optional[int] = None, word_start=None):
  """Applies the configured noise in fairseq's order: permutation, masking, infilling, deletion, rotation.

  With `word_start` (bool per vocabulary id) infilling spans cover whole words, else single tokens.
  """
  permute_seed, masking_seed, infilling_seed, deletion_seed, rotate_seed, rotate_choice_seed = (
      split_seed(seed, 6))  # a fixed split: enabling one noise never changes another's draws
  if config.permute_sentence_ratio > 0:
    sentences = permute_sentences(sentences, permute_seed, config.permute_sentence_ratio)
  tokens = sentences.flat_values
  if config.token_masking_ratio > 0:
    tokens = token_masking(tokens, masking_seed, mask_id, config.token_masking_ratio)
  if config.infilling_ratio > 0 and word_start is not None:
    tokens = whole_word_infilling(tokens, tf.gather(word_start, tokens), infilling_seed, mask_id,
                                  config.infilling_ratio, config.poisson_lambda, config.mask_random_ratio, vocab_size)
  elif config.infilling_ratio > 0:
    tokens = text_infilling(tokens, infilling_seed, mask_id, config.infilling_ratio,
                            config.poisson_lambda, config.mask_random_ratio, vocab_size)
  if config.token_deletion_ratio > 0:
    tokens = token_deletion(tokens, deletion_seed, config.token_deletion_ratio)
  if config.rotate_ratio > 0:
    rotate = tf.random.stateless_uniform([], rotate_choice_seed) < config.rotate_ratio
    tokens = tf.where(rotate, rotate_document(tokens, rotate_seed), tokens)
  return tokens


def truncate_sentences(sentences: tf.RaggedTensor, max_tokens) -> tf.RaggedTensor:
  """The document's first max_tokens tokens, still split into sentences (the last may be cut short);
  empty sentences are dropped."""
  lengths = sentences.row_lengths()
  starts = tf.cumsum(lengths, exclusive=True)
  kept = tf.clip_by_value(tf.cast(max_tokens, lengths.dtype) - starts, 0, lengths)
  truncated = tf.RaggedTensor.from_row_lengths(sentences.flat_values[:tf.reduce_sum(kept)], kept)
  return tf.ragged.boolean_mask(truncated, kept > 0)


# fairseq's 'complete_doc' blocks keep only blocks of more than one token (token_block_utils_fast.pyx).
MIN_BLOCK_TOKENS = 2


def chunk_length(encoder_length: int, decoder_length: int, bos_id: Optional[int]) -> int:
  """Most document tokens an example holds: both sides add eos, and bos when given."""
  length = min(encoder_length, decoder_length) - (bos_id is not None) - 1
  if length < MIN_BLOCK_TOKENS:
    raise ValueError(f"denoising: encoder_length={encoder_length} / decoder_length={decoder_length} "
                     f"leave no room for {MIN_BLOCK_TOKENS} tokens besides bos/eos")
  return length


def denoising_blocks(dataset: tf.data.Dataset, sequence_length, *, bos_id: Optional[int] = None) -> tf.data.Dataset:
  """seqio preprocessor: each document -> its blocks of whole sentences that fit one example; blocks of
  fewer than MIN_BLOCK_TOKENS tokens are dropped, as fairseq drops them."""
  length = chunk_length(sequence_length["encoder_input_ids"], sequence_length["decoder_input_ids"], bos_id)
  return documents.split_into_blocks(dataset, length).filter(
      lambda block: tf.size(block["sentences"].flat_values) >= MIN_BLOCK_TOKENS)


def denoising_features(sentences, seed, *, encoder_length: int, decoder_length: int, eos_id: int,
                       mask_id: int, bos_id: Optional[int] = None, decoder_start_id: Optional[int] = None,
                       vocab_size: Optional[int] = None, word_start=None,
                       config: DenoisingConfig = DenoisingConfig()):
  """One BART example from a document: a RaggedTensor [num_sentences, None] of ids (or a 1-D tensor,
  one sentence). Noise is applied to the leading chunk that fits both lengths (the task's
  `denoising_blocks` makes every block fit); the decoder starts from `decoder_start_id` (default
  eos_id, as BART). `word_start` (bool per vocabulary id) makes infilling spans whole words."""
  prefix = tf.constant([] if bos_id is None else [bos_id], tf.int32)
  if not isinstance(sentences, tf.RaggedTensor):
    sentences = tf.RaggedTensor.from_tensor(tf.reshape(sentences, [1, -1]))
  sentences = truncate_sentences(tf.cast(sentences, tf.int32),
                                 chunk_length(encoder_length, decoder_length, bos_id))
  noised = noise_document(sentences, seed, config, mask_id, vocab_size, word_start)
  # Zero-length spans can make the noised chunk longer than the original: trim it, keep eos.
  inputs = tf.concat([prefix, noised[:encoder_length - prefix.shape[0] - 1], [eos_id]], 0)
  targets = tf.concat([prefix, sentences.flat_values, [eos_id]], 0)
  start = eos_id if decoder_start_id is None else decoder_start_id
  return encoder_decoder_features(inputs, targets, encoder_length, decoder_length, start)


@seqio.map_over_dataset(num_seeds=1)
@tf.autograph.experimental.do_not_convert  # plain TF ops: autograph's conversion took seconds of each start
def denoising_preprocessor(features, seed, sequence_length, *, sentences_key: str = "sentences", **kwargs):
  """seqio preprocessor: features[sentences_key] -> the four encoder-decoder features, with lengths
  sequence_length['encoder_input_ids'] and ['decoder_input_ids']; kwargs are denoising_features'
  other keyword arguments (special ids, config)."""
  return denoising_features(features[sentences_key], seed, encoder_length=sequence_length["encoder_input_ids"],
                            decoder_length=sequence_length["decoder_input_ids"], **kwargs)
