"""BART noise functions and T5 span corruption: statistical properties over thousands of examples,
run through tf.data maps (graph mode), plus determinism and reassembly checks.

Documents are mostly built as `OFFSET + position`, so every surviving token tells where it came from.
Tolerances: a rate measured over N independent trials gets 4.5 standard errors, sqrt(p(1 - p) / N),
i.e. a false-alarm chance of about 1e-5 per check; chi-square checks use the 1e-4 quantile.
"""
import math

import numpy as np
import pytest
import seqio
import tensorflow as tf
from scipy import stats

from helpers import assert_rate, map_examples, nested_lists, seeds
from data_pipelines.objectives import denoising, documents, span_corruption

MASK, EOS, BOS = 6, 1, 3
OFFSET = 10


def positional_docs(lengths, salt=0):
  """Elements for map_examples: documents OFFSET + range(length), one seed each."""
  return {"length": np.asarray(lengths, np.int32), "seed": seeds(len(lengths), salt)}


def positions(element):
  return tf.range(element["length"]) + OFFSET


def assert_rounded(counts, lengths, rate, what):
  """Each document selects round(rate * n) items (any rounding of ties)."""
  error = np.abs(np.asarray(counts) - rate * np.asarray(lengths))
  assert np.all(error <= 0.5 + 1e-6), f"{what}: counts are not round({rate} * n)"


def infilling_spans(noised, length):
  """Span lengths (0 = pure insertion) read off an infilled positional document; checks each mask is
  one span: masks never touch, kept tokens keep their order, every removed run has exactly one mask."""
  is_mask = noised == MASK
  assert not np.any(is_mask[1:] & is_mask[:-1]), "two masks side by side"
  kept = noised[~is_mask] - OFFSET
  assert np.all(np.diff(kept) > 0), "kept tokens out of order"
  removed_per_gap = np.diff(np.concatenate([[-1], kept, [length]])) - 1
  gap_of_mask = np.cumsum(~is_mask)[is_mask]  # a mask after j kept tokens sits in gap j
  has_mask = np.zeros(len(removed_per_gap), bool)
  has_mask[gap_of_mask] = True
  assert np.all(removed_per_gap[~has_mask] == 0), "tokens removed without a mask"
  return removed_per_gap[has_mask]


def test_text_infilling_masks_30_percent_in_poisson_3_spans():
  rng = np.random.default_rng(0)
  lengths = rng.integers(400, 601, size=1000)
  outputs = map_examples(lambda e: denoising.text_infilling(positions(e), e["seed"], MASK),
                         positional_docs(lengths))
  spans = [infilling_spans(noised, n) for noised, n in zip(outputs, lengths)]
  removed = np.array([s.sum() for s in spans])

  # The masked count per document is fixed by the rate (up to rounding), so the overall fraction
  # can only miss 0.30 by the rounding: at most 0.5 / 400.
  assert_rounded(removed, lengths, 0.3, "masked tokens")
  assert abs(removed.sum() / lengths.sum() - 0.3) <= 0.5 / 400

  all_spans = np.concatenate(spans)
  # Mean span length: sampling error sqrt(3 / ~50k spans) ~ 0.008, and the budget trims one of the
  # ~50 spans per document, lowering the mean by at most lambda / 50 = 0.06: allow 0.1.
  assert abs(all_spans.mean() - 3.0) < 0.1, all_spans.mean()
  # Histogram of lengths 0..10 (+ one bin for longer) against Poisson(3): the expected sampling
  # total-variation distance is 0.5 * sum_k sqrt(p_k / N) ~ 0.008 and the one trimmed span per document
  # moves at most 1/50 of the mass (~0.02 at worst): allow 0.03.
  histogram = np.bincount(np.minimum(all_spans, 11), minlength=12) / len(all_spans)
  poisson = stats.poisson.pmf(np.arange(11), 3.0)
  expected = np.append(poisson, 1 - poisson.sum())
  total_variation = 0.5 * np.abs(histogram - expected).sum()
  assert total_variation < 0.03, (total_variation, histogram.round(3), expected.round(3))
  # Zero-length spans (insertions) happen at Poisson's rate P(0) = e^-3 ~ 0.05.
  assert_rate((all_spans == 0).sum(), len(all_spans), math.exp(-3), "zero-length spans")


