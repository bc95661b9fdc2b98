"""Fine-tune a checkpoint in JAX, Flax and optax: pretrained weights against a random start.

  python examples/finetune_jax.py --model_dir=DIR [--steps=300] [--batch_size=32] [--learning_rate=1e-3] \\
      [--seed=0] [--num_classes=5] [--max_length=64]
  python examples/finetune_jax.py --model_dir=/tmp/pod_pretrain/bert_tiny_demo --steps=300

Loads the training directory (MODEL_DIR, not an export) with `pretrain.export.load_pretrained`, puts a
new classification head (dropout, dense) on the pooled [CLS] state, as BertForSequenceClassification
does, and fine-tunes every weight with AdamW on the docstring-classes task (examples/docstring_classes.py:
which stdlib package a docstring sentence is from); then reports accuracy on its held-out sentences.
Then does the same from a random initialisation of the same module (`module.init`), on the same
batches, and prints both. BERT and ALBERT only, the families with a pooler (XLNet, BART: export them
and use examples/finetune_hf.py).
"""
from data_pipelines import startup  # noqa: F401  (first, before TensorFlow and JAX load: they start quietly)

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import docstring_classes
from data_pipelines import vocab
from pretrain import cli, export
from pretrain.errors import ConfigError

EVAL_BATCH = 128
POOLED_FAMILIES = ("bert", "albert")


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python examples/finetune_jax.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", required=True, help="a pretraining MODEL_DIR (checkpoints/, vocab.model)")
  docstring_classes.add_fine_tuning_flags(parser)
  return parser


def features(vocabulary, texts, max_length: int) -> dict:
  """[CLS] sentence [SEP], padded with 0 to max_length: the frame BERT and ALBERT were pretrained on."""
  special = vocab.special_ids(vocabulary)
  ids = np.zeros((len(texts), max_length), np.int32)
  for row, text in enumerate(texts):
    pieces = [special.cls, *vocabulary.encode(text)[:max_length - 2], special.sep]
    ids[row, :len(pieces)] = pieces
  return {"input_ids": ids, "segment_ids": np.zeros_like(ids)}


class ClassifierHead(nn.Module):
  num_classes: int
  dropout_rate: float

  @nn.compact
  def __call__(self, pooled, deterministic: bool):
    pooled = nn.Dropout(self.dropout_rate)(pooled, deterministic=deterministic)
    return nn.Dense(self.num_classes, name="output")(pooled)


class Classifier:
  """The pretraining module and a new head; params are {'model': the module's, 'head': the head's}."""

  def __init__(self, model, num_classes: int):
    self.model, self.head = model, ClassifierHead(num_classes, model.config.dropout_rate)

  def init(self, model_params, batch: dict, seed: int) -> dict:
    """The head starts the same for the same seed; model_params None: the module's own random init."""
    model_key, head_key = jax.random.split(jax.random.PRNGKey(seed))
    if model_params is None:
      model_params = nn.unbox(self.model.init(model_key, batch)["params"])
    head_params = self.head.init(head_key, jnp.zeros((1, self.model.config.hidden_size)), True)["params"]
    return {"model": jax.tree.map(jnp.asarray, model_params), "head": head_params}

  def logits(self, params, batch: dict, rng, train: bool):
    # The module returns only the pretraining logits: its pooler's output is captured on the way. Under
    # jit, the MLM head's work is dropped, since nothing uses it.
    model_rng, head_rng = jax.random.split(rng)
    _, state = self.model.apply({"params": params["model"]}, batch, deterministic=not train,
                                rngs={"dropout": model_rng}, mutable=["intermediates"],
                                capture_intermediates=lambda module, method: module.name == "pooler")
    pooled = jnp.tanh(state["intermediates"]["pooler"]["__call__"][0])  # as BERT's pooler: tanh(dense([CLS]))
    return self.head.apply({"params": params["head"]}, pooled, not train, rngs={"dropout": head_rng})


def finetune(classifier: Classifier, params, vocabulary, task, args):
  """Trains every weight for args.steps steps; returns (params, {'losses': per step, 'accuracy': held out})."""
  optimizer = optax.adamw(args.learning_rate, weight_decay=0.01)

  @jax.jit
  def train_step(params, opt_state, batch, labels, rng):
    def loss_fn(params):
      logits = classifier.logits(params, batch, rng, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, rng = optimizer.init(params), jax.random.PRNGKey(args.seed)
  log_every = max(1, args.steps // 10)
  losses, started = [], time.time()
  batches = docstring_classes.train_batches(task, args.batch_size, args.steps, args.seed)
  for step, (texts, labels) in enumerate(batches, start=1):
    rng, step_rng = jax.random.split(rng)
    params, opt_state, loss = train_step(params, opt_state, features(vocabulary, texts, args.max_length), labels,
                                         step_rng)
    losses.append(float(loss))
    if step % log_every == 0 or step == args.steps:
      print(f"  step {step:>5}/{args.steps}  loss {np.mean(losses[-log_every:]):.3f}  "
            f"{(time.time() - started) / step:.3f} s/step")
  return params, {"losses": losses, "accuracy": accuracy(classifier, params, vocabulary, task.test, args.max_length)}


def accuracy(classifier: Classifier, params, vocabulary, examples, max_length: int) -> float:
  predict = jax.jit(lambda params, batch: classifier.logits(params, batch, jax.random.PRNGKey(0), False).argmax(-1))
  correct = 0
  for start in range(0, len(examples), EVAL_BATCH):
    texts, labels = zip(*examples[start:start + EVAL_BATCH])
    padded = list(texts) + [""] * (EVAL_BATCH - len(texts))  # one shape: one compilation
    predicted = np.asarray(predict(params, features(vocabulary, padded, max_length)))[:len(texts)]
    correct += int((predicted == np.array(labels)).sum())
  return correct / len(examples)


def main(argv) -> dict:
  args = make_parser().parse_args(argv)
  if args.steps < 1 or args.batch_size < 1 or args.max_length < 3:
    raise ConfigError("--steps and --batch_size must be >= 1, --max_length >= 3")
  family = export.open_checkpoint(args.model_dir).spec.name
  if family not in POOLED_FAMILIES:
    raise ConfigError(f"--model_dir={args.model_dir} holds {family}: this example fine-tunes "
                      f"{' and '.join(POOLED_FAMILIES)}; export it and use examples/finetune_hf.py")
  model, pretrained_params, vocabulary = export.load_pretrained(args.model_dir)
  task = docstring_classes.load_task(args.num_classes)
  classifier = Classifier(model, len(task.labels))
  print(f"task: {len(task.labels)} classes {task.labels}, {len(task.train)} train / {len(task.test)} held-out "
        "sentences")
  example = features(vocabulary, [task.train[0][0]], args.max_length)
  results = {}
  for start, model_params in (("pretrained", pretrained_params), ("random", None)):
    params = classifier.init(model_params, example, args.seed)
    print(f"{start}: {family} module and head, "
          f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters")
    _, results[start] = finetune(classifier, params, vocabulary, task, args)
  docstring_classes.print_comparison(task, results)
  return results


if __name__ == "__main__":
  cli.run("finetune_jax", lambda: main(sys.argv[1:]))
