"""A small sentence-classification task from the demo corpus's source: which standard-library package a
docstring sentence comes from.

  python examples/docstring_classes.py [--num_classes=5]

The classes are the `--num_classes` top-level packages (directories, e.g. email/, asyncio/) of the Python
standard library with the most distinct docstring sentences, split into sentences exactly as the demo
corpus is (data_pipelines/demo_corpus.py). A sentence found in more than one package is left out (it
has no single answer); each class keeps as many sentences as the smallest one has, so chance is
1/num_classes. A fifth of the sentences, chosen by a hash of the text, are held out: a sentence is
always on the same side, and no held-out sentence is trained on. No network: it reads the local
standard library once and caches the task under $POD_PRETRAIN_CACHE. The pretraining corpus holds
these sentences too (without their packages): the task tests what pretraining put in the weights.
"""
from data_pipelines import startup  # noqa: F401  (first, before TensorFlow loads: it starts quietly)

import argparse
import collections
import dataclasses
import hashlib
import json
import platform
import sys
from typing import Iterator, List, Tuple

import numpy as np

from data_pipelines import demo_corpus
from pretrain import cli
from pretrain.errors import ConfigError

HELD_OUT_EVERY = 5  # one sentence in five is held out


@dataclasses.dataclass(frozen=True)
class Task:
  labels: List[str]  # package names; a label is its index here
  train: List[Tuple[str, int]]  # (sentence, label)
  test: List[Tuple[str, int]]


def _digest(sentence: str) -> int:
  return int(hashlib.sha256(sentence.encode("utf-8")).hexdigest(), 16)


def _sentences_by_package() -> dict:
  """{package: set of its docstring sentences}, packages being the stdlib's top-level directories."""
  root, found = demo_corpus.stdlib_root(), collections.defaultdict(set)
  for source_file in demo_corpus.stdlib_sources():
    parts = source_file.relative_to(root).parts
    if len(parts) > 1:  # a single-file module is not a package
      for doc in demo_corpus._docstrings(source_file):
        found[parts[0]].update(demo_corpus._sentences(doc))
  return found


def build_task(num_classes: int) -> Task:
  found = _sentences_by_package()
  packages_of = collections.Counter(s for sentences in found.values() for s in sentences)
  unique = {package: sorted((s for s in sentences if packages_of[s] == 1), key=_digest)
            for package, sentences in found.items()}
  labels = sorted(unique, key=lambda p: (-len(unique[p]), p))[:num_classes]  # ties by name: deterministic
  size = min(len(unique[p]) for p in labels)
  train, test = [], []
  for label, package in enumerate(labels):
    for sentence in unique[package][:size]:  # the first by hash: a fixed sample of the larger classes
      (test if (_digest(sentence) >> 128) % HELD_OUT_EVERY == 0 else train).append((sentence, label))
  return Task(labels, sorted(train), sorted(test))


def load_task(num_classes: int = 5) -> Task:
  """The task, built once per Python version (the stdlib differs between versions) and then cached."""
  if num_classes < 2:
    raise ConfigError(f"--num_classes={num_classes}: a classification needs at least 2")
  path = demo_corpus.cache_root() / "docstring_classes" / f"python{platform.python_version()}_{num_classes}.json"
  if path.exists():
    return Task(**{key: [tuple(x) if isinstance(x, list) else x for x in value]
                   for key, value in json.loads(path.read_text()).items()})
  task = build_task(num_classes)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(dataclasses.asdict(task)))
  tmp.replace(path)  # atomic: a concurrent reader never sees half a file
  return task


def train_batches(task: Task, batch_size: int, steps: int, seed: int) -> Iterator[Tuple[List[str], np.ndarray]]:
  """`steps` batches of (sentences, labels) drawn from the train split; the same ones for the same seed,
  so the pretrained and the random start see the same data in the same order."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    rows = rng.choice(len(task.train), size=min(batch_size, len(task.train)), replace=False)
    yield [task.train[i][0] for i in rows], np.array([task.train[i][1] for i in rows])


def add_fine_tuning_flags(parser) -> None:
  """The flags both fine-tuning examples take besides the weights' directory."""
  parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps of each run")
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=1e-3, help="AdamW's, constant")
  parser.add_argument("--seed", type=int, default=0, help="the head's init, dropout and the batches")
  parser.add_argument("--num_classes", type=int, default=5, help="stdlib packages to tell apart")
  parser.add_argument("--max_length", type=int, default=64, help="tokens per sentence, the frame included")


def print_comparison(task: Task, results: dict) -> None:
  """The table both fine-tuning examples end with: {start: {'accuracy', 'losses'}} per row."""
  print(f"\n{'start':<12}{'held-out accuracy':>19}{'last train loss':>17}")
  for start, result in results.items():
    last = np.mean(result["losses"][-10:])  # the mean of the last steps: one batch's loss is noisy
    print(f"{start:<12}{result['accuracy']:>19.3f}{last:>17.3f}")
  print(f"chance: {1 / len(task.labels):.3f} ({len(task.labels)} balanced classes, {len(task.test)} held-out "
        f"sentences: {', '.join(task.labels)})")


def main(argv) -> None:
  parser = argparse.ArgumentParser(prog="python examples/docstring_classes.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_classes", type=int, default=5, help="packages to tell apart")
  args = parser.parse_args(argv)
  task = load_task(args.num_classes)
  print(f"{len(task.train)} train and {len(task.test)} held-out sentences; classes:")
  for label, package in enumerate(task.labels):
    example = next(sentence for sentence, y in task.train if y == label)
    print(f"  {label} {package:<12} e.g. {example[:90]!r}")


if __name__ == "__main__":
  cli.run("docstring_classes", lambda: main(sys.argv[1:]))
