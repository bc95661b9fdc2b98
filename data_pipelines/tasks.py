"""The seqio task registry: a source × an objective × a vocabulary, by name.

Names are `<corpus>_<objective>`: `demo_bert_mlm_nsp` (the built-in demo corpus),
`text_bert_mlm_nsp` (the user's TRAIN_FILES), `wikipedia_bert_mlm_nsp` (TFDS), and so on for every
objective in OBJECTIVES. Demo tasks register themselves on first use (building the demo corpus).
Tasks of one objective over several corpora combine into a seqio mixture (`mixture`). The features
each objective emits are stated in `features.SCHEMAS`.
"""
import dataclasses
import functools
import os
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

import seqio
import tensorflow as tf

from data_pipelines import demo_corpus, example_check, features, sources, token_files, vocab
from data_pipelines.objectives import denoising, documents, mlm, nsp_sop, permutation, span_corruption

def _sentence_pair_mlm(vocabulary, *, mode: str, label_key: str, max_ngram: int, whole_word: bool):
  special = vocab.special_ids(vocabulary)
  return [
      seqio.CacheDatasetPlaceholder(),
      functools.partial(nsp_sop.sentence_pairs, mode=mode),
      functools.partial(mlm.masked_pair_features, word_start=vocab.word_start_table(vocabulary),
                        cls_id=special.cls, sep_id=special.sep, mask_id=special.mask,
                        random_token_min=vocab.FIRST_NORMAL_ID, vocab_size=vocabulary.vocab_size, label_key=label_key,
                        max_ngram=max_ngram, whole_word=whole_word),
  ]


def _sentence_pair_lengths(lengths: Mapping[str, int]) -> None:
  """Room in `[CLS] A [SEP] B [SEP]` for A and B, and for masked_positions among them."""
  nsp_sop.pair_budget(lengths["input_ids"])
  mlm.check_pair_lengths(lengths)


def bert_mlm_nsp(vocabulary):
  return _sentence_pair_mlm(vocabulary, mode=nsp_sop.NSP, label_key="nsp_label", max_ngram=1, whole_word=False)


def albert_mlm_sop(vocabulary):
  return _sentence_pair_mlm(vocabulary, mode=nsp_sop.SOP, label_key="sop_label", max_ngram=3, whole_word=True)


def bart_denoising(vocabulary):
  special = vocab.special_ids(vocabulary)
  settings = dict(eos_id=special.eos, mask_id=special.mask, bos_id=special.bos, decoder_start_id=special.eos,
                  vocab_size=vocabulary.vocab_size, word_start=vocab.word_start_table(vocabulary))
  return [seqio.CacheDatasetPlaceholder(), functools.partial(denoising.denoising_blocks, bos_id=settings["bos_id"]),
          functools.partial(denoising.denoising_preprocessor, **settings)]


@seqio.map_over_dataset
@tf.autograph.experimental.do_not_convert  # plain TF ops: autograph's conversion took seconds of each start
def _flatten_sentences(example):
  return {"targets": example["sentences"].flat_values}


def t5_span_corruption(vocabulary):
  special = vocab.special_ids(vocabulary)
  return [seqio.CacheDatasetPlaceholder(), span_corruption.span_corruption_blocks, _flatten_sentences,
          functools.partial(span_corruption.span_corruption_preprocessor, eos_id=special.eos,
                            first_sentinel_id=vocabulary.vocab_size - 1, decoder_start_id=special.pad)]


def _xlnet_lengths(sequence_length: Mapping[str, int]) -> Dict[str, int]:
  """The permutation objective's lengths from TASK_FEATURE_LENGTHS, as `xlnet_plm` describes them."""
  reuse_len = sequence_length["reuse_len"]
  return {"seq_len": sequence_length["input_ids"], "reuse_len": reuse_len, "perm_size": reuse_len,
          "num_predict": sequence_length["target_ids"]}


def xlnet_plm(vocabulary):
  """The task's documents, tokenized: its examples are made from row streams over their token files
  (`xlnet_stream_reading`), not example by example, as every row continues its own text."""
  del vocabulary
  return [seqio.CacheDatasetPlaceholder()]


class StreamReading(NamedTuple):
  """How an objective reads row streams: windows of `window_len` tokens, `step_len` tokens further at
  each step, each made into an example by `example(window, other, backward, seed)` (`row_streams`)."""
  window_len: int
  step_len: int
  example: Callable