@pytest.mark.parametrize("ratio", [0.3, 0.8, 1.0])
def test_text_infilling_is_exact_on_tiny_and_dense_documents(ratio):
  lengths = np.repeat(np.arange(0, 13), 20)
  outputs = map_examples(lambda e: denoising.text_infilling(positions(e), e["seed"], MASK, ratio),
                         positional_docs(lengths))
  removed = [infilling_spans(noised, n).sum() for noised, n in zip(outputs, lengths)]
  assert_rounded(removed, lengths, ratio, "masked tokens")


def test_text_infilling_mask_random_fraction():
  vocab_size = 1000  # positional tokens start above it, so random ids never look like kept tokens
  lengths = np.full(300, 200)
  elements = positional_docs(lengths)
  outputs = map_examples(
      lambda e: denoising.text_infilling(positions(e) + vocab_size, e["seed"], MASK, mask_random_ratio=0.5,
                                         vocab_size=vocab_size), elements)
  placeholders = np.concatenate([noised[noised < vocab_size] for noised in outputs])
  assert placeholders.min() >= 1
  # A random id equals mask_id with chance 1/999, so random spans show as non-mask at 0.5 * 998/999.
  assert_rate((placeholders != MASK).sum(), len(placeholders), 0.5 * 998 / 999, "random-token spans")


def test_whole_word_infilling_masks_30_percent_of_words_in_poisson_3_word_spans():
  rng = np.random.default_rng(1)
  length, num_docs = 600, 1000
  word_start = rng.random((num_docs, length)) < 0.5
  outputs = map_examples(
      lambda e: denoising.whole_word_infilling(positions(e), e["word_start"], e["seed"], MASK),
      {**positional_docs(np.full(num_docs, length)), "word_start": word_start})
  removed, all_spans = [], []
  for noised, starts in zip(outputs, word_start):
    starts[0] = True
    word_of = np.cumsum(starts) - 1
    kept = noised[noised != MASK] - OFFSET
    kept_per_word = np.bincount(word_of[kept], minlength=word_of[-1] + 1)
    assert np.all((kept_per_word == 0) | (kept_per_word == np.bincount(word_of))), "a word was split"
    # The same document at word level (a token per word) must be a valid token-level infilling.
    word_level = [MASK if t == MASK else OFFSET + word_of[t - OFFSET] for t in noised]
    word_level = np.array([w for i, w in enumerate(word_level) if i == 0 or w == MASK or w != word_level[i - 1]])
    spans = infilling_spans(word_level, word_of[-1] + 1)
    removed.append((spans.sum(), word_of[-1] + 1))
    all_spans.append(spans)
  removed_words, num_words = np.array(removed).T
  assert_rounded(removed_words, num_words, 0.3, "masked words")
  all_spans = np.concatenate(all_spans)
  # ~30 spans per document: sampling error ~0.01, and trimming one span per document lowers the
  # mean by at most lambda / 30 = 0.1: allow 0.15.
  assert abs(all_spans.mean() - 3.0) < 0.15, all_spans.mean()


def sentence_docs(num_sentences, num_docs, rng):
  """Documents whose sentence i is 100 * (i + 1) + range(random length)."""
  rows = [[list(100 * (i + 1) + np.arange(rng.integers(1, 6))) for i in range(num_sentences)]
          for _ in range(num_docs)]
  return tf.ragged.constant(rows, dtype=tf.int32)


