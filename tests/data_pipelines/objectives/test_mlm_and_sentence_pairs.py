"""BERT/ALBERT objectives: MLM masking statistics, pair truncation against the reference, NSP and SOP
through seqio on the demo corpus and on tiny corpora whose sentences say where they come from.

Tolerances: a rate measured over N independent trials may miss by Z = 4.5 standard errors of a
binomial, sqrt(p (1 - p) / N): a false alarm about once in 150,000 checks.
"""
import json
import math
import random
import re

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_rate, map_examples, restored, run_here, seeds
from data_pipelines import sources, tasks
from data_pipelines.objectives import mlm, nsp_sop

CLS, SEP, MASK, FIRST_NORMAL = 4, 5, 6, 7
LENGTHS = {"input_ids": 128, "masked_positions": 20}


# ----------------------------------------------------------------------------- MLM on synthetic tokens

VOCAB = 20  # tiny, so a random replacement equal to the original (1 in 13) is measurable
MAX_PREDICTIONS = 20


def synthetic_examples(num, seed_salt=0):
  """Token rows of random lengths: [CLS] first, ~10% [SEP] elsewhere, normal ids in [7, VOCAB);
  about half the pieces start a word."""
  rng = np.random.default_rng(seed_salt)
  lengths = rng.integers(8, 161, size=num)
  ids = rng.integers(FIRST_NORMAL, VOCAB, size=(num, 160))
  ids[rng.random(ids.shape) < 0.1] = SEP
  ids[:, 0] = CLS
  return {"ids": ids.astype(np.int32), "word_start": rng.random(ids.shape) < 0.5,
          "length": lengths.astype(np.int32), "seed": seeds(num, seed_salt)}


def masked(element, **kwargs):
  ids = element["ids"][:element["length"]]
  kwargs = {"max_predictions": MAX_PREDICTIONS, "mask_id": MASK, "random_token_min": FIRST_NORMAL,
            "vocab_size": VOCAB, **kwargs}
  return mlm.mask_tokens(ids, ids >= FIRST_NORMAL, element["word_start"][:element["length"]], element["seed"],
                         **kwargs)


def budgets(length):
  """Acceptable target counts: round(0.15 n) with either rounding of ties, clipped to [1, max]."""
  return {min(MAX_PREDICTIONS, max(1, r)) for r in (math.floor(0.15 * length + 0.5), math.ceil(0.15 * length - 0.5))}


def chosen_positions(out):
  count = int(out["masked_weights"].sum())
  assert np.all(out["masked_weights"][:count] == 1) and np.all(out["masked_weights"][count:] == 0)
  assert np.all(out["masked_positions"][count:] == 0) and np.all(out["masked_ids"][count:] == 0)
  return out["masked_positions"][:count]


@pytest.fixture(scope="module")
def bert_masking():
  elements = synthetic_examples(3000)
  return elements, map_examples(masked, elements)


def test_mask_tokens_meets_budget_and_never_touches_specials(bert_masking):
  elements, outputs = bert_masking
  for ids, length, out in zip(elements["ids"], elements["length"], outputs):
    original = ids[:length]
    positions = chosen_positions(out)
    assert np.all(np.diff(positions) > 0), "positions sorted and distinct"
    maskable = int((original >= FIRST_NORMAL).sum())
    # With one-piece units the top-up always fills the budget exactly (unless too few are maskable).
    assert len(positions) in {min(b, maskable) for b in budgets(length)}, (length, len(positions))
    assert np.all(original[positions] >= FIRST_NORMAL), "a special token was chosen"
    np.testing.assert_array_equal(out["masked_ids"][:len(positions)], original[positions])
    untouched = np.ones(length, bool)
    untouched[positions] = False
    np.testing.assert_array_equal(out["input_ids"][untouched], original[untouched])
  long_rows = elements["length"] >= 140  # 0.15 * 140 = 21 > max_predictions
  assert long_rows.any() and all(out["masked_weights"].sum() == MAX_PREDICTIONS
                                 for out, is_long in zip(outputs, long_rows) if is_long)


def test_mask_tokens_replaces_80_10_10(bert_masking):
  elements, outputs = bert_masking
  before, after = [], []
  for ids, out in zip(elements["ids"], outputs):
    positions = chosen_positions(out)
    before.append(ids[positions])
    after.append(out["input_ids"][positions])
  before, after = np.concatenate(before), np.concatenate(after)
  trials = len(before)
  is_mask = after == MASK
  # The random 10% draws uniformly from [7, VOCAB): 13 ids, one of which is the original itself.
  coincide = 1 / (VOCAB - FIRST_NORMAL)
  assert_rate(is_mask.sum(), trials, 0.8, "[MASK]")
  assert_rate(((after != before) & ~is_mask).sum(), trials, 0.1 * (1 - coincide), "random token")
  assert_rate((after == before).sum(), trials, 0.1 + 0.1 * coincide, "unchanged")
  replaced = after[(after != before) & ~is_mask]
  assert set(replaced.tolist()) == set(range(FIRST_NORMAL, VOCAB)), "random ids cover exactly [7, VOCAB)"


