"""Generated corpora through every objective: each makes well-formed examples or stops with one
`pretrain.train: error:` line, within a time bound, with no traceback and no hang.

In-process and small: one text file rewritten for each generated corpus, read by one task per objective
whose example pipelines are built once (a new iterator reads the file's new bytes). The profile is fixed
(derandomized, a fixed number of cases) so CI runs the same corpora every time."""
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_pipelines import features, input_pipeline, sources, tasks
from pretrain.errors import one_line

CASES = 2  # each case runs five objectives (XLNet tokenizes the corpus again): about 10 s on 2 CPUs
SECONDS = 60  # a bound that only a hang passes: one objective's case takes 1 to 5 s
TEXT_OBJECTIVES = ("bert_mlm_nsp", "albert_mlm_sop", "bart_denoising", "t5_span_corruption")

words = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs", "Cc", "So")), max_size=12)
lines = st.one_of(
    words,
    st.lists(words, max_size=6).map(" ".join),
    st.sampled_from(["", " ", "\t", "...", "!!!", "1234567890", "😀🎉", "中文 text ünïcode", "\x00\x07\x1b"]),
    st.integers(200, 3000).map(lambda n: "word " * n),  # a very long line
).map(lambda text: text.replace("\n", " ").replace("\r", " ").encode("utf-8"))
invalid_utf8 = st.sampled_from([b"\xff\xfe", b"caf\xe9", b"\xc3", b"\xed\xa0\x80 surrogate"])
documents = st.lists(st.one_of(lines, invalid_utf8), min_size=0, max_size=4)
corpora = st.tuples(st.lists(documents, max_size=5), st.integers(1, 3), st.booleans())


def corpus_bytes(corpus) -> bytes:
  """Documents (lists of lines) separated by blank lines; the last document repeated; maybe no final newline."""
  docs, repeats, trailing_newline = corpus
  docs = docs + docs[-1:] * (repeats - 1)
  text = b"\n\n".join(b"\n".join(lines) for lines in docs)
  return text + b"\n" if trailing_newline else text


@pytest.fixture(scope="module")
def readers(tmp_path_factory, demo_paths):
  """Objective -> a function reading the corpus file as that objective's task does: two examples as numpy,
  or NoExamples."""
  path = tmp_path_factory.mktemp("fuzz") / "corpus.txt"
  path.write_bytes(b"Seed text.\nSo that the file exists.\n")
  made = {}
  for objective in (*TEXT_OBJECTIVES, "xlnet_plm"):
    name = tasks.register_task(f"fuzz_{objective}", sources.TextDocumentSource({"train": str(path)}), objective,
                               demo_paths["vocab_model"])
    task, lengths = tasks.get_task_or_mixture(name), dict(features.schema(objective).default_lengths)
    if objective == "xlnet_plm":  # its examples come from token files, made again for each corpus
      made[objective] = (lambda t, lengths: lambda: list(input_pipeline.task_examples(
          t, lengths, "train", say=lambda _: None).take(2).as_numpy_iterator()))(task, lengths)
    else:
      dataset = input_pipeline.task_examples(task, lengths, "train").take(2)

      def read(task=task, dataset=dataset):
        tasks.check_examples(task, "train")
        return list(dataset.as_numpy_iterator())
      made[objective] = read
  return path, made


def assert_well_formed(objective, examples, vocab_size):
  schema = features.schema(objective)
  assert examples, f"{objective}: the check passed but no example came"
  for example in examples:
    for name, value in example.items():
      value = np.asarray(value)
      assert np.isfinite(value.astype(np.float64)).all(), (objective, name)
      if name in schema.token_features(features.INPUT_TOKENS) + schema.token_features(features.TARGET_TOKENS):
        assert value.min() >= 0 and value.max() < vocab_size, (objective, name, value.min(), value.max())


@settings(max_examples=CASES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(corpus=corpora)
def test_every_objective_makes_examples_or_stops_with_one_line(corpus, readers, demo_vocab):
  path, read = readers
  path.write_bytes(corpus_bytes(corpus))
  for objective, read_examples in read.items():
    start = time.monotonic()
    try:
      examples = read_examples()
    except ValueError as error:  # NoExamples, or a file left empty: what pretrain.train prints as one line
      line = f"pretrain.train: error: {one_line(error)}"
      assert "\n" not in str(error) and str(path) in line, line
    else:
      vocab_size = demo_vocab.vocab_size + tasks.OBJECTIVES[objective].extra_ids
      assert_well_formed(objective, examples, vocab_size)
    assert time.monotonic() - start < SECONDS, objective