def sentence_orders(outputs):
  return [tuple(int(sentence[0]) // 100 - 1 for sentence in doc) for doc in outputs]


@pytest.mark.parametrize("num_sentences", [3, 4])
def test_sentence_permutation_is_uniform(num_sentences):
  docs = sentence_docs(num_sentences, 2400, np.random.default_rng(num_sentences))
  outputs = map_examples(lambda e: denoising.permute_sentences(e["doc"], e["seed"]),
                         {"doc": docs, "seed": seeds(2400)})
  for original, permuted in zip(nested_lists(docs), outputs):
    assert sorted(map(list, permuted)) == sorted(original)  # same multiset of sentences
  orders = sentence_orders(outputs)
  identity = tuple(range(num_sentences))
  assert_rate(sum(order == identity for order in orders), len(orders), 1 / math.factorial(num_sentences),
              "unchanged orders")
  counts = np.array([orders.count(p) for p in set(orders)])
  assert len(counts) == math.factorial(num_sentences)
  assert stats.chisquare(counts).pvalue > 1e-4


def test_partial_sentence_permutation_moves_only_the_chosen_half():
  docs = sentence_docs(4, 2000, np.random.default_rng(7))
  outputs = map_examples(lambda e: denoising.permute_sentences(e["doc"], e["seed"], 0.5),
                         {"doc": docs, "seed": seeds(2000)})
  moved = np.array([sum(i != s for i, s in enumerate(order)) for order in sentence_orders(outputs)])
  assert set(moved) <= {0, 2}  # round(0.5 * 4) = 2 sentences chosen, shuffled between themselves
  assert_rate((moved == 0).sum(), len(moved), 0.5, "unchanged orders")


def test_rotation_is_a_uniform_rotation():
  length = 7
  outputs = map_examples(lambda e: denoising.rotate_document(positions(e), e["seed"]),
                         positional_docs(np.full(2100, length)))
  original = np.arange(length) + OFFSET
  starts = []
  for rotated in outputs:
    start = int(rotated[0]) - OFFSET
    np.testing.assert_array_equal(rotated, np.roll(original, -start))
    starts.append(start)
  assert stats.chisquare(np.bincount(starts, minlength=length)).pvalue > 1e-4


def check_selection(selected, lengths, rate, what):
  """Counts are round(rate * n); for equal lengths each position is selected at the rate."""
  assert_rounded(selected.sum(axis=1), lengths, rate, what)
  for position, hits in enumerate(selected.sum(axis=0)):
    assert_rate(hits, len(selected), rate, f"{what} at position {position}")


def test_token_deletion_rate_and_positions():
  length, rate = 20, 0.2
  outputs = map_examples(lambda e: denoising.token_deletion(positions(e), e["seed"], rate),
                         positional_docs(np.full(3000, length)))
  deleted = np.ones((len(outputs), length), bool)
  for row, kept in zip(deleted, outputs):
    assert np.all(np.diff(kept) > 0)  # the survivors keep their order
    row[kept - OFFSET] = False
  check_selection(deleted, np.full(len(outputs), length), rate, "deleted")


def test_token_masking_rate_and_positions():
  length, rate = 20, 0.15
  outputs = np.stack(map_examples(lambda e: denoising.token_masking(positions(e), e["seed"], MASK, rate),
                                  positional_docs(np.full(3000, length))))
  original = np.arange(length) + OFFSET
  masked = outputs != original
  assert np.all(outputs[masked] == MASK)
  check_selection(masked, np.full(len(outputs), length), rate, "masked")


def denoising_example(element, **overrides):
  kwargs = dict(encoder_length=64, decoder_length=64, eos_id=EOS, mask_id=MASK, bos_id=BOS)
  return denoising.denoising_features(element["doc"], element["seed"], **{**kwargs, **overrides})


def test_denoising_features_target_is_original_document():
  rng = np.random.default_rng(3)
  rows = [[list(rng.integers(OFFSET, 1000, size=rng.integers(1, 20))) for _ in range(rng.integers(1, 8))]
          for _ in range(1000)]
  docs = tf.ragged.constant(rows, dtype=tf.int32)
  outputs = map_examples(denoising_example, {"doc": docs, "seed": seeds(1000)})
  chunk = 64 - 2  # room for bos and eos
  for row, features in zip(rows, outputs):
    original = np.concatenate(row)[:chunk]
    num_targets = len(original) + 2
    target = features["decoder_target_ids"]
    np.testing.assert_array_equal(target[:num_targets], np.concatenate([[BOS], original, [EOS]]))
    assert np.all(target[num_targets:] == 0)
    np.testing.assert_array_equal(features["decoder_weights"], np.arange(64) < num_targets)
    np.testing.assert_array_equal(features["decoder_input_ids"], np.concatenate([[EOS], target[:-1]]))
    encoder = features["encoder_input_ids"]
    encoder = encoder[:np.count_nonzero(encoder)]
    assert encoder[0] == BOS and encoder[-1] == EOS
    noised = encoder[1:-1]
    kept = noised[noised != MASK]
    # Permutation + infilling mask round(0.3 n) of the chunk's n tokens and keep the rest.
    assert_rounded([len(original) - len(kept)], [len(original)], 0.3, "masked tokens")
    assert not set(kept) - set(original)


def features_for_seeds(make_features, element, seed_list):
  return [make_features({**element, "seed": tf.constant(seed, tf.int64)}) for seed in seed_list]


def assert_seed_determinism(make_features, element):
  first, again = features_for_seeds(make_features, element, [[1, 2], [1, 2]])
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  varied = features_for_seeds(make_features, element, [[1, s] for s in range(20)])
  distinct = {tuple(f["encoder_input_ids"].numpy()) for f in varied}
  assert len(distinct) >= 18


def test_same_seed_same_output_different_seed_different_output():
  doc = tf.ragged.constant([list(range(10 * i + OFFSET, 10 * i + OFFSET + 8)) for i in range(6)], dtype=tf.int32)
  assert_seed_determinism(denoising_example, {"doc": doc})
  assert_seed_determinism(
      lambda e: span_corruption.span_corruption_features(
          e["tokens"], e["seed"], encoder_length=64, decoder_length=32, eos_id=EOS, first_sentinel_id=31999),
      {"tokens": tf.range(OFFSET, OFFSET + 60)})


def test_seqio_preprocessors_are_reproducible_with_fixed_shapes():
  docs = tf.ragged.constant([[[11, 12, 13], [14, 15]], [[16, 17], [18], [19, 20, 21]]], dtype=tf.int32)
  tokens = tf.ragged.constant([list(range(OFFSET, OFFSET + 40)), list(range(OFFSET, OFFSET + 25))], dtype=tf.int32)

  def run():
    with seqio.map_seed_manager(123):
      bart = denoising.denoising_preprocessor(
          tf.data.Dataset.from_tensor_slices({"sentences": docs}),
          sequence_length={"encoder_input_ids": 16, "decoder_input_ids": 16}, eos_id=EOS, mask_id=MASK)
      t5 = span_corruption.span_corruption_preprocessor(
          tf.data.Dataset.from_tensor_slices({"targets": tokens}),
          sequence_length={"encoder_input_ids": 32, "decoder_input_ids": 16}, eos_id=EOS, first_sentinel_id=999)
    return bart, t5

  for dataset, (encoder_length, decoder_length) in zip(run(), [(16, 16), (32, 16)]):
    spec = dataset.element_spec
    assert spec["encoder_input_ids"].shape == (encoder_length,)
    assert spec["decoder_weights"].shape == (decoder_length,) and spec["decoder_weights"].dtype == tf.float32
  for first, again in zip(run(), run()):
    for a, b in zip(first.as_numpy_iterator(), again.as_numpy_iterator()):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key])


