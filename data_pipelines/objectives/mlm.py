"""Masked language modelling (BERT, ALBERT): choose positions, replace 80/10/10, gather targets.

Pure TensorFlow over one example's token ids; randomness comes from an explicit stateless seed.

Choosing positions: maskable tokens are grouped into units (whole words, or single pieces), the
unit sequence is cut into consecutive n-grams with n ~ p(n) ∝ 1/n (n = 1 for BERT, up to 3 for
ALBERT), and n-grams are taken in random order while they fit into the prediction budget
(round(length × rate), capped at max_predictions); then units in random order top the budget up,
skipping any that no longer fit (as the reference skips whole words that overflow).
"""
import numpy as np
import seqio
import tensorflow as tf

from data_pipelines.objectives import graphs
from data_pipelines.objectives.random_ops import split_seed


def ngram_length_probs(max_ngram: int) -> tf.Tensor:
  weights = 1.0 / tf.range(1, max_ngram + 1, dtype=tf.float32)
  return weights / tf.reduce_sum(weights)


def _unit_ids(maskable: tf.Tensor, word_start: tf.Tensor, whole_word: bool):
  """Unit index of each maskable token (-1 elsewhere) and the number of units."""
  previous_maskable = tf.concat([[False], maskable[:-1]], axis=0)
  starts = maskable & (word_start | tf.logical_not(previous_maskable)) if whole_word else maskable
  unit = tf.cumsum(tf.cast(starts, tf.int32)) - 1
  return tf.where(maskable, unit, -1), tf.reduce_sum(tf.cast(starts, tf.int32))


def _take_while_fits(order: tf.Tensor, sizes: tf.Tensor, budget: tf.Tensor) -> tf.Tensor:
  """bool over items: walking `order`, take items while their running size stays within budget."""
  taken_in_order = tf.cumsum(tf.gather(sizes, order)) <= budget
  return tf.scatter_nd(order[:, None], taken_in_order, tf.shape(sizes))


def _take_each_that_fits(order: tf.Tensor, sizes: tf.Tensor, eligible: tf.Tensor, budget: tf.Tensor) -> tf.Tensor:
  """bool over items: walking `order`, take each eligible item that still fits, skipping the rest.

  Unlike a prefix, one long word early in the order cannot starve the budget. Sequential, but it
  stops as soon as the budget is full, which with one-piece units comes after `budget` steps.
  """
  def take_next(k, remaining, taken):
    item = order[k]
    take = eligible[item] & (sizes[item] <= remaining)
    return k + 1, remaining - tf.where(take, sizes[item], 0), tf.tensor_scatter_nd_update(taken, [[item]], [take])

  _, _, taken = tf.while_loop(lambda k, remaining, _: (k < tf.size(order)) & (remaining > 0), take_next,
                              (tf.constant(0), budget, tf.zeros_like(eligible)))
  return taken


def choose_masked_positions(maskable, word_start, num_to_predict, seed, *, max_ngram: int = 1,
                            whole_word: bool = False) -> tf.Tensor:
  """bool [length]: which positions become prediction targets.

  maskable, word_start: bool [length]. num_to_predict: int32 scalar budget in tokens.
  """
  length_seed, ngram_order_seed, unit_order_seed, _ = split_seed(seed, 4)
  unit, num_units = _unit_ids(maskable, word_start, whole_word)
  unit_sizes = tf.math.unsorted_segment_sum(tf.ones_like(unit), tf.where(unit >= 0, unit, num_units),
                                            num_units + 1)[:-1]

  # Cut the unit sequence into consecutive n-grams.
  ngram_lengths = 1 + tf.random.stateless_categorical(
      tf.math.log(ngram_length_probs(max_ngram))[None], tf.maximum(num_units, 1), length_seed, dtype=tf.int32)[0]
  ngram_starts = tf.cumsum(ngram_lengths, exclusive=True)
  ngram_starts = ngram_starts[ngram_starts < num_units]
  ngram_of_unit = tf.searchsorted(ngram_starts, tf.range(num_units), side="right") - 1
  ngram_sizes = tf.math.unsorted_segment_sum(unit_sizes, ngram_of_unit, tf.size(ngram_starts))

  ngram_order = tf.argsort(tf.random.stateless_uniform(tf.shape(ngram_sizes), ngram_order_seed))
  ngram_taken = _take_while_fits(ngram_order, ngram_sizes, num_to_predict)
  unit_taken = tf.gather(ngram_taken, ngram_of_unit)

  # Top up with single units that still fit: the last n-gram rarely fills the budget exactly.
  remaining = num_to_predict - tf.reduce_sum(tf.where(unit_taken, unit_sizes, 0))
  unit_order = tf.argsort(tf.random.stateless_uniform(tf.shape(unit_sizes), unit_order_seed))
  unit_taken |= _take_each_that_fits(unit_order, unit_sizes, tf.logical_not(unit_taken), remaining)

  return tf.gather(tf.concat([unit_taken, [False]], 0), tf.where(unit >= 0, unit, num_units))


