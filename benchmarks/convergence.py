"""Does our training stack learn as well as the reference? Ours against HuggingFace transformers, same batches.

  python benchmarks/convergence.py [--families=bert,albert,xlnet,bart] [--steps=N] [--eval_every=50]
      [--eval_batches=5] [--parity_steps=20] [--plot=benchmarks/convergence.png] [--gin.KEY=VALUE ...]
  python benchmarks/convergence.py --families=bert --steps=40 --eval_every=20 --plot=/tmp/convergence.png

For each family, the run of its tiny `make demo` size (gin_configs/runs/<family>_tiny_demo.gin: the
demo corpus and vocabulary, the run's lengths, batch, learning rate, warmup and steps; ALBERT with
AdamW at 1e-3 instead of its LAMB, which torch lacks) is trained twice from the same initial weights
on the same batches from our input pipeline (`pretrain.trainer.input_pipeline_for_run`):
(a) our model, optimizer and jitted train step, built as pretrain.train builds them; (b) the
transformers model of the same config (BertForPreTraining, AlbertForPreTraining, XLNetLMHeadModel with
perm_mask, target_mapping and mems, BartForConditionalGeneration), loaded with our initial weights
through the export mapping (pretrain/registry.py, pretrain/hf_mappings/), trained with
torch.optim.AdamW under the same warmup and linear decay, clipping and weight-decay mask, on the loss
our family computes. benchmarks/hf_reference.py builds both.

Two checks, printed as a table:
1. parity: with dropout off, the first `--parity_steps` training losses of the two agree within
   `--parity_tolerance` (the largest relative difference is printed). A run configured without dropout
   (ALBERT's) gives them from its own first steps; the others train them from the same weights first.
   This catches optimizer, schedule and loss-normalisation differences that forward parity (the export
   check) cannot.
2. convergence: with the run's dropout (0.1; ALBERT's is 0, as ALBERT v2's), the whole run; the loss on
   `--eval_batches` held-out batches (the same for both, the validation split) every `--eval_every`
   steps. Ours must end within `--final_tolerance` (2%) of HF's, and no evaluation may differ by more
   (dropout masks differ, so the curves differ by that noise). For BERT and ALBERT the table also
   gives the final MLM accuracy against the unigram level (always the most frequent target piece of
   the held-out batches).

Plots train loss (a moving average over 10 steps) and eval loss against steps, ours and HF, one
panel per family, to `--plot`. `--gin.KEY=VALUE` bindings apply to every family's run file, after
its own settings. No network: the demo corpus is built from the Python standard library.

BERT-mini (4 layers, hidden 256) for longer, against HF (not run yet: ours alone takes 1.0 s per step
on 2 CPUs, so about 50 minutes, and HF as long again; ours alone for 1500 steps is in the README,
"Trains as well as the reference"):
  python benchmarks/convergence.py --families=bert --steps=3000 --eval_every=300 --eval_batches=10 \\
      --parity_steps=0 --plot=/tmp/bert_mini.png --gin.WARMUP_STEPS=300 --gin.bert.BertConfig.num_layers=4 \\
      --gin.bert.BertConfig.hidden_size=256 --gin.bert.BertConfig.num_heads=4 --gin.bert.BertConfig.mlp_dim=1024
"""
import argparse
import itertools
import json
import os
import sys
import time

from pretrain import cli

FAMILY_NAMES = ("bert", "albert", "xlnet", "bart")
RUN_FILE = "gin_configs/runs/{}_tiny_demo.gin"
# torch has no LAMB: ALBERT trains with AdamW here, at the learning rate of the other tiny demos.
RUN_OVERRIDES = {"albert": ("OPTIMIZER = 'adamw'", "LEARNING_RATE = 1e-3")}
SMOOTHING_STEPS = 10  # the plot's moving average of train losses


def names(text: str) -> list:
  chosen = [name.strip() for name in text.split(",") if name.strip()]
  if not chosen or any(name not in FAMILY_NAMES for name in chosen):
    raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(FAMILY_NAMES)}")
  return chosen