FIRST_SENTINEL = 31999  # vocab_size - 1 for a 32000-piece vocabulary


def reassemble(inputs, targets, last_token_id=1000):
  """Original tokens from span-corrupted inputs and targets (eos stripped): each sentinel (an id
  above last_token_id) in the inputs is replaced by the tokens following it in the targets."""
  spans, sentinel = {}, None
  for token in targets:
    if token > last_token_id:
      sentinel = token
      spans[sentinel] = []
    else:
      spans[sentinel].append(token)
  return [t for token in inputs for t in (spans[token] if token > last_token_id else [token])], list(spans)


def test_span_corruption_density_span_length_and_reassembly():
  rng = np.random.default_rng(5)
  lengths = rng.integers(100, 601, size=1500)
  outputs = map_examples(lambda e: span_corruption.span_corruption(positions(e), e["seed"], FIRST_SENTINEL),
                         positional_docs(lengths))
  noise, num_spans = [], []
  for (inputs, targets), n in zip(outputs, lengths):
    original, sentinels = reassemble(inputs, targets)
    np.testing.assert_array_equal(original, np.arange(n) + OFFSET)
    assert sentinels == list(range(FIRST_SENTINEL, FIRST_SENTINEL - len(sentinels), -1))
    assert list(inputs[inputs > 1000]) == sentinels  # every span has one sentinel, in order
    noise.append(len(targets) - len(sentinels))
    num_spans.append(len(sentinels))
  noise, num_spans = np.array(noise), np.array(num_spans)
  assert_rounded(noise, lengths, 0.15, "noise tokens")
  assert abs(noise.sum() / lengths.sum() - 0.15) <= 0.5 / 100  # rounding only, as for infilling
  assert_rounded(num_spans, noise, 1 / 3, "noise spans")
  # Span counts are round(noise / 3), off by <= 0.5 each, so the mean span length misses 3 by at most
  # 3 * 0.5 * num_docs / total_spans.
  assert abs(noise.sum() / num_spans.sum() - 3.0) <= 1.5 * len(lengths) / num_spans.sum()


