"""XLNet permutation language modelling (Yang et al. 2019; reference: zihangdai/xlnet data_utils.py).

Pure TensorFlow (graph mode, no py_function), over one batch row's windows of its text stream (the
row streams of `data_pipelines.row_streams` cut them from token files). Randomness is stateless,
from a seed per row and step. `window_examples` makes the function that turns a window into features:

- `layout_window`: the window's first reuse_len tokens (the text right after the previous window's,
  which the model's memory holds), then A <sep> B <sep> <cls> from the tokens after them, B the
  true continuation or random (`split_a_and_b`); segment ids 0 / 1 / 2.
- `permutation_features`: input_ids, segment_ids, perm_mask, target_mapping, target_ids,
  target_weights, input_q: whole-word n-gram spans to predict, ordered by local permutations.

Differences from the reference, on purpose:
- n-grams are whole words (the reference tests `seg[beg]` and so counts pieces; xlnet issue 220).
- Spans and top-ups never cover <sep>/<cls>, so every example has exactly num_predict targets.
- <sep>/<cls> are treated like unmasked tokens (visible to all, see no targets); in the reference
  they take part in the factorization order.
"""
import functools

import numpy as np
import tensorflow as tf

from data_pipelines.objectives import graphs
from data_pipelines.objectives.mlm import choose_masked_positions, ngram_length_probs
from data_pipelines.objectives.nsp_sop import pair_cuts
from data_pipelines.objectives.random_ops import randint, split_seed

_SPECIAL_SEGMENT = 2  # segment id of <cls>


def _check(condition: bool, message: str):
  if not condition:
    raise ValueError(message)


def _pair_length(seq_len: int, reuse_len: int) -> int:
  """Tokens of A + B: the window minus the reuse part, two <sep> and <cls>."""
  _check(reuse_len >= 1, f"reuse_len={reuse_len}: must be at least 1")
  _check(seq_len - reuse_len - 3 >= 2, f"seq_len={seq_len} is less than reuse_len + 5 = {reuse_len + 5} (the "
         f"reuse_len={reuse_len} reused tokens, then A <sep> B <sep> <cls>, at least one token each in A and B)")
  return seq_len - reuse_len - 3


def check_lengths(*, seq_len: int, reuse_len: int, perm_size: int, num_predict: int) -> None:
  """Refuses lengths whose windows cannot be laid out, permuted in blocks or given num_predict targets."""
  pair_length = _pair_length(seq_len, reuse_len)
  for name, part_len in (("reuse_len", reuse_len), ("seq_len - reuse_len", seq_len - reuse_len)):
    _check(perm_size >= 1 and part_len % perm_size == 0, f"perm_size={perm_size}: must divide {name}={part_len}")
  # `permutation_features` puts ceil(num_predict / 2) targets in the reuse part and the rest in A and B.
  most = min(2 * reuse_len, 2 * pair_length + 1)
  _check(0 <= num_predict <= most, f"num_predict={num_predict}: must be 0 to {most}, the most targets that fit: "
         f"ceil(num_predict / 2) among the reuse_len={reuse_len} reused tokens, the rest among the {pair_length} "
         "tokens of A and B")


def _first(flags, default):
  """Index of the first True, else default."""
  return tf.reduce_min(tf.where(flags, tf.range(tf.size(flags)), default))


def _last(flags, default):
  """Index of the last True, else default."""
  return tf.reduce_max(tf.where(flags, tf.range(tf.size(flags)), default))


def _trim_from_right(len_a, len_b, total: int):
  """Lengths after the reference's loop `while a + b > total: trim the longer (b on ties) at its right end`."""
  cut_a, cut_b = pair_cuts(len_a, len_b, total)
  return len_a - cut_a, len_b - cut_b


