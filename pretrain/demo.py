"""`make demo`: build the demo corpus and vocabulary, then pretrain tiny models on the CPU.

  python -m pretrain.demo --output_dir=demo_output [--runs=bert_tiny_demo,...] [--train_steps=N]
  python -m pretrain.demo --output_dir=/tmp/demo --runs=bert_tiny_demo --train_steps=50

Each run is gin_configs/runs/<run>.gin with MODEL_DIR=<output_dir>/<run>, and resumes from what that
directory holds. To change more than the steps, run pretrain.train on the run file (its --help).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the demo is for any laptop; TPU runs use pretrain.train

DEFAULT_RUNS = ("bert_tiny_demo", "xlnet_tiny_demo")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m pretrain.demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--output_dir", default="demo_output", help="a directory per run goes here")
  parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated gin_configs/runs/<name>.gin")
  parser.add_argument("--train_steps", type=int, default=None, help="override TRAIN_STEPS")
  args = parser.parse_args(argv)

  from data_pipelines import startup  # noqa: F401  (first: TensorFlow and JAX start quietly)
  import gin

  from data_pipelines import demo_corpus
  from pretrain import cli, goodput_events, trainer

  goodput_events.launched_to_train()  # the first run's start-up includes the imports and the demo corpus
  started = time.time()
  paths = demo_corpus.ensure_demo_corpus()
  print(f"demo corpus: {paths['train']} ({os.path.getsize(paths['train']) / 1e6:.1f} MB), "
        f"validation {paths['validation']}, vocabulary {paths['vocab_model']} "
        f"({time.time() - started:.0f} s)")
  results = []
  for run in args.runs.split(","):
    model_dir = os.path.abspath(os.path.join(args.output_dir, run))
    bindings = [f"MODEL_DIR = '{model_dir}'"]
    if args.train_steps:
      bindings.append(f"TRAIN_STEPS = {args.train_steps}")
    gin.clear_config()
    cli.parse_gin([f"gin_configs/runs/{run}.gin"], bindings)
    run_started = time.time()
    summary = trainer.train(**cli.bound_arguments(trainer.train))
    results.append((run, model_dir, summary, time.time() - run_started))

  print("\n== demo finished ==")
  for run, model_dir, summary, seconds in results:
    if summary["first_loss"] is None:
      print(f"{run}: already trained to step {summary['steps']}; delete {model_dir} to train again")
      continue
    print(f"{run}: first loss {summary['first_loss']:.3f} -> last loss {summary['last_loss']:.3f} "
          f"in {summary['steps']} steps, {seconds:.0f} s of training")
    print(f"  checkpoints: {summary['checkpoint_dir']}")
    print(f"  TensorBoard: tensorboard --logdir {os.path.join(model_dir, 'tensorboard')}")
    print(f"  metrics:     {os.path.join(model_dir, 'metrics.jsonl')}")


if __name__ == "__main__":
  from pretrain import cli
  cli.run("pretrain.demo", lambda: main(sys.argv[1:]))