def test_span_corruption_segments_uniformly_at_random():
  # 100 tokens: 15 noise tokens in 5 spans. A uniformly random cut of 15 items into 5 non-empty runs
  # gives a run length k with probability C(15 - k - 1, 3) / C(14, 4).
  outputs = map_examples(lambda e: span_corruption.random_spans_noise_mask(e["length"], e["seed"]),
                         positional_docs(np.full(1000, 100)))
  run_lengths = []
  for mask in outputs:
    assert not mask[0] and mask.sum() == 15
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    run_lengths.extend(edges[1::2] - edges[::2])
  assert len(run_lengths) == 5 * len(outputs)
  observed = np.bincount(run_lengths, minlength=12)[1:12]
  expected = np.array([math.comb(15 - k - 1, 3) / math.comb(14, 4) for k in range(1, 12)]) * len(run_lengths)
  pooled = slice(0, 7)  # lengths 1..7 each expect > 100 runs; pool the tail into one bin
  observed = np.append(observed[pooled], observed[7:].sum())
  expected = np.append(expected[pooled], len(run_lengths) - expected[pooled].sum())
  assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_span_corruption_features_fit_and_truncate():
  # T5's published sizes: 568 tokens make 512 inputs and 114 targets at density 0.15, spans of 3.
  assert int(span_corruption.max_tokens_for_lengths(512, 114)) == 568
  lengths = np.array([50, 300, 568, 900])
  outputs = map_examples(
      lambda e: span_corruption.span_corruption_features(
          positions(e), e["seed"], encoder_length=512, decoder_length=114, eos_id=EOS,
          first_sentinel_id=FIRST_SENTINEL), positional_docs(lengths))
  for features, n in zip(outputs, lengths):
    inputs = features["encoder_input_ids"][:np.count_nonzero(features["encoder_input_ids"])]
    num_targets = int(features["decoder_weights"].sum())
    targets = features["decoder_target_ids"][:num_targets]
    assert inputs[-1] == EOS and targets[-1] == EOS
    original, _ = reassemble(inputs[:-1], targets[:-1])
    np.testing.assert_array_equal(original, np.arange(min(n, 568)) + OFFSET)
    np.testing.assert_array_equal(features["decoder_input_ids"][:num_targets], np.concatenate([[0], targets[:-1]]))


def test_bad_settings_raise():
  with pytest.raises(ValueError, match="infilling_ratio"):
    denoising.DenoisingConfig(infilling_ratio=1.5)
  with pytest.raises(ValueError, match="poisson_lambda"):
    denoising.DenoisingConfig(poisson_lambda=0.0)
  with pytest.raises(ValueError, match="vocab_size"):
    denoising.text_infilling(tf.range(10), tf.constant([0, 1]), MASK, mask_random_ratio=0.1)
  with pytest.raises(ValueError, match="encoder_length"):
    denoising.denoising_features(tf.range(10), tf.constant([0, 1]), encoder_length=2, decoder_length=8,
                                 eos_id=EOS, mask_id=MASK, bos_id=BOS)
  with pytest.raises(ValueError, match="noise_density"):
    span_corruption.random_spans_noise_mask(10, tf.constant([0, 1]), noise_density=0.0)