def split_a_and_b(window, other, seed, *, begin: int, total: int):
  """The reference's `_split_a_and_b` on one window: (A, B) int32 token vectors, len(A) + len(B) == total.

  window / other: {'ids', 'sentence_start'} of length >= begin + 2·total; A starts at `begin`.
  A ends at a random sentence boundary less than `total` tokens on (or runs to the first boundary at
  least `total` on when there is none). With probability 0.5 (always without such a boundary) B is
  random: from a random position of `other` (a window at a random place of the text), widened
  to whole sentences, at least total - len(A) tokens; else B is the true continuation up to the
  first boundary >= total tokens on. Then the longer of A and B is trimmed at its right end until
  the pair fits. Looking 2·total tokens ahead is enough: anything further would be trimmed anyway.
  """
  coin_seed, cut_seed, random_b_seed = split_seed(seed, 3)
  ids, starts = window["ids"], window["sentence_start"]
  window_len = tf.size(ids)
  offsets = tf.range(window_len) - begin
  end = _first(starts & (offsets >= total), window_len)
  cuts = tf.cast(tf.where(starts & (offsets >= 1) & (offsets < total))[:, 0], tf.int32)
  num_cuts = tf.size(cuts)
  a_end = tf.gather(tf.concat([cuts, [end]], 0), randint(cut_seed, 0, tf.maximum(num_cuts - 1, 0)))
  continuation = (num_cuts > 0) & (tf.random.stateless_uniform([], coin_seed) >= 0.5)

  # Random B: a uniform token position, moved back to its sentence start and on to a sentence end.
  b_len = tf.maximum(1, total - (a_end - begin))
  other_starts = other["sentence_start"]
  latest_begin = window_len - b_len
  first_start = _first(other_starts, window_len)
  anchor = randint(random_b_seed, tf.where(first_start <= latest_begin, first_start, 0), latest_begin)
  positions = tf.range(window_len)
  random_begin = _last(other_starts & (positions <= anchor), 0)
  random_end = _first(other_starts & (positions >= anchor + b_len), window_len)

  b_source = tf.where(continuation, ids, other["ids"])
  b_begin = tf.where(continuation, a_end, random_begin)
  b_end = tf.where(continuation, end, random_end)
  len_a, len_b = _trim_from_right(a_end - begin, b_end - b_begin, total)
  return ids[begin:begin + len_a], b_source[b_begin:b_begin + len_b]


def window_length(seq_len: int, reuse_len: int) -> int:
  """Stream tokens one window looks at: its reuse part, then twice what A and B take (see `split_a_and_b`)."""
  return reuse_len + 2 * _pair_length(seq_len, reuse_len)


def layout_window(window, other, seed, *, seq_len: int, reuse_len: int, sep_id: int, cls_id: int) -> dict:
  """One window {'ids', 'sentence_start'} of `window_length` stream tokens -> input_ids and segment_ids
  [seq_len]: its first reuse_len tokens, then A <sep> B <sep> <cls>, B random from `other` or not."""
  a, b = split_a_and_b(window, other, seed, begin=reuse_len, total=_pair_length(seq_len, reuse_len))
  input_ids = tf.concat([window["ids"][:reuse_len], a, [sep_id], b, [sep_id, cls_id]], 0)
  segment_ids = tf.concat([tf.zeros([reuse_len + tf.size(a) + 1], tf.int32), tf.ones([tf.size(b) + 1], tf.int32),
                           [_SPECIAL_SEGMENT]], 0)
  return {"input_ids": tf.ensure_shape(input_ids, [seq_len]), "segment_ids": tf.ensure_shape(segment_ids, [seq_len])}


# ----------------------------------------------------------------------------- prediction mask