def words_of(maskable, word_start):
  """Word index per maskable piece: a word starts at a word-start piece or after a non-maskable one."""
  starts = maskable & (word_start | ~np.concatenate([[False], maskable[:-1]]))
  return np.where(maskable, np.cumsum(starts) - 1, -1)


def test_whole_word_masking_never_splits_a_word_and_fills_the_budget():
  elements = synthetic_examples(1500, seed_salt=1)
  outputs = map_examples(lambda e: masked(e, max_ngram=3, whole_word=True), elements)
  filled = 0
  for ids, starts, length, out in zip(elements["ids"], elements["word_start"], elements["length"], outputs):
    maskable = ids[:length] >= FIRST_NORMAL
    word = words_of(maskable, starts[:length])
    chosen = np.zeros(length, bool)
    chosen[chosen_positions(out)] = True
    for w in np.unique(word[chosen]):
      assert w >= 0 and chosen[word == w].all(), f"word {w} split: {chosen[word == w]}"
    assert chosen.sum() <= max(budgets(length))
    # Units that do not fit are skipped, not a stop: with >= budget one-piece words the budget fills.
    if (np.bincount(word[maskable]) == 1).sum() >= max(budgets(length)):
      assert chosen.sum() in budgets(length), (chosen.sum(), budgets(length))
      filled += 1
  assert filled > 1000  # the fill check above ran on most rows


def test_ngram_lengths_follow_one_over_n():
  """n-grams are consecutive runs of units with P(n) ∝ 1/n: p = (6, 3, 2) / 11 for max_ngram=3.

  The final mask merges n-grams and top-ups, so measure with a budget of 3 tokens over 2000
  one-piece units: the first n-gram in random order always fits. If it is a 3-gram the mask is one
  run of 3. A 2-gram is followed by one single (a 1-gram, or a top-up): max run 2. A 1-gram leaves 2
  tokens: the next n-gram (length ~ p again) is taken only if it is a 1- or 2-gram, anything else
  is topped up with singles. So P(max run = 3) = p3, P(2) = p2 + p1 p2, P(1) = p1 (1 - p2); runs
  merging by adjacency change this by about 2 / (number of n-grams) ~ 0.002, far below tolerance.
  """
  p1, p2, p3 = 6 / 11, 3 / 11, 2 / 11
  num = 4000
  outputs = map_examples(lambda seed: mlm.choose_masked_positions(tf.ones([2000], tf.bool), tf.ones([2000], tf.bool),
                                                                  tf.constant(3), seed, max_ngram=3), seeds(num, 7))
  longest = []
  for chosen in outputs:
    assert chosen.sum() == 3
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], chosen.astype(int), [0]]))))[::2]
    longest.append(runs.max())
  longest = np.array(longest)
  for run, rate in ((3, p3), (2, p2 + p1 * p2), (1, p1 * (1 - p2))):
    assert_rate((longest == run).sum(), num, rate, f"longest run {run}")


def test_masking_is_deterministic_per_seed():
  elements = synthetic_examples(50, seed_salt=2)
  first, again = map_examples(masked, elements), map_examples(masked, elements)
  other_seeds = dict(elements, seed=elements["seed"] + [0, 1])
  other = map_examples(masked, other_seeds)
  for a, b in zip(first, again):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
  assert sum(not np.array_equal(a["masked_positions"], c["masked_positions"]) for a, c in zip(first, other)) > 40


# ----------------------------------------------------------------------------- truncation

def reference_truncated_lengths(len_a, len_b, max_num_tokens, rng):
  """BERT's truncate_seq_pair, run on lists: trim the longer (b on ties) from a random end."""
  a, b = list(range(len_a)), list(range(len_b))
  while len(a) + len(b) > max_num_tokens:
    longer = a if len(a) > len(b) else b
    if rng.random() < 0.5:
      del longer[0]
    else:
      longer.pop()
  return len(a), len(b)