def test_sentence_blocks_keep_every_token_in_order_each_block_as_full_as_whole_sentences_allow():
  rng = np.random.default_rng(0)
  sentence_blocks = tf.function(documents.sentence_blocks, reduce_retracing=True)  # as a preprocessor runs it
  for _ in range(300):
    max_tokens = int(rng.choice([4, 16, 50]))
    lengths = rng.integers(1, 40, rng.integers(1, 12))
    starts = np.cumsum(lengths) - lengths
    document = tf.RaggedTensor.from_row_lengths(tf.range(int(lengths.sum())), lengths)
    blocks = nested_lists(sentence_blocks(document, tf.constant(max_tokens)))
    assert [t for block in blocks for piece in block for t in piece] == list(range(int(lengths.sum())))
    sizes = [sum(map(len, block)) for block in blocks]
    assert max(sizes) <= max_tokens
    for block, next_block in zip(blocks, blocks[1:]):
      # A block ends where the next piece would not fit; pieces begin at sentence starts unless a
      # sentence longer than max_tokens was cut (then at multiples of max_tokens into it).
      assert sum(map(len, block)) + len(next_block[0]) > max_tokens
    for block in blocks:
      for piece in block:
        sentence = np.searchsorted(starts, piece[0], side="right") - 1
        assert (piece[0] - starts[sentence]) % max_tokens == 0 and len(piece) <= max_tokens


@pytest.mark.parametrize("objective", ["bart_denoising", "t5_span_corruption"])
def test_the_tasks_use_every_token_of_long_documents(objective, demo_paths):
  """Over one epoch the examples hold the documents' tokens, all of them and in order, though many
  documents are longer than one example."""
  from data_pipelines import sources, tasks
  task = tasks.get_task_or_mixture(f"demo_{objective}")
  vocabulary = task.output_features["encoder_input_ids"].vocabulary
  source = sources.TextDocumentSource({"validation": demo_paths["validation"]})
  document_ids = [[t for sentence in doc["sentences"] for t in sentence] for doc in documents.tokenize_sentences(
      source.get_dataset("validation", shuffle=False), task.output_features).as_numpy_iterator()]
  document_tokens = [t for ids in document_ids for t in ids]
  lengths = {"encoder_input_ids": 64, "decoder_input_ids": 64 if objective == "bart_denoising" else 16}
  examples = list(task.get_dataset(lengths, split="validation", shuffle=False, num_epochs=1).as_numpy_iterator())
  last_token_id = vocabulary.vocab_size - vocabulary.extra_ids - 1  # T5's sentinels are the extra ids above
  found = []
  for example in examples:
    targets = example["decoder_target_ids"][example["decoder_weights"] > 0]
    if objective == "bart_denoising":
      found += targets[1:-1].tolist()  # between bos and eos
    else:
      inputs = example["encoder_input_ids"][example["encoder_input_ids"] > 0]
      found += reassemble(inputs[:-1].tolist(), targets[:-1].tolist(), last_token_id)[0]
  assert len(examples) > 100
  if objective == "t5_span_corruption":
    assert found == document_tokens
    # As T5's reduce_concat_tokens + split_tokens: each run of DOCUMENTS_PER_STREAM documents is one stream
    # cut into full examples, only its last one shorter; one example per document would make more.
    block = int(span_corruption.max_tokens_for_lengths(lengths["encoder_input_ids"], lengths["decoder_input_ids"]))
    streams = [document_ids[i:i + span_corruption.DOCUMENTS_PER_STREAM]
               for i in range(0, len(document_ids), span_corruption.DOCUMENTS_PER_STREAM)]
    assert len(examples) == sum(-(-sum(map(len, stream)) // block) for stream in streams)
    assert len(examples) < sum(-(-len(ids) // block) for ids in document_ids)
    return
  # BART, as fairseq, drops blocks of one token (a document's last sentence, or the end of one cut into
  # blocks): what remains is the documents' tokens in order, a few lone ones short.
  remaining = iter(document_tokens)
  assert all(token in remaining for token in found)  # an in-order subsequence
  assert 0 <= len(document_tokens) - len(found) <= 0.001 * len(document_tokens)