def replace_masked(input_ids, chosen, seed, *, mask_id: int, random_token_min: int, vocab_size: int,
                   mask_prob: float = 0.8, random_prob: float = 0.1) -> tf.Tensor:
  """Chosen positions become [MASK] (mask_prob), a random normal piece (random_prob) or stay."""
  draw_seed, token_seed = split_seed(seed, 2)
  draw = tf.random.stateless_uniform(tf.shape(input_ids), draw_seed)
  random_tokens = tf.random.stateless_uniform(tf.shape(input_ids), token_seed, minval=random_token_min,
                                              maxval=vocab_size, dtype=tf.int32)
  replaced = tf.where(draw < mask_prob, mask_id, tf.where(draw < mask_prob + random_prob, random_tokens, input_ids))
  return tf.where(chosen, replaced, input_ids)


def prediction_budget(length, rate: float, max_predictions: int) -> tf.Tensor:
  """The reference's count: round(length × rate), at least 1, at most max_predictions."""
  wanted = tf.cast(tf.round(tf.cast(length, tf.float32) * rate), tf.int32)
  return tf.clip_by_value(wanted, 1, max_predictions)


def mask_tokens(input_ids, maskable, word_start, seed, *, max_predictions: int, mask_id: int,
                random_token_min: int, vocab_size: int, rate: float = 0.15, max_ngram: int = 1,
                whole_word: bool = False, mask_prob: float = 0.8, random_prob: float = 0.1) -> dict:
  """One example's MLM features.

  input_ids int32 [length] (padding excluded), maskable bool [length] (False on special tokens),
  word_start bool [length]. Returns input_ids (corrupted), masked_positions / masked_ids
  int32 [max_predictions] and masked_weights float32 [max_predictions], zero-padded.
  """
  choose_seed, replace_seed = split_seed(seed, 2)
  budget = prediction_budget(tf.size(input_ids), rate, max_predictions)
  chosen = choose_masked_positions(maskable, word_start, budget, choose_seed, max_ngram=max_ngram,
                                   whole_word=whole_word)
  positions = tf.cast(tf.where(chosen)[:, 0], tf.int32)[:max_predictions]
  padding = [[0, max_predictions - tf.size(positions)]]
  return {
      "input_ids": replace_masked(input_ids, chosen, replace_seed, mask_id=mask_id, random_token_min=random_token_min,
                                  vocab_size=vocab_size, mask_prob=mask_prob, random_prob=random_prob),
      "masked_positions": tf.pad(positions, padding),
      "masked_ids": tf.pad(tf.gather(input_ids, positions), padding),
      "masked_weights": tf.pad(tf.ones_like(positions, tf.float32), padding),
  }


@seqio.map_over_dataset(num_seeds=1)
@graphs.traced_once
def _mask_pair(example, seed, *, length, max_predictions, word_start, cls_id, sep_id, label_key, **mask_kwargs):
  a, b = example["tokens_a"], example["tokens_b"]
  input_ids = tf.concat([[cls_id], a, [sep_id], b, [sep_id]], 0)
  segment_ids = tf.concat([tf.zeros([tf.size(a) + 2], tf.int32), tf.ones([tf.size(b) + 1], tf.int32)], 0)
  maskable = (input_ids != cls_id) & (input_ids != sep_id)
  features = mask_tokens(input_ids, maskable, tf.gather(word_start, input_ids), seed,
                         max_predictions=max_predictions, **mask_kwargs)
  padding = [[0, length - tf.size(input_ids)]]
  features["input_ids"] = tf.ensure_shape(tf.pad(features["input_ids"], padding), [length])
  features["segment_ids"] = tf.ensure_shape(tf.pad(segment_ids, padding), [length])
  features[label_key] = example["label"]
  return features


def check_pair_lengths(sequence_length) -> None:
  """masked_positions must be 1 to the input_ids - 3 tokens of A and B: slots beyond those always stay padding."""
  maskable, predictions = sequence_length["input_ids"] - 3, sequence_length["masked_positions"]
  if predictions < 1:
    raise ValueError(f"masked_positions={predictions}: must be at least 1")
  if predictions > maskable:
    raise ValueError(f"masked_positions={predictions} is more than the {maskable} tokens of A and B in "
                     f"input_ids={sequence_length['input_ids']} ([CLS] A [SEP] B [SEP]): input_ids must be at least "
                     f"{predictions + 3}")


def masked_pair_features(dataset: tf.data.Dataset, sequence_length, *, word_start, cls_id: int, sep_id: int,
                         mask_id: int, random_token_min: int, vocab_size: int, label_key: str, rate: float = 0.15,
                         max_ngram: int = 1, whole_word: bool = False) -> tf.data.Dataset:
  """{'tokens_a', 'tokens_b', 'label'} -> `[CLS] A [SEP] B [SEP]` with segment ids and MLM targets,
  padded to sequence_length['input_ids'] and sequence_length['masked_positions']."""
  check_pair_lengths(sequence_length)
  return _mask_pair(dataset, length=sequence_length["input_ids"], max_predictions=sequence_length["masked_positions"],
                    word_start=np.asarray(word_start, bool), cls_id=cls_id, sep_id=sep_id, label_key=label_key,
                    mask_id=mask_id, random_token_min=random_token_min, vocab_size=vocab_size, rate=rate,
                    max_ngram=max_ngram, whole_word=whole_word)