def make_parser() -> argparse.ArgumentParser:
  """Its flags besides the gin ones (which cli.split_gin_args takes out first)."""
  parser = argparse.ArgumentParser(prog="python benchmarks/convergence.py", description=__doc__,
                                   epilog=cli.gin_flags_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", type=names, default=list(FAMILY_NAMES),
                      help=f"comma-separated, of {','.join(FAMILY_NAMES)} (default: all)")
  parser.add_argument("--steps", type=int, help="training steps, the schedule's end (default: the run's TRAIN_STEPS)")
  parser.add_argument("--eval_every", type=int, default=50, help="steps between evaluations (and at 0 and the end)")
  parser.add_argument("--eval_batches", type=int, default=5, help="held-out batches of each evaluation")
  parser.add_argument("--parity_steps", type=int, default=20, help="steps of the dropout-off comparison (0: none)")
  parser.add_argument("--parity_tolerance", type=float, default=1e-4,
                      help="largest relative train-loss difference allowed in those steps")
  parser.add_argument("--final_tolerance", type=float, default=0.02,
                      help="largest relative eval-loss difference allowed, at the end and at every evaluation")
  parser.add_argument("--plot", default="benchmarks/convergence.png", help="the PNG to write ('' for none)")
  parser.add_argument("--curves", help="also write every loss measured here as JSON")
  parser.add_argument("--torch_threads", type=int, default=1,
                      help="torch's threads (default 1: on CPUs shared with other work, more make torch's threads "
                      "wait for each other)")
  return parser


def parse(argv):
  files, bindings, rest = cli.split_gin_args(argv)
  parser = make_parser()
  if files:
    parser.error("--gin_file: the run files are the families' tiny demos; give --gin.KEY=VALUE bindings only")
  args = parser.parse_args(rest)
  if args.eval_every < 1 or args.eval_batches < 1 or args.parity_steps < 0 or (args.steps is not None
                                                                                and args.steps < 1):
    parser.error("--eval_every, --eval_batches and --steps must be >= 1, --parity_steps >= 0")
  if args.plot:
    try:
      import matplotlib  # noqa: F401  (checked before minutes of training, not after)
    except ImportError:
      parser.error(f"--plot={args.plot} needs matplotlib: pip install -e '.[benchmarks]', or give --plot=''")
  return bindings, args


def load_run(name: str, bindings, steps):
  """(fitted family, task name, feature lengths, batch size, AdamWSettings, seed) of the family's tiny demo."""
  import gin
  from hf_reference import AdamWSettings

  from pretrain import optimizers, trainer
  from pretrain.errors import ConfigError
  gin.clear_config()
  steps_binding = [f"TRAIN_STEPS = {steps}"] if steps else []
  cli.parse_gin([RUN_FILE.format(name)], [*RUN_OVERRIDES.get(name, ()), *bindings, *steps_binding])
  run = cli.bound_arguments(trainer.train, ("family", "mixture_or_task_name", "task_feature_lengths", "batch_size",
                                            "seed"))
  optimizer = cli.bound_arguments(optimizers.make_optimizer, ("name", "weight_decay", "b1", "b2", "eps", "clip_norm"))
  if optimizer.pop("name") != "adamw":
    raise ConfigError("OPTIMIZER: only 'adamw' has a torch counterpart here")
  schedule = cli.bound_arguments(optimizers.warmup_linear_decay, ("peak_learning_rate", "warmup_steps", "total_steps"))
  family = trainer.fitted_family(run["family"], run["mixture_or_task_name"], run["task_feature_lengths"])
  return (family, run["mixture_or_task_name"], run["task_feature_lengths"], run["batch_size"],
          AdamWSettings(**schedule, **optimizer), run["seed"])


def unigram_accuracy(family, batches) -> float:
  """The MLM accuracy of always guessing the most frequent masked piece of these batches."""
  import numpy as np
  ids = np.concatenate([b["masked_ids"][b["masked_weights"] > 0] for b in batches])
  return float(np.bincount(ids).max() / len(ids))


def relative(ours: float, theirs: float) -> float:
  return abs(ours - theirs) / abs(theirs)