def xlnet_stream_reading(vocabulary, sequence_length: Mapping[str, int]) -> StreamReading:
  """xlnet_plm from row streams. Lengths from TASK_FEATURE_LENGTHS: input_ids (the window), reuse_len
  (the part that continues the previous window, which the model caches), target_ids (predictions).
  Each step moves reuse_len tokens on, so the next window's reuse part is this one's A. Permutations
  stay within reuse_len-sized blocks (perm_size = reuse_len, as in the paper: 256 of 512)."""
  special = vocab.special_ids(vocabulary)
  lengths = _xlnet_lengths(sequence_length)
  example = permutation.window_examples(**lengths, word_start=vocab.word_start_table(vocabulary),
                                        sep_id=special.sep, cls_id=special.cls)
  return StreamReading(permutation.window_length(lengths["seq_len"], lengths["reuse_len"]), lengths["reuse_len"],
                       example)


# What the documents must hold for each objective to make an example (example_check).
_PAIRS = example_check.Requirement(
    lambda documents: documents.most_sentences >= 2 or len(documents.distinct) >= 2,
    "a document of 2 sentences, or a second, different document to take a one-sentence document's segment B from")
_ANY_TOKEN = example_check.Requirement(lambda documents: documents.count >= 1, "a document of at least 1 token")


@dataclasses.dataclass(frozen=True)
class Objective:
  preprocessors: Callable[[seqio.Vocabulary], List]  # applied after tokenization
  # Raises ValueError for TASK_FEATURE_LENGTHS the preprocessors would refuse: the objectives' own checks.
  check_lengths: Callable[[Mapping[str, int]], None]
  requirement: example_check.Requirement
  extra_ids: int = 0  # sentinel pieces appended to the vocabulary (T5)
  # Consecutive examples continue one text stream (XLNet's memory): never shuffled or mixed. Training
  # reads them from token files as row streams: (vocabulary, lengths) -> StreamReading.
  stream_reading: Optional[Callable] = None


OBJECTIVES: Dict[str, Objective] = {
    "bert_mlm_nsp": Objective(bert_mlm_nsp, _sentence_pair_lengths, _PAIRS),
    "albert_mlm_sop": Objective(albert_mlm_sop, _sentence_pair_lengths, _PAIRS),
    "bart_denoising": Objective(bart_denoising, lambda lengths: denoising.chunk_length(  # BART adds bos
        lengths["encoder_input_ids"], lengths["decoder_input_ids"], bos_id=vocab.BOS_ID),
        example_check.Requirement(lambda documents: documents.most_tokens >= denoising.MIN_BLOCK_TOKENS,
                                  f"a document of {denoising.MIN_BLOCK_TOKENS} tokens (fairseq's BART drops "
                                  "shorter ones)")),
    "t5_span_corruption": Objective(t5_span_corruption, lambda lengths: span_corruption.max_tokens_for_lengths(
        lengths["encoder_input_ids"], lengths["decoder_input_ids"]), _ANY_TOKEN, extra_ids=100),
    "xlnet_plm": Objective(xlnet_plm, lambda lengths: permutation.check_lengths(**_xlnet_lengths(lengths)),
                           _ANY_TOKEN, stream_reading=xlnet_stream_reading),
}


def check_lengths(objective: str, lengths: Mapping[str, int]) -> None:
  """Refuses TASK_FEATURE_LENGTHS the objective cannot make examples of, before any data is read."""
  features.schema(objective).check_lengths(objective, lengths)
  try:
    OBJECTIVES[objective].check_lengths(lengths)
  except ValueError as e:
    raise ValueError(f"TASK_FEATURE_LENGTHS={dict(lengths)} do not fit the {objective} objective: {e}") from e


# Examples shuffled after the objective, per data shard. The buffer fills before the first batch, at every
# start and resume, and each checkpoint's data position holds its contents: 10,000 took 25 s of a tiny run's
# start. 1,000 is seqio's default; BERT's reference shuffled 100 examples, after interleaving shuffled files.
# $POD_PRETRAIN_SHUFFLE_BUFFER sets another size (the test suite uses the reference's 100).
EXAMPLE_SHUFFLE_BUFFER = 1_000
SHUFFLE_BUFFER_VARIABLE = "POD_PRETRAIN_SHUFFLE_BUFFER"