def segment_words(tokens, word_start, *, sep_id: int, cls_id: int):
  """Word layout of one segment read forwards.

  A word starts at a word-start piece, at <sep>/<cls> (words of their own) and right after one.
  Returns (begins bool [length], word_of_token int32 [length], bounds int32 [num_words + 1]: each
  word's first token then the length, maskable_word bool [num_words]). A word is maskable when it
  is not <sep>/<cls>, starts with a word-start piece and ends inside the segment (the last word
  may continue beyond, so its end is unknown; the reference also never spans it).
  """
  length = tf.size(tokens)
  barrier = (tokens == sep_id) | (tokens == cls_id)
  table_start = tf.gather(word_start, tokens)
  begins = table_start | barrier | tf.concat([[True], barrier[:-1]], 0)
  word_of_token = tf.cumsum(tf.cast(begins, tf.int32)) - 1
  bounds = tf.concat([tf.cast(tf.where(begins)[:, 0], tf.int32), [length]], 0)
  maskable_word = tf.gather(table_start & ~barrier, bounds[:-1]) & (bounds[1:] < length)
  return begins, word_of_token, bounds, maskable_word


def _spans_over_words(bounds, maskable_word, seed, *, goal, mask_alpha: int, mask_beta: int, max_ngram: int):
  """bool [num_words]: which words `sample_spans` masks, given the layout from `segment_words`."""
  length, num_words = bounds[-1], tf.size(maskable_word)
  word_index = tf.range(num_words)
  candidates = tf.concat([tf.boolean_mask(word_index, maskable_word), [num_words]], 0)  # num_words = none left
  candidate_starts = tf.gather(bounds, candidates)
  # run[w]: how many maskable words follow each other from word w on.
  blocked = tf.concat([tf.boolean_mask(word_index, ~maskable_word), [num_words]], 0)
  run = tf.concat([tf.gather(blocked, tf.searchsorted(blocked, word_index)) - word_index, [0]], 0)
  log_probs = tf.math.log(ngram_length_probs(max_ngram))[None]

  def body(step, cursor, num_masked, word_masked):
    n_seed, context_seed = split_seed(tf.random.experimental.stateless_fold_in(seed, step), 2)
    n = 1 + tf.random.stateless_categorical(log_probs, 1, n_seed, dtype=tf.int32)[0, 0]
    context = n * mask_alpha // mask_beta
    left = randint(context_seed, 0, context - 1)
    next_candidate = tf.searchsorted(candidate_starts, [cursor + left])[0]
    word = tf.gather(candidates, tf.minimum(next_candidate, tf.size(candidates) - 1))
    fitting = tf.searchsorted(bounds, [bounds[word] + goal - num_masked], side="right")[0] - 1 - word
    take = tf.minimum(tf.minimum(n, run[word]), fitting)
    end = bounds[word + take]
    word_masked |= (word_index >= word) & (word_index < word + take)
    cursor = tf.where(take > 0, end + context - left, length)
    return step + 1, cursor, num_masked + end - bounds[word], word_masked

  _, _, _, word_masked = tf.while_loop(
      lambda step, cursor, num_masked, _: (cursor < length) & (num_masked < goal), body,
      (tf.constant(0), tf.constant(0), tf.constant(0), tf.zeros([num_words], tf.bool)))
  return word_masked


def sample_spans(tokens, seed, *, goal, word_start, sep_id: int, cls_id: int, mask_alpha: int, mask_beta: int,
                 max_ngram: int):
  """bool [length]: the n-gram spans of the reference's `_sample_mask` on one forward segment.

  Walks left to right: draws n ~ p(n) ∝ 1/n and a context of n·mask_alpha // mask_beta tokens,
  skips a random left part of the context, masks the next n maskable words (fewer when a
  non-maskable word or the budget of `goal` tokens comes first), then skips the rest of the
  context. Spans never touch. Stops when `goal` tokens are masked or the next word does not fit.
  """
  _, word_of_token, bounds, maskable_word = segment_words(tokens, word_start, sep_id=sep_id, cls_id=cls_id)
  word_masked = _spans_over_words(bounds, maskable_word, seed, goal=goal, mask_alpha=mask_alpha,
                                  mask_beta=mask_beta, max_ngram=max_ngram)
  return tf.gather(word_masked, word_of_token)