def compare(name: str, bindings, args, device) -> dict:
  """Trains both sides of one family: the dropout-off parity steps, then the run; every loss measured."""
  from hf_reference import TOKEN_TASK, HFTrainer, OurTrainer, without_dropout

  from pretrain import trainer
  family, task, lengths, batch_size, settings, seed = load_run(name, bindings, args.steps)
  started = time.perf_counter()
  data = trainer.input_pipeline_for_run(family, task, lengths, batch_size, 1, seed, None)
  train_batches = data.iterator("train")
  eval_batches = list(data.take("validation", args.eval_batches))
  first_batches = [next(train_batches) for _ in range(args.parity_steps)]  # the run starts with these again
  result = {"family": name, "batch_size": batch_size, "steps": settings.total_steps, "settings": vars(settings),
            "parity": [], "train": [], "eval": [], "ours_seconds": 0.0, "hf_seconds": 0.0}

  def step_both(ours, theirs, batch):
    """Both sides' train losses on one batch; each side's time is added to its total."""
    started = time.perf_counter()
    our_loss = ours.step(ours.device_batch(batch))["loss"]
    middle = time.perf_counter()
    their_loss = theirs.step(batch)["loss"]
    result["ours_seconds"] += middle - started
    result["hf_seconds"] += time.perf_counter() - middle
    return our_loss, their_loss

  quiet = without_dropout(family)
  if quiet != family:  # the parity steps are a run of their own; without dropout they are the run's first steps
    ours = OurTrainer(quiet, lengths, batch_size, settings, device, seed)
    theirs = HFTrainer(quiet, batch_size, settings, ours.numpy_params(), seed)
    for batch in first_batches:
      result["parity"].append(step_both(ours, theirs, batch))

  ours = OurTrainer(family, lengths, batch_size, settings, device, seed)  # dropout on: the run as configured
  theirs = HFTrainer(family, batch_size, settings, ours.numpy_params(), seed)
  result["params"] = ours.num_params
  if theirs.num_params != ours.num_params:
    raise RuntimeError(f"{name}: {ours.num_params} params ours, {theirs.num_params} HF")
  accuracy = f"{TOKEN_TASK[name]}_accuracy"
  batches = itertools.chain(first_batches, train_batches)
  for step in range(settings.total_steps + 1):
    if step % args.eval_every == 0 or step == settings.total_steps:
      ours_eval, their_eval = ours.evaluate(eval_batches), theirs.evaluate(eval_batches)
      result["eval"].append((step, ours_eval["loss"], their_eval["loss"], ours_eval[accuracy], their_eval[accuracy]))
      recent = result["train"][-args.eval_every:] or [(float("nan"),) * 2]
      ours_train, their_train = (sum(r[side] for r in recent) / len(recent) for side in (0, 1))
      print(f"  {name} step {step}: train loss (mean of the last {len(recent)}) ours {ours_train:.4f} HF "
            f"{their_train:.4f}; eval loss ours {ours_eval['loss']:.4f} HF {their_eval['loss']:.4f}", flush=True)
    if step == settings.total_steps:
      break
    result["train"].append(step_both(ours, theirs, next(batches)))
  if quiet == family:
    result["parity"] = result["train"][:args.parity_steps]
  if name in ("bert", "albert"):
    result["unigram_accuracy"] = unigram_accuracy(family, eval_batches)
  result["seconds"] = time.perf_counter() - started
  return result


def summary(result, args) -> dict:
  """The table's figures of one family, and whether each check passed."""
  parity = [relative(o, t) for o, t in result["parity"]]
  step, ours_loss, their_loss, ours_accuracy, their_accuracy = result["eval"][-1]
  gaps = [relative(o, t) for _, o, t, _, _ in result["eval"]]
  row = {"family": result["family"], "params": result["params"], "steps": step,
         "parity_steps": len(parity), "parity_max_rel": max(parity) if parity else float("nan"),
         "ours_eval": ours_loss, "hf_eval": their_loss, "ratio": ours_loss / their_loss, "max_eval_gap": max(gaps),
         "ours_accuracy": ours_accuracy, "hf_accuracy": their_accuracy, "seconds": result["seconds"],
         "ours_seconds": result["ours_seconds"], "hf_seconds": result["hf_seconds"],
         "unigram_accuracy": result.get("unigram_accuracy")}
  row["parity_ok"] = not parity or row["parity_max_rel"] <= args.parity_tolerance
  row["convergence_ok"] = row["max_eval_gap"] <= args.final_tolerance
  return row


