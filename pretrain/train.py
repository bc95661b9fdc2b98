"""Pretrains a model as gin files describe it (T5X's conventions): a run file (gin_configs/runs/)
names the model, objective, data and schedule; flags override any of it.

  python -m pretrain.train --gin_file=gin_configs/runs/bert_tiny_demo.gin \\
      --gin.MODEL_DIR="'/tmp/bert'" --gin.TRAIN_STEPS=1000

A run resumes from the latest checkpoint in MODEL_DIR. See README.md, "Train".
"""
import sys

from pretrain import cli, distributed
from pretrain.errors import ConfigError

HELP = cli.gin_help(__doc__)


def main(argv) -> None:
  files, bindings, rest = cli.split_gin_args(argv[1:])
  if rest:
    raise ConfigError(f"unknown arguments {rest}; use --gin_file, --gin_bindings or --gin.KEY=VALUE")
  if not files:
    raise ConfigError("no --gin_file given, e.g. --gin_file=gin_configs/runs/bert_tiny_demo.gin")
  cli.parse_gin(files, bindings)
  import jax

  from pretrain import trainer  # after gin parsing: imports are slow, errors above are not
  arguments = cli.bound_arguments(trainer.train)
  summary = trainer.train(**arguments)
  if jax.process_index() == 0 and not summary["preempted"]:
    if summary["first_loss"] is None:  # the checkpoint it resumed from had reached TRAIN_STEPS
      print(f"done: nothing to train, the checkpoint is at step {summary['steps']} and TRAIN_STEPS="
            f"{arguments['train_steps']} (raise TRAIN_STEPS to train on); checkpoints in {summary['checkpoint_dir']}")
    else:
      print(f"done: {summary['steps']} steps; first logged loss {summary['first_loss']}, last {summary['last_loss']}; "
            f"checkpoints in {summary['checkpoint_dir']}{_goodput(summary['goodput'])}")


def _goodput(shares) -> str:
  if shares is None:  # its records could not be read
    return ""
  this_start, run = shares
  return f"; goodput {this_start:.0%} of this start, {run:.0%} of the run so far (python -m pretrain.goodput MODEL_DIR)"


if __name__ == "__main__":
  cli.start(sys.argv, HELP)
  from pretrain import goodput_events  # after cli.start: it imports TensorFlow
  goodput_events.launched_to_train()
  distributed.initialize()
  cli.run("pretrain.train", lambda: main(sys.argv))