def example_shuffle_buffer() -> int:
  """Examples in each data shard's shuffle buffer: $POD_PRETRAIN_SHUFFLE_BUFFER, else EXAMPLE_SHUFFLE_BUFFER."""
  value = os.environ.get(SHUFFLE_BUFFER_VARIABLE, "").strip()
  if not value:
    return EXAMPLE_SHUFFLE_BUFFER
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"{SHUFFLE_BUFFER_VARIABLE}={value!r}: expected a whole number of examples, 1 or more")
  return int(value)

_OBJECTIVE_OF: Dict[str, str] = {}  # registered task name -> its objective
_TOKEN_DIRS: Dict[str, Optional[str]] = {}  # registered task name -> its TOKEN_DIR (None: tokenized into the cache)


def register_task(name: str, source: seqio.DataSource, objective: str, vocab_model: str,
                  extra_preprocessors=(), token_dir: Optional[str] = None) -> str:
  """Registers (or replaces) `name`: source documents -> tokenized sentences -> objective. `token_dir`:
  where `python -m data_pipelines.tokenize` wrote the source's token files (objectives that read streams)."""
  if objective not in OBJECTIVES:
    raise ValueError(f"objective={objective!r}: expected one of {sorted(OBJECTIVES)}")
  spec = OBJECTIVES[objective]
  vocabulary = vocab.load_vocabulary(vocab_model, extra_ids=spec.extra_ids)
  token_features = features.schema(objective).token_features(features.INPUT_TOKENS)
  _OBJECTIVE_OF[name], _TOKEN_DIRS[name] = objective, token_dir
  seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name,
      source=source,
      preprocessors=[*extra_preprocessors, documents.tokenize_sentences, *spec.preprocessors(vocabulary)],
      output_features={feature: seqio.Feature(vocabulary, add_eos=False) for feature in token_features},
      shuffle_buffer_size=None if spec.stream_reading else example_shuffle_buffer(),
  )
  return name


def check_examples(task_or_mixture, split: str, shard_info: Optional[seqio.ShardInfo] = None,
                   seconds: float = example_check.FIRST_EXAMPLE_SECONDS) -> None:
  """Raises example_check.NoExamples if a task (any task of a mixture) makes no example of `split`'s text,
  or of one data shard of it."""
  objective = objective_of(task_or_mixture)
  for task in seqio.get_subtasks(task_or_mixture):
    example_check.check(task, split, objective, OBJECTIVES[objective].requirement, shard_info, seconds)


def token_file(task: seqio.Task, split: str, say=print) -> token_files.TokenFile:
  """The token file of a stream task's split: in its TOKEN_DIR, else tokenized once into the cache."""
  tokens = token_files.open_split(_TOKEN_DIRS.get(task.name), task, split,
                                  os.path.join(demo_corpus.cache_root(), "tokens"), say=say)
  expected = vocabulary(task).vocab_size
  if tokens.info["vocab_size"] != expected:
    raise ValueError(f"TOKEN_DIR: {tokens.directory} was tokenized with a vocabulary of {tokens.info['vocab_size']} "
                     f"pieces ({tokens.info['vocab_model']}), this run's has {expected} (VOCAB_MODEL): tokenize the "
                     "corpus again with this run's vocabulary")
  return tokens


def stream_reading(task: seqio.Task, sequence_length: Mapping[str, int]) -> StreamReading:
  """How a stream task's objective reads row streams at these lengths."""
  return OBJECTIVES[_OBJECTIVE_OF[task.name]].stream_reading(vocabulary(task), sequence_length)


def register_demo_tasks() -> None:
  paths = demo_corpus.ensure_demo_corpus()
  source = sources.TextDocumentSource({"train": paths["train"], "validation": paths["validation"]})
  for objective in OBJECTIVES:
    register_task(f"demo_{objective}", source, objective, paths["vocab_model"])


def text_task(objective: str, train_files: Optional[str] = None, validation_files: Optional[str] = None,
              vocab_model: Optional[str] = None, corpus: str = "text", token_dir: Optional[str] = None) -> str:
  """The task `<corpus>_<objective>` over TRAIN_FILES (None: the demo corpus and its vocabulary)."""
  if train_files is None and vocab_model is None and validation_files is None and token_dir is None:
    return f"demo_{objective}"
  for setting, value in (("VOCAB_MODEL", vocab_model), ("TOKEN_DIR", token_dir)):
    if train_files is None and value is not None:  # most likely a forgotten setting, not a wish for demo text
      raise ValueError(f"{setting}={value!r} is set but the {corpus!r} corpus has no train files (TRAIN_FILES); "
                       "the demo corpus comes with its own vocabulary and token files")
  demo = demo_corpus.ensure_demo_corpus() if train_files is None or vocab_model is None else {}
  splits = {"train": train_files or demo["train"]}
  if validation_files or train_files is None:  # the demo text comes with its held-out split
    splits["validation"] = validation_files or demo["validation"]
  source = sources.TextDocumentSource(splits)
  return register_task(f"{corpus}_{objective}", source, objective, vocab_model or demo["vocab_model"],
                       token_dir=token_dir)


