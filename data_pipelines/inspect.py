"""Prints a task's examples as the model sees them: after the objective, at fixed lengths.

  python -m data_pipelines.inspect --task=demo_bert_mlm_nsp --num_examples=2
  python -m data_pipelines.inspect --task=demo_albert_mlm_sop --format=jsonl \
      --feature_lengths=input_ids=512,masked_positions=76

text: every feature's ids, plus the decoded text of token features (targets such as masked_ids
piece by piece); 2-D features (XLNet's perm_mask, target_mapping) as shape and number of ones.
jsonl: one JSON object per example, every feature as a number or (nested) list of numbers.
"""
import json
import sys
from typing import Dict, Optional

import numpy as np
from absl import app, flags

from data_pipelines import tasks

# Lengths used when --feature_lengths is omitted, by objective (task names are `<corpus>_<objective>`).
DEFAULT_FEATURE_LENGTHS = {
    "bert_mlm_nsp": {"input_ids": 128, "masked_positions": 20},
    "albert_mlm_sop": {"input_ids": 128, "masked_positions": 20},
    "bart_denoising": {"encoder_input_ids": 128, "decoder_input_ids": 128},
    "t5_span_corruption": {"encoder_input_ids": 128, "decoder_input_ids": 32},
    "xlnet_plm": {"input_ids": 128, "target_ids": 21},
}
# Token features that are prediction targets: the task's output_features list only the inputs.
TARGET_TOKEN_FEATURES = ("masked_ids", "target_ids", "decoder_target_ids")

FLAGS = flags.FLAGS
flags.DEFINE_string("task", None, "Registered task or mixture, e.g. demo_bert_mlm_nsp.")
flags.DEFINE_string("split", "train", "Dataset split.")
flags.DEFINE_integer("num_examples", 3, "How many examples to print.")
flags.DEFINE_enum("format", "text", ["text", "jsonl"], "Output format.")
flags.DEFINE_integer("seed", 0, "Seed of the objective's randomness (pairing, masking).")
flags.DEFINE_string("feature_lengths", None, "NAME=LENGTH,... (default: by the task's objective).")


def parse_feature_lengths(text: str) -> Dict[str, int]:
  lengths = {}
  for item in text.split(","):
    name, _, value = item.partition("=")
    if not name.strip() or not value.strip().isdigit():
      raise ValueError(f"--feature_lengths={text!r}: expected NAME=LENGTH,... e.g. input_ids=128,masked_positions=20")
    lengths[name.strip()] = int(value)
  return lengths


def default_feature_lengths(task_name: str) -> Dict[str, int]:
  for objective, lengths in DEFAULT_FEATURE_LENGTHS.items():
    if task_name.endswith(objective):
      return dict(lengths)
  raise ValueError(f"--task={task_name!r}: no default lengths for its objective; pass --feature_lengths=NAME=LENGTH,...")


def describe(name: str, value: np.ndarray, vocabulary, token_features) -> str:
  """One feature as text lines; trailing zeros (padding) are counted rather than printed."""
  header = f"  {name} {value.dtype}{list(value.shape)}:"
  if value.ndim >= 2:  # e.g. perm_mask [length, length]: too big to print usefully
    return f"{header} {value.ndim}-D, {int(np.count_nonzero(value == 1))} ones"
  if value.ndim == 0:
    return f"{header} {value.item()}"
  kept = np.trim_zeros(value, "b")
  padding = f" + {value.size - kept.size} zeros" if kept.size < value.size else ""
  lines = [f"{header} {kept.tolist()}{padding}"]
  if name in token_features:
    # The tokenizer itself, not vocabulary.decode: that stops at the first eos (BART's decoder starts with one).
    lines.append(f"    text: {vocabulary.tokenizer.decode_ids(kept.tolist())!r}")
  elif name in TARGET_TOKEN_FEATURES:
    lines.append(f"    pieces: {[vocabulary.tokenizer.id_to_piece(i) for i in kept.tolist()]}")
  return "\n".join(lines)


def print_examples(task_name: str, split: str, num_examples: int, output_format: str, seed: int,
                   feature_lengths: Optional[Dict[str, int]] = None) -> None:
  task = tasks.get_task_or_mixture(task_name)
  lengths = feature_lengths or default_feature_lengths(task_name)
  vocabulary = next(iter(task.output_features.values())).vocabulary
  dataset = tasks.get_dataset(task, lengths, split=split, shuffle=False, seed=seed, num_epochs=1)
  for index, example in enumerate(dataset.take(num_examples).as_numpy_iterator()):
    if output_format == "jsonl":
      print(json.dumps({name: np.asarray(value).tolist() for name, value in example.items()}))
    else:
      print(f"example {index}")
      for name, value in example.items():
        print(describe(name, np.asarray(value), vocabulary, task.output_features))


def main(argv):
  if len(argv) > 1:
    sys.exit(f"inspect: error: unexpected arguments {argv[1:]}")
  try:
    if not FLAGS.task:
      raise ValueError("--task is required, e.g. --task=demo_bert_mlm_nsp")
    lengths = parse_feature_lengths(FLAGS.feature_lengths) if FLAGS.feature_lengths else None
    print_examples(FLAGS.task, FLAGS.split, FLAGS.num_examples, FLAGS.format, FLAGS.seed, lengths)
  except (ValueError, FileNotFoundError) as error:  # user errors: one line, no traceback
    sys.exit(f"inspect: error: {str(error).strip().splitlines()[0]}")
  except KeyError as error:  # the objective read a length that --feature_lengths lacks
    sys.exit(f"inspect: error: --feature_lengths has no length for {error}")


if __name__ == "__main__":
  app.run(main)