def test_truncate_pair_matches_reference_lengths_and_trims_both_ends():
  rng = np.random.default_rng(3)
  num = 2000
  len_a, len_b = rng.integers(0, 90, num), rng.integers(0, 90, num)
  limits = rng.integers(1, 120, num)
  elements = {"len_a": len_a.astype(np.int32), "len_b": len_b.astype(np.int32), "limit": limits.astype(np.int32),
              "seed": seeds(num, 3)}
  # a holds 1000 + position, b 5000 + position: every kept token tells where it was.
  outputs = map_examples(lambda e: nsp_sop.truncate_pair(1000 + tf.range(e["len_a"]), 5000 + tf.range(e["len_b"]),
                                                         e["limit"], e["seed"]), elements)
  python_rng = random.Random(0)
  front_cuts = total_cuts = 0
  for (a, b), la, lb, limit in zip(outputs, len_a, len_b, limits):
    assert (len(a), len(b)) == reference_truncated_lengths(la, lb, limit, python_rng)
    assert len(a) + len(b) <= limit
    for kept, offset, full in ((a, 1000, la), (b, 5000, lb)):
      if len(kept):  # an emptied segment does not tell which end its tokens left from
        start = kept[0] - offset
        np.testing.assert_array_equal(kept, offset + start + np.arange(len(kept)))  # one contiguous slice
        front_cuts += start
        total_cuts += full - len(kept)
  # Each removed token comes from the front with probability 1/2: Binomial(total_cuts, 1/2).
  assert total_cuts > 10_000
  assert_rate(front_cuts, total_cuts, 0.5, "tokens cut from the front")


# ----------------------------------------------------------------------------- pairs through seqio

def split_pair(example):
  """(tokens A, tokens B) of a `[CLS] A [SEP] B [SEP] pad...` example, after checking that layout."""
  ids, segments = example["input_ids"], example["segment_ids"]
  assert ids[0] == CLS and (ids == CLS).sum() == 1
  first_sep, second_sep = np.flatnonzero(ids == SEP)  # exactly two
  length = second_sep + 1
  assert np.all(ids[length:] == 0) and np.all(ids[:length] != 0), "padding only after the second [SEP]"
  expected_segments = np.zeros_like(segments)
  expected_segments[first_sep + 1:length] = 1
  np.testing.assert_array_equal(segments, expected_segments)
  real = example["masked_weights"] > 0
  positions = example["masked_positions"][real]
  assert np.all((positions > 0) & (positions < length)) and not np.isin(positions, [first_sep, second_sep]).any()
  original = restored(example)
  return original[1:first_sep], original[first_sep + 1:second_sep]


def take(task_name, num, seed=1):
  """Unshuffled (seqio's 10,000-example shuffle buffer would dominate the run time); the objective's
  randomness still comes from `seed`."""
  task = tasks.get_task_or_mixture(task_name)
  dataset = task.get_dataset(LENGTHS, split="train", seed=seed, shuffle=False, num_epochs=None)
  return list(dataset.take(num).as_numpy_iterator())


def test_nsp_demo_examples_are_well_formed_corpus_text(demo_paths, demo_vocab):
  examples = take("demo_bert_mlm_nsp", 300)
  processor = demo_vocab.tokenizer
  with open(demo_paths["train"], encoding="utf-8") as f:
    corpus = " ".join(processor.decode_ids(processor.encode_as_ids(line.strip())) for line in f if line.strip())
  continuations = 0
  for example in examples:
    assert example["input_ids"].shape == (128,) and example["segment_ids"].shape == (128,)
    assert all(example[k].shape == (20,) for k in ("masked_positions", "masked_ids", "masked_weights"))
    assert example["nsp_label"] in (0, 1)
    a, b = split_pair(example)
    # The restored tokens (masked_ids put back) decode to corpus text: masked_ids are the originals.
    assert processor.decode_ids(a.tolist()) in corpus and processor.decode_ids(b.tolist()) in corpus
    if example["nsp_label"] == 0 and len(a) + len(b) < 125:  # untruncated: B continues A verbatim
      assert processor.decode_ids(np.concatenate([a, b]).tolist()) in corpus
      continuations += 1
  assert continuations > 30


def test_same_seed_same_examples(demo_paths):
  first, again, other = (take("demo_bert_mlm_nsp", 5, seed=s) for s in (4, 4, 5))
  for a, b in zip(first, again):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
  assert any(not np.array_equal(a["input_ids"], c["input_ids"]) for a, c in zip(first, other))


SENTENCE = re.compile(r"Document (\d+) sentence (\d+) is here\.")


