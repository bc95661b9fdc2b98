"""T5's span corruption (Raffel et al. 2019) as pure TensorFlow functions over token ids.

Graph-mode safe, stateless `seed` (int tensor of shape [2]) as in denoising.py. Span counts and
layout follow T5's `random_spans_noise_mask`: round(length * density) noise tokens in
round(noise / mean_span_length) spans, noise and non-noise tokens each cut at random into that many
spans, interleaved starting with non-noise. Sentinel ids count down from `first_sentinel_id`
(T5: vocab_size - 1); the vocabulary must reserve enough ids there for the spans of one example.
"""
import seqio
import tensorflow as tf

from data_pipelines.objectives import documents
from data_pipelines.objectives.denoising import encoder_decoder_features, random_subset_mask
from data_pipelines.objectives.random_ops import split_seed


def _check_rates(noise_density: float, mean_noise_span_length: float):
  if not 0.0 < noise_density < 1.0:
    raise ValueError(f"span corruption: noise_density must be in (0, 1), got {noise_density}")
  if mean_noise_span_length < 1.0:
    raise ValueError(f"span corruption: mean_noise_span_length must be >= 1, got {mean_noise_span_length}")


def noise_span_counts(length, noise_density: float, mean_noise_span_length: float):
  """(num_noise_tokens, num_noise_spans) for `length` tokens (length >= 2), as T5 counts them."""
  num_noise = tf.cast(tf.round(tf.cast(length, tf.float32) * noise_density), tf.int32)
  num_noise = tf.clip_by_value(num_noise, 1, length - 1)
  num_spans = tf.cast(tf.round(tf.cast(num_noise, tf.float32) / mean_noise_span_length), tf.int32)
  # The upper clip only binds at densities where T5 itself would fail (too few non-noise tokens).
  return num_noise, tf.clip_by_value(num_spans, 1, length - num_noise)


def _random_segmentation(num_items, num_segments, seed):
  """Lengths (all >= 1) of a uniformly random cut of num_items items into num_segments runs."""
  cuts = random_subset_mask(num_items - 1, num_segments - 1, seed)
  segment_of_item = tf.cumsum(tf.concat([[0], tf.cast(cuts, tf.int32)], 0))
  return tf.math.unsorted_segment_sum(tf.ones_like(segment_of_item), segment_of_item, num_segments)


