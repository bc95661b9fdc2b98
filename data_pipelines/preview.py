"""Prints a task's examples as the model sees them: after the objective, at fixed lengths.

  python -m data_pipelines.preview --task=demo_bert_mlm_nsp --num_examples=2
  python -m data_pipelines.preview --task=demo_albert_mlm_sop --format=jsonl \\
      --feature_lengths=input_ids=512,masked_positions=76

text: every feature's ids, plus the decoded text of token features (targets such as masked_ids
piece by piece); 2-D features (XLNet's perm_mask, target_mapping) as shape and number of ones.
jsonl: one JSON object per example, every feature as a number or (nested) list of numbers.
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import json
import sys
from typing import Dict, Optional

import numpy as np
from absl import flags

from data_pipelines import features, input_pipeline, tasks

FLAGS = flags.FLAGS
flags.DEFINE_string("task", None, "Registered task or mixture, e.g. demo_bert_mlm_nsp.")
flags.DEFINE_string("split", "train", "Dataset split.")
flags.DEFINE_integer("num_examples", 3, "How many examples to print; -1: all of the split.", lower_bound=-1)
flags.DEFINE_enum("format", "text", ["text", "jsonl"], "Output format.")
flags.DEFINE_integer("seed", 0, "Seed of the objective's randomness (pairing, masking).")
flags.DEFINE_string("feature_lengths", None, "NAME=LENGTH,... (default: small lengths for the task's objective).")


def parse_feature_lengths(text: str) -> Dict[str, int]:
  lengths = {}
  for item in text.split(","):
    name, _, value = item.partition("=")
    if not name.strip() or not value.strip().isdigit():
      raise ValueError(f"--feature_lengths={text!r}: expected NAME=LENGTH,... e.g. input_ids=128,masked_positions=20")
    lengths[name.strip()] = int(value)
  return lengths


def describe(name: str, value: np.ndarray, vocabulary, schema: features.Schema) -> str:
  """One feature as text lines; trailing zeros (padding) are counted rather than printed."""
  header = f"  {name} {value.dtype}{list(value.shape)}:"
  if value.ndim >= 2:  # e.g. perm_mask [length, length]: too big to print usefully
    return f"{header} {value.ndim}-D, {int(np.count_nonzero(value == 1))} ones"
  if value.ndim == 0:
    return f"{header} {value.item()}"
  kept = np.trim_zeros(value, "b")
  padding = f" + {value.size - kept.size} zeros" if kept.size < value.size else ""
  lines = [f"{header} {kept.tolist()}{padding}"]
  if name in schema.token_features(features.INPUT_TOKENS):
    # The tokenizer itself, not vocabulary.decode: that stops at the first eos (BART's decoder starts with one).
    lines.append(f"    text: {vocabulary.tokenizer.decode_ids(kept.tolist())!r}")
  elif name in schema.token_features(features.TARGET_TOKENS):
    lines.append(f"    pieces: {[vocabulary.tokenizer.id_to_piece(i) for i in kept.tolist()]}")
  return "\n".join(lines)


def print_examples(task_name: str, split: str, num_examples: int, output_format: str, seed: int,
                   feature_lengths: Optional[Dict[str, int]] = None) -> None:
  task = tasks.get_task_or_mixture(task_name)
  objective = tasks.objective_of(task)
  schema = features.schema(objective)
  lengths = feature_lengths or dict(schema.default_lengths)
  tasks.check_lengths(objective, lengths)
  vocabulary = tasks.vocabulary(task)
  dataset = input_pipeline.task_examples(task, lengths, split, seed, say=lambda line: print(line, file=sys.stderr))
  for index, example in enumerate(dataset.take(num_examples).as_numpy_iterator()):
    if output_format == "jsonl":
      print(json.dumps({name: np.asarray(value).tolist() for name, value in example.items()}))
    else:
      print(f"example {index}")
      for name, value in example.items():
        print(describe(name, np.asarray(value), vocabulary, schema))


def main():
  if not FLAGS.task:
    raise ValueError("--task is required, e.g. --task=demo_bert_mlm_nsp")
  lengths = parse_feature_lengths(FLAGS.feature_lengths) if FLAGS.feature_lengths else None
  print_examples(FLAGS.task, FLAGS.split, FLAGS.num_examples, FLAGS.format, FLAGS.seed, lengths)


if __name__ == "__main__":
  startup.run_program(main, "preview")