def print_table(rows, args) -> None:
  verdict = lambda ok: "ok" if ok else "NO"  # noqa: E731
  print(f"\n{'family':<8}{'params':>8}{'steps':>6}{'parity max rel':>16}{'':>4}{'eval ours':>11}{'eval HF':>9}"
        f"{'ours/HF':>9}{'max gap':>9}{'':>4}{'acc ours':>10}{'acc HF':>8}{'unigram':>9}"
        f"{'s ours':>8}{'s HF':>7}{'s all':>7}")
  for r in rows:
    unigram = "" if r["unigram_accuracy"] is None else f"{r['unigram_accuracy']:.3f}"
    print(f"{r['family']:<8}{r['params'] / 1e6:>7.2f}M{r['steps']:>6}{r['parity_max_rel']:>16.2e}"
          f"{verdict(r['parity_ok']):>4}{r['ours_eval']:>11.4f}{r['hf_eval']:>9.4f}{r['ratio']:>9.4f}"
          f"{100 * r['max_eval_gap']:>8.2f}%{verdict(r['convergence_ok']):>4}{r['ours_accuracy']:>10.3f}"
          f"{r['hf_accuracy']:>8.3f}{unigram:>9}{r['ours_seconds']:>8.0f}{r['hf_seconds']:>7.0f}{r['seconds']:>7.0f}")
  print(f"parity: the largest relative difference of the first {args.parity_steps} train losses, dropout off "
        f"(ok: <= {args.parity_tolerance:g}); eval: the held-out loss at the end; max gap: the largest relative "
        f"difference of any evaluation (ok: <= {100 * args.final_tolerance:g}%); acc: the token accuracy of the "
        "family's LM loss at the end; unigram: the MLM accuracy of always guessing the most frequent piece; s: "
        "seconds in training steps (compilation included), ours and HF, and in all (data and evaluations too)")


def plot(results, rows, path: str) -> None:
  """One panel per family: train loss (moving average) and eval loss against steps, ours and HF."""
  import matplotlib
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt
  import numpy as np
  columns = min(2, len(results))
  figure, axes = plt.subplots((len(results) + columns - 1) // columns, columns, figsize=(4.6 * columns, 3.2 * (
      (len(results) + columns - 1) // columns)), squeeze=False)
  for ax in axes.flat[len(results):]:
    ax.set_visible(False)
  for ax, result, row in zip(axes.flat, results, rows):
    train = np.asarray(result["train"])
    evals = np.asarray(result["eval"])
    window = min(SMOOTHING_STEPS, len(train))
    kernel = np.ones(window) / window
    steps = np.arange(window, len(train) + 1)  # a mean ends at the step it is drawn at
    for column, label, color in ((0, "ours", "tab:blue"), (1, "HF", "tab:orange")):
      ax.plot(steps, np.convolve(train[:, column], kernel, mode="valid"), color=color, lw=1, alpha=0.6,
              label=f"train, {label}")
      ax.plot(evals[:, 0], evals[:, 1 + column], color=color, lw=1.5, marker="o", ms=3,
              ls="-" if column == 0 else "--", label=f"eval, {label}")
    ax.set_title(f"{row['family'].upper()}: final eval ours/HF = {row['ratio']:.4f}", fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel("loss", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=72)
  plt.close(figure)
  print(f"plot: {path} ({os.path.getsize(path) / 1e3:.0f} KB)")


def main(argv) -> None:
  bindings, args = parse(argv)
  import jax
  import torch
  torch.set_num_threads(args.torch_threads)
  device = jax.devices("cpu")[0]
  print(f"{os.cpu_count()} CPUs; torch {torch.__version__} with {args.torch_threads} thread(s), jax {jax.__version__};"
        f" fp32; families {','.join(args.families)}", flush=True)
  started = time.perf_counter()
  results = [compare(name, bindings, args, device) for name in args.families]
  rows = [summary(result, args) for result in results]
  print_table(rows, args)
  print(f"wall time {time.perf_counter() - started:.0f} s")
  if args.curves:
    with open(args.curves, "w") as f:
      json.dump(results, f)
  if args.plot:
    plot(results, rows, args.plot)


if __name__ == "__main__":
  os.environ["JAX_PLATFORMS"] = "cpu"  # the comparison is on the CPU, whatever accelerator is attached
  cli.start(sys.argv, make_parser().format_help())
  # benchmarks/ is not a package: its scripts import their shared module by name, from their own directory.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  cli.run("convergence", lambda: main(sys.argv[1:]))
