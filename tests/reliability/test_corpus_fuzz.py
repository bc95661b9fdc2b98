"""Generated corpora through every objective: each makes well-formed examples on which a tiny model of the
objective's family takes a training step with a finite loss, or stops with one `pretrain.train: error:` line,
within a time bound, with no traceback and no hang.

In-process and small: one text file rewritten for each generated corpus, read by one task per objective
whose example pipelines are built once (a new iterator reads the file's new bytes), and one compiled first
training step per model (BART's serves BART denoising and T5). The profile is fixed (derandomized, a fixed
number of cases) so CI runs the same corpora every time."""
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_pipelines import features, input_pipeline, sources, tasks
from pretrain.errors import one_line

CASES = 3  # each case runs five objectives (XLNet tokenizes the corpus again): about 60 s in all on 2 CPUs
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
    task, lengths = tasks.get_task_or_mixture(name), lengths_of(objective)
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


def tiny_families():
  """Objective -> a one-layer model of the family that trains on it (vocabulary size from the data)."""
  from models.albert import AlbertConfig
  from models.bart import BartConfig
  from models.bert import BertConfig
  from models.xlnet import XLNetConfig
  from pretrain.families.albert import AlbertFamily
  from pretrain.families.bart import BartFamily
  from pretrain.families.bert import BertFamily
  from pretrain.families.xlnet import XLNetFamily
  bert = BertConfig(vocab_size=None, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32)
  albert = AlbertConfig(vocab_size=None, embedding_size=8, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32)
  bart = BartFamily(BartConfig(vocab_size=None, d_model=16, encoder_layers=1, decoder_layers=1, num_heads=2,
                               ffn_dim=32))
  xlnet = XLNetConfig(vocab_size=None, d_model=16, n_layer=1, n_head=2, d_head=8, d_inner=32, mem_len=16)
  return {"bert_mlm_nsp": BertFamily(bert), "albert_mlm_sop": AlbertFamily(albert), "bart_denoising": bart,
          "t5_span_corruption": bart, "xlnet_plm": XLNetFamily(xlnet)}


def lengths_of(objective) -> dict:
  """The lengths an objective's examples are read at: its small defaults, T5's at BART's (one BART model
  trains on both)."""
  return dict(features.schema("bart_denoising" if objective == "t5_span_corruption" else objective).default_lengths)


@pytest.fixture(scope="module")
def train_steps(demo_vocab):
  """Objective -> a function taking a batch of its examples one training step from fresh weights, returning
  the step's metrics: one program per model (initialisation and step compiled together)."""
  import jax

  from pretrain import optimizers, partitioning, steps
  mesh = partitioning.make_mesh({"data": 1})
  vocab_size = demo_vocab.vocab_size + max(o.extra_ids for o in tasks.OBJECTIVES.values())  # room for T5's sentinels
  schedule = lambda step: 1e-3
  programs, made = {}, {}
  for objective, family in tiny_families().items():
    lengths = lengths_of(objective)
    key = (family, tuple(sorted(lengths.items())))
    if key not in programs:
      setup = steps.make_setup(family.fit_to_data(vocab_size, objective, lengths), lengths, 2, mesh,
                               optimizers.make_optimizer(schedule), schedule)
      programs[key] = jax.jit(lambda batch, setup=setup: steps.train_step(
          setup, setup.init_state(jax.random.PRNGKey(0)), batch)[1])

    def first_step(batch, program=programs[key]):
      with partitioning.tracing_context(mesh, partitioning.AXIS_RULES):
        return jax.device_get(program(partitioning.global_batch(batch, mesh)))
    made[objective] = first_step
  return made


def as_batch(objective, examples) -> dict:
  """Two rows of the model's features (the one example twice where the corpus made one)."""
  rows = (examples * 2)[:2]
  return {name: np.stack([np.asarray(row[name]) for row in rows]) for name in features.schema(objective).features}


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
def test_every_objective_trains_on_its_examples_or_stops_with_one_line(corpus, readers, train_steps, demo_vocab):
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
      metrics = train_steps[objective](as_batch(objective, examples))
      assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]), (objective, metrics)
      assert metrics["skipped_steps"] == 0, (objective, metrics)
    assert time.monotonic() - start < SECONDS, objective