def random_spans_noise_mask(length, seed, noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
  """bool[length], True on noise tokens; the first token is never noise."""
  _check_rates(noise_density, mean_noise_span_length)
  padded_length = tf.maximum(length, 2)  # as T5: avoids degenerate counts; cut back below
  num_noise, num_spans = noise_span_counts(padded_length, noise_density, mean_noise_span_length)
  noise_seed, nonnoise_seed = split_seed(seed, 2)
  noise_lengths = _random_segmentation(num_noise, num_spans, noise_seed)
  nonnoise_lengths = _random_segmentation(padded_length - num_noise, num_spans, nonnoise_seed)
  run_lengths = tf.reshape(tf.stack([nonnoise_lengths, noise_lengths], axis=1), [-1])
  run_index = tf.repeat(tf.range(2 * num_spans), run_lengths)
  return tf.equal(run_index % 2, 1)[:length]


def _replace_runs_with_sentinels(tokens, in_run, first_sentinel_id: int):
  """Each run of True positions becomes one sentinel, numbered down from first_sentinel_id."""
  run_start = in_run & ~tf.concat([[False], in_run], 0)[:-1]
  sentinels = first_sentinel_id + 1 - tf.cumsum(tf.cast(run_start, tokens.dtype))
  return tf.boolean_mask(tf.where(run_start, sentinels, tokens), ~in_run | run_start)


def span_corruption(tokens, seed, first_sentinel_id: int, noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0):
  """(inputs, targets) without eos: inputs keep the non-noise tokens with one sentinel per noise span;
  targets are each span's sentinel followed by the span's tokens."""
  noise = random_spans_noise_mask(tf.size(tokens), seed, noise_density, mean_noise_span_length)
  return (_replace_runs_with_sentinels(tokens, noise, first_sentinel_id),
          _replace_runs_with_sentinels(tokens, ~noise, first_sentinel_id))


def max_tokens_for_lengths(encoder_length: int, decoder_length: int, noise_density: float = 0.15,
                           mean_noise_span_length: float = 3.0):
  """Longest token count whose corrupted inputs and targets (each + eos) fit the lengths (T5's
  `random_spans_helper`): an int32 scalar tensor, usable eagerly to size upstream chunks."""
  _check_rates(noise_density, mean_noise_span_length)
  if encoder_length < 2 or decoder_length < 1:
    raise ValueError(f"span corruption: encoder_length={encoder_length} (>= 2) / decoder_length="
                     f"{decoder_length} (>= 1) leave no room for tokens and eos")
  # Past this bound the inputs (about n * (1 - density)) or targets (about n * density) overflow.
  bound = int(min((encoder_length + 2) / (1 - noise_density), (decoder_length + 2) / noise_density)) + 2
  lengths = tf.range(2, bound)
  num_noise, num_spans = noise_span_counts(lengths, noise_density, mean_noise_span_length)
  fits = ((lengths - num_noise + num_spans + 1 <= encoder_length)
          & (num_noise + num_spans + 1 <= decoder_length))
  leading_fits = tf.math.cumprod(tf.cast(fits, tf.int32))
  return tf.reduce_sum(leading_fits) + 1  # lengths 1..n all fit


DOCUMENTS_PER_STREAM = 128  # T5's span_corruption joins 128 documents (reduce_concat_tokens' batch_size)


def span_corruption_blocks(dataset: tf.data.Dataset, sequence_length, *, noise_density: float = 0.15,
                           mean_noise_span_length: float = 3.0) -> tf.data.Dataset:
  """seqio preprocessor: the ids of DOCUMENTS_PER_STREAM consecutive documents joined, then cut into
  consecutive blocks that each fit one example (T5's split_tokens): short documents fill whole examples,
  and no text of a long one is left out."""
  length = max_tokens_for_lengths(sequence_length["encoder_input_ids"], sequence_length["decoder_input_ids"],
                                  noise_density, mean_noise_span_length)
  return documents.split_into_blocks(documents.concatenate(dataset, DOCUMENTS_PER_STREAM), length,
                                     whole_sentences=False)


def span_corruption_features(tokens, seed, *, encoder_length: int, decoder_length: int, eos_id: int,
                             first_sentinel_id: int, noise_density: float = 0.15,
                             mean_noise_span_length: float = 3.0, decoder_start_id: int = 0):
  """One T5 example from a 1-D token tensor: its leading chunk that fits both lengths, corrupted,
  each side followed by eos; the decoder starts from `decoder_start_id` (T5: pad, 0)."""
  chunk_length = max_tokens_for_lengths(encoder_length, decoder_length, noise_density, mean_noise_span_length)
  inputs, targets = span_corruption(tf.cast(tokens, tf.int32)[:chunk_length], seed, first_sentinel_id,
                                    noise_density, mean_noise_span_length)
  return encoder_decoder_features(tf.concat([inputs, [eos_id]], 0), tf.concat([targets, [eos_id]], 0),
                                  encoder_length, decoder_length, decoder_start_id)


@seqio.map_over_dataset(num_seeds=1)
@tf.autograph.experimental.do_not_convert  # plain TF ops: autograph's conversion took seconds of each start
def span_corruption_preprocessor(features, seed, sequence_length, *, tokens_key: str = "targets", **kwargs):
  """seqio preprocessor: features[tokens_key] -> the four encoder-decoder features, with lengths
  sequence_length['encoder_input_ids'] and ['decoder_input_ids']; kwargs are span_corruption_features'
  other keyword arguments (eos and sentinel ids, rates)."""
  return span_corruption_features(features[tokens_key], seed, encoder_length=sequence_length["encoder_input_ids"],
                                  decoder_length=sequence_length["decoder_input_ids"], **kwargs)