def span_mask(tokens, seed, *, goal, word_start, sep_id: int, cls_id: int, mask_alpha: int, mask_beta: int,
              max_ngram: int):
  """bool [length]: exactly `goal` targets (when the segment has that many non-<sep>/<cls> tokens).

  `sample_spans`, then top-ups at random places: whole maskable words that fit, then maskable
  one-piece words, and only if those run out single pieces of any non-<sep>/<cls> token.
  """
  span_seed, fill_seed = split_seed(seed, 2)
  begins, word_of_token, bounds, maskable_word = segment_words(tokens, word_start, sep_id=sep_id, cls_id=cls_id)
  word_masked = _spans_over_words(bounds, maskable_word, span_seed, goal=goal, mask_alpha=mask_alpha,
                                  mask_beta=mask_beta, max_ngram=max_ngram)
  masked = tf.gather(word_masked, word_of_token)
  one_piece_word = maskable_word & (bounds[1:] - bounds[:-1] == 1)
  fillers = ((tf.gather(maskable_word, word_of_token), True), (tf.gather(one_piece_word, word_of_token), False),
             ((tokens != sep_id) & (tokens != cls_id), False))
  for stage, (candidates, whole_word) in enumerate(fillers):
    remaining = goal - tf.reduce_sum(tf.cast(masked, tf.int32))
    masked |= tf.cond(  # most examples are full after the first stage or two: skip the rest
        remaining > 0,
        lambda: choose_masked_positions(candidates & ~masked, begins, remaining,
                                        tf.random.experimental.stateless_fold_in(fill_seed, stage),
                                        whole_word=whole_word),
        lambda: tf.zeros_like(masked))
  return masked


# ----------------------------------------------------------------------------- permutation

def local_permutation_mask(is_target, seed, perm_size: int):
  """perm_mask float32 [length, length] of one part (the reference's `_local_perm`); 1 = i cannot see j.

  Factorization order: blocks of perm_size positions in order, the same random shuffle inside every
  block. Non-targets (incl. <sep>/<cls>) get order -1: everyone sees them, they see no target; a
  target sees exactly the targets earlier in the order, never itself.
  """
  length = tf.size(is_target)
  shuffle = tf.argsort(tf.random.stateless_uniform([perm_size], seed))
  index = tf.reshape(tf.range(0, length, perm_size)[:, None] + shuffle[None, :], [-1])
  rev_index = tf.where(is_target, index, -1)
  self_rev_index = tf.where(is_target, rev_index, rev_index + 1)
  return tf.cast((self_rev_index[:, None] <= rev_index[None, :]) & is_target[None, :], tf.float32)