def write_corpus(directory, sentence_counts):
  """Document d's sentence s reads `Document d sentence s is here.`"""
  directory.mkdir(parents=True, exist_ok=True)
  docs = ["\n".join(f"Document {d} sentence {s} is here." for s in range(n)) for d, n in enumerate(sentence_counts)]
  (directory / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
  return str(directory / "*.txt")


def parse_sentences(tokens, processor):
  """[(doc, sentence)] of a segment, after checking the segment is nothing but whole sentences."""
  text = processor.decode_ids(tokens.tolist())
  found = [(int(d), int(s)) for d, s in SENTENCE.findall(text)]
  assert text == " ".join(f"Document {d} sentence {s} is here." for d, s in found), text
  return found


def consecutive(sentences):
  return len({d for d, _ in sentences}) == 1 and all(s2 == s1 + 1 for (_, s1), (_, s2) in zip(sentences, sentences[1:]))


def sentence_pairs(name, objective, corpus_glob, vocab_model, processor, label_key, num):
  tasks.register_task(name, sources.TextDocumentSource({"train": corpus_glob}), objective, vocab_model)
  pairs = []
  for example in take(name, num):
    a, b = split_pair(example)
    pairs.append((int(example[label_key]), parse_sentences(a, processor), parse_sentences(b, processor)))
  return pairs


@pytest.mark.parametrize("shape", ["two_sentences", "one_to_five_sentences"])
def test_nsp_labels_are_balanced_and_mean_what_they_say(shape, tmp_path, demo_paths, demo_vocab):
  """Label 1 with p = 0.5 per chunk of 2 sentences or more. The only other source of label 1: with a
  short target (short_seq_prob 0.1 × P(target <= 13 tokens, one sentence) = 12/124) every sentence but
  the last is a forced random-next pair, which raises the rate by ~0.005 (two sentences) to ~0.01
  (1-5), inside the tolerance (~0.05). A one-sentence document makes a random-next pair, as the
  reference does. 200-300 documents, so the shuffled stream often hands a document itself back: that
  must never become a random B."""
  rng = np.random.default_rng(5)
  counts = [2] * 200 if shape == "two_sentences" else rng.integers(1, 6, size=300).tolist()
  single = {d for d, n in enumerate(counts) if n == 1}
  pairs = sentence_pairs(f"test_nsp_{shape}", "bert_mlm_nsp", write_corpus(tmp_path, counts),
                         demo_paths["vocab_model"], demo_vocab.tokenizer, "nsp_label", 2000)
  labels = np.array([label for label, a, _ in pairs if a[0][0] not in single])
  assert_rate(labels.sum(), len(labels), 0.5, "nsp_label = 1")
  assert shape == "two_sentences" or len(labels) < len(pairs), "one-sentence documents make pairs too"
  for label, a, b in pairs:
    assert consecutive(a) and consecutive(b), f"segments are runs of one document's sentences: {a} {b}"
    if label == 0:
      assert a[0][0] not in single and consecutive(a + b), f"label 0 but B does not continue A: {a} {b}"
    else:
      assert b[0][0] != a[0][0], f"label 1 but B is from A's own document: {a} {b}"


def test_sop_labels_are_balanced_and_swap_consecutive_segments(tmp_path, demo_paths, demo_vocab):
  """As ALBERT's reference: a one-sentence chunk (a one-sentence document, or a sentence that fills a
  short target alone) has no order to swap, so its B comes from another document, label 1."""
  counts = np.random.default_rng(6).integers(1, 6, size=300).tolist()
  single = {d for d, n in enumerate(counts) if n == 1}
  pairs = sentence_pairs("test_sop", "albert_mlm_sop", write_corpus(tmp_path, counts), demo_paths["vocab_model"],
                         demo_vocab.tokenizer, "sop_label", 2000)
  labels = np.array([label for label, a, _ in pairs if a[0][0] not in single])
  assert_rate(labels.sum(), len(labels), 0.5, "sop_label = 1")
  assert len(labels) < len(pairs), "one-sentence documents make pairs too"
  for label, a, b in pairs:
    assert consecutive(a) and consecutive(b), f"segments are runs of one document's sentences: {a} {b}"
    if a[0][0] in single:
      assert label == 1 and b[0][0] != a[0][0], f"a one-sentence document's B comes from another: {a} {b}"
    elif b[0][0] != a[0][0]:  # a sentence that fills a short target alone
      assert label == 1 and len(a) == 1, f"B from another document: label 1, after a lone sentence: {a} {b}"
    else:
      assert a[0][0] == b[0][0] and consecutive(b + a if label == 1 else a + b), f"label {label}: {a} {b}"


def test_preview_writes_jsonl_with_every_feature():
  result = run_here("data_pipelines.preview", "--task=demo_bert_mlm_nsp", "--num_examples=3", "--format=jsonl",
                    "--seed=2")
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in result.stdout.splitlines()]
  assert len(rows) == 3
  for row in rows:
    assert set(row) == {"input_ids", "segment_ids", "masked_positions", "masked_ids", "masked_weights", "nsp_label"}
    assert len(row["input_ids"]) == 128 and len(row["masked_ids"]) == 20 and row["input_ids"][0] == CLS
    assert all(isinstance(v, int) for v in row["input_ids"]) and row["nsp_label"] in (0, 1)