def tfds_task(objective: str, tfds_name: str, vocab_model: str, data_dir: Optional[str] = None,
              text_key: str = "text", splits: Optional[Dict[str, str]] = None, token_dir: Optional[str] = None) -> str:
  """A task over a TFDS dataset such as 'wikipedia/20230601.en:1.0.0' (local or gs:// data_dir)."""
  if vocab_model is None:
    raise ValueError(f"VOCAB_MODEL is not set: the TFDS task {tfds_name!r} needs the sentencepiece model of its text")
  corpus = tfds_name.split("/")[0].split(":")[0]
  source = sources.tfds_source(tfds_name, splits=splits, data_dir=data_dir)
  return register_task(f"{corpus}_{objective}", source, objective, vocab_model,
                       extra_preprocessors=[functools.partial(sources.tfds_to_documents, text_key=text_key)],
                       token_dir=token_dir)


def mixture(name: str, task_names: Sequence[str], rates: Optional[Sequence[float]] = None) -> str:
  """Registers (or replaces) mixture `name`: each example comes from task i with probability
  rates[i] / sum(rates) (default: equal rates). The tasks share one objective and vocabulary."""
  rates = [1.0] * len(task_names) if rates is None else list(rates)
  if not task_names or len(rates) != len(task_names) or min(rates) <= 0:
    raise ValueError(f"mixture {name!r}: expected one positive rate per task, got tasks {list(task_names)} "
                     f"and rates {rates}")
  for task_name in task_names:
    get_task_or_mixture(task_name)  # an unknown name fails here, listing the known ones
  seqio.MixtureRegistry.remove(name)
  seqio.MixtureRegistry.add(name, list(zip(task_names, rates)))
  return name


def continues_across_examples(task_or_mixture) -> bool:
  """Whether consecutive examples continue one text stream (XLNet), so must not be shuffled or mixed."""
  return any(task.shuffle_buffer_size is None for task in seqio.get_subtasks(task_or_mixture))


def get_dataset(task_or_mixture, sequence_length: Dict[str, int], features: Optional[Sequence[str]] = None,
                **kwargs):
  """The examples of a task or mixture with every feature its objective emits.

  A seqio mixture keeps only its output features (the token inputs, not the objective's targets
  and labels) unless told which others pass through: `features`, by default those of the first
  task's examples. `kwargs` go to seqio's get_dataset (split, shuffle, seed, shard_info, ...).
  """
  if not isinstance(task_or_mixture, seqio.Mixture):
    return task_or_mixture.get_dataset(sequence_length, **kwargs)
  if features is None:
    features = seqio.get_subtasks(task_or_mixture)[0].get_dataset(sequence_length, **kwargs).element_spec
  return task_or_mixture.get_dataset(sequence_length, passthrough_features=list(features), **kwargs)


def objective_of(task_or_mixture) -> str:
  """The objective whose examples a task (or every task of a mixture) makes."""
  found = {_OBJECTIVE_OF.get(task.name) for task in seqio.get_subtasks(task_or_mixture)}
  if len(found) != 1 or None in found:
    raise ValueError(f"{task_or_mixture.name!r} is not made of tasks of one objective of {sorted(OBJECTIVES)}")
  return found.pop()


def vocabulary(task_or_mixture) -> seqio.Vocabulary:
  """The vocabulary of a task's (or mixture's) token features."""
  return next(iter(task_or_mixture.output_features.values())).vocabulary


def get_task_or_mixture(name: str):
  """Looks up a registered task or mixture; demo tasks are registered on first use."""
  if name.startswith("demo_") and name not in seqio.TaskRegistry.names():
    register_demo_tasks()
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError:
    known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
    demo = [f"demo_{o}" for o in OBJECTIVES]
    raise ValueError(f"unknown task or mixture {name!r}; registered: {known or demo}") from None