def permutation_features(input_ids, segment_ids, backward, seed, *, reuse_len: int, perm_size: int, num_predict: int,
                         word_start, sep_id: int, cls_id: int, mask_alpha: int = 6, mask_beta: int = 1,
                         max_ngram: int = 5) -> dict:
  """One window's XLNet features (the reference's `parser`).

  input_ids / segment_ids int32 [seq_len]; backward: bool scalar, the window reads right to left (the
  backward half of bi_data; words are found after flipping each part back, as the reference's
  `_sample_mask(reverse=True)`).
  The reuse part gets ceil(num_predict / 2) targets and the rest floor (43 / 42 of 85).
  """
  seq_len = input_ids.shape[0]
  mask_seeds = split_seed(seed, 4)
  parts = (input_ids[:reuse_len], input_ids[reuse_len:])
  goals = (num_predict - num_predict // 2, num_predict // 2)
  is_target, perm_masks = [], []
  for part, goal, mask_seed, perm_seed in zip(parts, goals, mask_seeds[:2], mask_seeds[2:]):
    forward = tf.where(backward, tf.reverse(part, [0]), part)
    masked = span_mask(forward, mask_seed, goal=goal, word_start=word_start, sep_id=sep_id, cls_id=cls_id,
                       mask_alpha=mask_alpha, mask_beta=mask_beta, max_ngram=max_ngram)
    is_target.append(tf.where(backward, tf.reverse(masked, [0]), masked))
    perm_masks.append(local_permutation_mask(is_target[-1], perm_seed, perm_size))

  rest_len = seq_len - reuse_len
  # The reuse part becomes the next window's memory, and the next window's reuse part is this A
  # (targets included): so the reuse part sees nothing of the rest; the rest sees all of it.
  perm_mask = tf.concat([tf.concat([perm_masks[0], tf.ones([reuse_len, rest_len])], 1),
                         tf.concat([tf.zeros([rest_len, reuse_len]), perm_masks[1]], 1)], 0)
  is_target = tf.concat(is_target, 0)
  positions = tf.cast(tf.where(is_target)[:, 0], tf.int32)[:num_predict]
  padding = num_predict - tf.size(positions)
  return {
      "input_ids": input_ids,
      "segment_ids": segment_ids,
      "perm_mask": tf.ensure_shape(perm_mask, [seq_len, seq_len]),
      "target_mapping": tf.ensure_shape(tf.pad(tf.one_hot(positions, seq_len), [[0, padding], [0, 0]]),
                                        [num_predict, seq_len]),
      "target_ids": tf.ensure_shape(tf.pad(tf.gather(input_ids, positions), [[0, padding]]), [num_predict]),
      "target_weights": tf.ensure_shape(tf.pad(tf.ones_like(positions, tf.float32), [[0, padding]]), [num_predict]),
      "input_q": tf.cast(is_target, tf.float32),
  }


def window_examples(*, seq_len: int, reuse_len: int, perm_size: int, num_predict: int, word_start, sep_id: int,
                    cls_id: int, mask_alpha: int = 6, mask_beta: int = 1, max_ngram: int = 5):
  """`example(window, other, backward, seed)`: one row's features at one step from its stream windows
  (`layout_window`, then `permutation_features`), after checking the settings once.

  window / other: {'ids', 'sentence_start'} of `window_length(seq_len, reuse_len)` stream tokens, as the
  row reads them; backward: bool scalar, the row reads its text right to left. word_start: bool
  [vocab_size], True for pieces starting with "▁" and for special tokens.

  Its graph (seconds to build) is traced once per process for each settings (graphs.traced_once), then
  shared by every pipeline that maps it (training's, evaluation's, a resumed run's).
  """
  check_lengths(seq_len=seq_len, reuse_len=reuse_len, perm_size=perm_size, num_predict=num_predict)
  _check(mask_alpha >= mask_beta >= 1, f"mask_alpha={mask_alpha}, mask_beta={mask_beta}: need alpha >= beta >= 1")
  _check(max_ngram >= 1, f"max_ngram={max_ngram}: must be >= 1")
  return functools.partial(_window_example, seq_len=seq_len, reuse_len=reuse_len, perm_size=perm_size,
                           num_predict=num_predict, word_start=np.asarray(word_start, bool), sep_id=sep_id,
                           cls_id=cls_id, mask_alpha=mask_alpha, mask_beta=mask_beta, max_ngram=max_ngram)


@graphs.traced_once
def _window_example(window, other, backward, seed, *, seq_len: int, reuse_len: int, perm_size: int, num_predict: int,
                    word_start, sep_id: int, cls_id: int, mask_alpha: int, mask_beta: int, max_ngram: int):
  layout_seed, features_seed = split_seed(seed, 2)
  laid = layout_window(window, other, layout_seed, seq_len=seq_len, reuse_len=reuse_len, sep_id=sep_id, cls_id=cls_id)
  return permutation_features(laid["input_ids"], laid["segment_ids"], backward, features_seed, reuse_len=reuse_len,
                              perm_size=perm_size, num_predict=num_predict, word_start=word_start, sep_id=sep_id,
                              cls_id=cls_id, mask_alpha=mask_alpha, mask_beta=mask_beta, max_ngram=max_ngram)
