"""Fine-tune an export with HuggingFace transformers and PyTorch: pretrained weights against a random start.

  python examples/finetune_hf.py --export_dir=DIR [--steps=300] [--batch_size=32] [--learning_rate=1e-3] \\
      [--seed=0] [--num_classes=5] [--max_length=64]
  python -m pretrain.export --model_dir=/tmp/pod_pretrain/bert_tiny_demo --output_dir=/tmp/bert_hf
  python examples/finetune_hf.py --export_dir=/tmp/bert_hf --steps=300

Loads the directory `pretrain.export` wrote with AutoModelForSequenceClassification (the pretraining
heads are dropped, the classification head is new) and AutoTokenizer, fine-tunes every weight with
AdamW on the docstring-classes task (examples/docstring_classes.py: which stdlib package a docstring
sentence is from), and reports accuracy on its held-out sentences. Then does the same from a random
initialisation of the same config (AutoModelForSequenceClassification.from_config), on the same
batches, and prints both. Any family with a sequence-classification class in transformers works:
BERT, ALBERT, XLNet, BART.
"""
from data_pipelines import startup  # noqa: F401  (first, before TensorFlow loads: it starts quietly)

import argparse
import os
import sys
import time

import numpy as np
import torch
import transformers

import docstring_classes
from pretrain import cli
from pretrain.errors import ConfigError

EVAL_BATCH = 128


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python examples/finetune_hf.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--export_dir", required=True, help="a directory written by pretrain.export")
  docstring_classes.add_fine_tuning_flags(parser)
  return parser


def check_export_dir(export_dir: str) -> None:
  if not os.path.isdir(export_dir):
    raise ConfigError(f"--export_dir={export_dir}: no such directory")
  if not os.path.exists(os.path.join(export_dir, "config.json")):
    raise ConfigError(f"--export_dir={export_dir}: no config.json; write one with python -m pretrain.export")


def load(export_dir: str, num_labels: int, pretrained: bool, seed: int):
  """(model, tokenizer): the export's weights, or the same config with random weights."""
  torch.manual_seed(seed)  # the new weights follow --seed
  config = transformers.AutoConfig.from_pretrained(export_dir, num_labels=num_labels)
  auto = transformers.AutoModelForSequenceClassification
  model = auto.from_pretrained(export_dir, config=config) if pretrained else auto.from_config(config)
  return model, transformers.AutoTokenizer.from_pretrained(export_dir)


def accuracy(model, tokenizer, examples, max_length: int) -> float:
  model.eval()
  correct = 0
  with torch.no_grad():
    for start in range(0, len(examples), EVAL_BATCH):
      texts, labels = zip(*examples[start:start + EVAL_BATCH])
      inputs = tokenizer(list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt")
      correct += (model(**inputs).logits.argmax(-1) == torch.tensor(labels)).sum().item()
  return correct / len(examples)


def finetune(model, tokenizer, task, args) -> dict:
  """Trains every weight for args.steps steps; returns {'losses': per step, 'accuracy': held out}."""
  optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
  log_every = max(1, args.steps // 10)
  losses, started = [], time.time()
  model.train()
  batches = docstring_classes.train_batches(task, args.batch_size, args.steps, args.seed)
  for step, (texts, labels) in enumerate(batches, start=1):
    inputs = tokenizer(texts, truncation=True, max_length=args.max_length, padding=True, return_tensors="pt")
    loss = model(**inputs, labels=torch.from_numpy(labels)).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % log_every == 0 or step == args.steps:
      print(f"  step {step:>5}/{args.steps}  loss {np.mean(losses[-log_every:]):.3f}  "
            f"{(time.time() - started) / step:.3f} s/step")
  return {"losses": losses, "accuracy": accuracy(model, tokenizer, task.test, args.max_length)}


def main(argv) -> dict:
  args = make_parser().parse_args(argv)
  check_export_dir(args.export_dir)
  if args.steps < 1 or args.batch_size < 1:
    raise ConfigError("--steps and --batch_size must be >= 1")
  transformers.logging.set_verbosity_error()  # it warns that the classification head is new: we know
  transformers.logging.disable_progress_bar()
  task = docstring_classes.load_task(args.num_classes)
  print(f"task: {len(task.labels)} classes {task.labels}, {len(task.train)} train / {len(task.test)} held-out "
        "sentences")
  results = {}
  for start, pretrained in (("pretrained", True), ("random", False)):
    model, tokenizer = load(args.export_dir, len(task.labels), pretrained, args.seed)
    print(f"{start}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    results[start] = finetune(model, tokenizer, task, args)
  docstring_classes.print_comparison(task, results)
  return results


if __name__ == "__main__":
  cli.run("finetune_hf", lambda: main(sys.argv[1:]))
