"""Tokenizes a corpus once into token files, which XLNet's row streams read (set TOKEN_DIR to --output).

  python -m data_pipelines.tokenize --train_files='/data/text/*.txt' --validation_files='/data/valid/*.txt' \\
      --vocab_model=/data/spm.model --output=gs://bucket/tokens
  python -m data_pipelines.tokenize --tfds_name=wikipedia/20230601.en:1.0.0 --tfds_data_dir=gs://bucket/tfds \\
      --vocab_model=gs://bucket/spm.model --output=gs://bucket/wiki_tokens
  python -m data_pipelines.tokenize --task=demo_xlnet_plm --output=/tmp/demo_tokens

Writes OUTPUT/<split>/ for each split (local or gs://): one part per source file (or TFDS shard),
then info.json (see data_pipelines/token_files.py). Run again after an interruption: it continues,
keeping the parts already written. Without TOKEN_DIR a run tokenizes on first use into its cache on
every host, which suits one machine, not a pod.
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import os
import time

from absl import flags

from data_pipelines import tasks, token_files

FLAGS = flags.FLAGS
flags.DEFINE_string("task", None, "A registered task, e.g. demo_xlnet_plm (instead of the corpus flags).")
flags.DEFINE_string("train_files", None, "Glob of text files (one sentence per line, blank line between documents).")
flags.DEFINE_string("validation_files", None, "Glob of held-out text files.")
flags.DEFINE_string("tfds_name", None, "A prepared TFDS dataset, e.g. wikipedia/20230601.en:1.0.0.")
flags.DEFINE_string("tfds_data_dir", None, "Where the TFDS dataset is prepared.")
flags.DEFINE_string("vocab_model", None, "The sentencepiece model (from python -m data_pipelines.vocab).")
flags.DEFINE_string("output", None, "Directory to write <split>/ token directories to (the run's TOKEN_DIR).")
flags.DEFINE_list("splits", None, "Splits to tokenize (default: all of the corpus's).")

_OBJECTIVE = "xlnet_plm"  # token files hold the corpus in the vocabulary; any objective's task reads it the same


def corpus_task():
  """The task whose source and vocabulary the flags name."""
  chosen = [name for name in ("task", "train_files", "tfds_name") if FLAGS[name].value]
  if len(chosen) != 1:
    raise ValueError("give the corpus as exactly one of --task, --train_files or --tfds_name")
  if FLAGS.task:
    return tasks.get_task_or_mixture(FLAGS.task)
  if FLAGS.train_files:
    name = tasks.text_task(_OBJECTIVE, FLAGS.train_files, FLAGS.validation_files, FLAGS.vocab_model)
  else:
    name = tasks.tfds_task(_OBJECTIVE, FLAGS.tfds_name, FLAGS.vocab_model, data_dir=FLAGS.tfds_data_dir)
  return tasks.get_task_or_mixture(name)


def main():
  if not FLAGS.output:
    raise ValueError("--output is required: the directory to write the token files to")
  task = corpus_task()
  splits = FLAGS.splits or list(task.splits)
  unknown = sorted(set(splits) - set(task.splits))
  if unknown:
    raise ValueError(f"--splits: {task.name} has no split {unknown[0]!r} (it has {sorted(task.splits)})")
  for split in splits:
    start = time.perf_counter()
    info = token_files.write(task, split, os.path.join(FLAGS.output, split))
    print(f"{split}: {info['tokens']:,} tokens in {len(info['parts'])} part(s), "
          f"{time.perf_counter() - start:.1f} s -> {os.path.join(FLAGS.output, split)}")
  print(f"train with TOKEN_DIR={FLAGS.output!r} (--gin.TOKEN_DIR=\"'{FLAGS.output}'\")")


if __name__ == "__main__":
  startup.run_program(main, "tokenize", interrupted="the parts written are kept (the part being written is removed): "
                      "the same command continues from them")
