"""From `python -m pretrain.train` to the first step, cold, resumed and with a shared cache, on this machine: #23's
start-up figures.

  python benchmarks/start_up.py [--models=bert_base,xlnet_base] [--batch_size=8] [--repeats=1] \\
      [--baseline_repo=PATH] [--gin.KEY=VALUE ...]

For each model, a cold start (a new MODEL_DIR: no checkpoint, no compilation cache, no token files) trains one
step; then the same command resumes it to step 2 (a restore, and the programs from MODEL_DIR's compilation cache);
then a new run (another MODEL_DIR, as in a sweep) given the first run's cache as its COMPILATION_CACHE_DIR trains one
step ('new, shared cache': an init, and every program loaded; where the checkout has no such setting, not run).
Each is a real `python -m pretrain.train` process on the demo corpus (JAX on the CPU, eval off), with the run file's
model and recipe at --batch_size. 'to first line' is timed from the launch to the progress line of the start's
first step, so it holds that step's own run. Where the checkout writes goodput records (MODEL_DIR/goodput.jsonl),
they break it down: 'to first step' (the process's start to the first step's dispatch: start-up proper), within it
'before init' (imports, the lease, the input pipeline: all before the state's init or restore), 'init/restore' and
'compile' (the train step's; with a cache, loading it), and 'first step' (that step's own run, which on a CPU can
outweigh the whole start-up). 'CPU to exit' is the process's user and system time, start to exit (its step and save
included): the work a start does, which a busy or noisy machine changes less than it does the wall times, and which
overlapping parts of a start (threads beside each other) does not lower.

With --baseline_repo (another checkout of pod-pretrain, e.g. `git worktree add /tmp/before <commit>`), the same
starts run that checkout's code too, interleaved with this one's, and the table gives each figure's ratio to it.
Medians over --repeats. Extra gin flags (e.g. --gin.bert.BertConfig.scan_layers=True) go to every start, after the
model's run file, on both sides.
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pretrain import cli, goodput  # noqa: E402  (light: no TensorFlow or JAX)
MODELS = {  # name -> gin files: the run file, then what makes its model the one named
    "bert_base": ["gin_configs/runs/bert_base_pretrain.gin"],
    "xlnet_base": ["gin_configs/runs/xlnet_large_pretrain.gin", "gin_configs/models/xlnet_base.gin"],
}
SHARED = "new, shared cache"
FIGURES = ("to first line", "to first step", "before init", "init/restore", "compile", "first step", "CPU to exit")


def goodput_figures(model_dir: Path) -> dict:
  """The last start's figures from model_dir's goodput records, in seconds ({} where the checkout writes none)."""
  if not (model_dir / goodput.FILE_NAME).exists():
    return {}
  last = goodput.account(goodput.read_records(str(model_dir))).starts[-1].records
  one = lambda *kinds: next(r for r in last if r["kind"] in kinds)
  started, state, first = one("start"), one("init", "restore"), one("first_step")
  return {"to first step": first["time"] - started["time"],
          "before init": state["time"] - state["seconds"] - started["time"], "init/restore": state["seconds"],
          "compile": sum(r["seconds"] for r in last if r["kind"] == "compile" and r.get("what") == "train_step"),
          "first step": next(r["seconds"] for r in last if r["kind"] == "steps" and r["step"] == first["step"])}


def train(repo: Path, model: str, model_dir: Path, steps: int, batch_size: int, demo: dict, token_cache: Path,
          gin_flags: list) -> dict:
  """One `python -m pretrain.train` start in `repo` up to `steps`; its figures (the module's docstring)."""
  flags = [*(f"--gin_file={f}" for f in MODELS[model]), f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}",
           f"--gin.BATCH_SIZE={batch_size}", f"--gin.TRAIN_FILES='{demo['train']}'", "--gin.VALIDATION_FILES=None",
           f"--gin.VOCAB_MODEL='{demo['vocab_model']}'", "--gin.EVAL_EVERY_STEPS=0", "--gin.LOG_EVERY_STEPS=1",
           "--gin.MESH_SHAPE={'data': 1}", *gin_flags]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  # A cache of its own gives each run new token files; the demo corpus, which text_task would otherwise find in
  # POD_PRETRAIN_CACHE (building it again), is named in the flags.
  env.update(JAX_PLATFORMS="cpu", POD_PRETRAIN_CACHE=str(token_cache))
  children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
  launched = time.monotonic()
  process = subprocess.Popen([sys.executable, "-m", "pretrain.train", *flags], cwd=repo, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  to_first_line, lines = None, []
  for line in process.stdout:
    lines.append(line)
    if to_first_line is None and f"step {steps:>6d}/" in line:
      to_first_line = time.monotonic() - launched
  if process.wait() != 0 or to_first_line is None:
    sys.exit(f"benchmarks/start_up.py: error: {model} in {repo} failed: {''.join(lines[-3:]).strip()}")
  children = resource.getrusage(resource.RUSAGE_CHILDREN)  # now with this start's, which has been waited for
  cpu = (children.ru_utime + children.ru_stime) - (children_before.ru_utime + children_before.ru_stime)
  return {"to first line": to_first_line, **goodput_figures(model_dir), "CPU to exit": cpu}


def starts(repo: Path, model: str, batch_size: int, demo: dict, gin_flags: list) -> dict:
  """{start: figures} of a new run of `model` in `repo`, started then resumed, and of a run beside it that shares
  its compilation cache (the module's docstring)."""
  with tempfile.TemporaryDirectory(prefix="start_up_") as scratch:
    model_dir, token_cache = Path(scratch) / "run", Path(scratch) / "cache"
    figures = {"cold": train(repo, model, model_dir, 1, batch_size, demo, token_cache, gin_flags),
               "resumed": train(repo, model, model_dir, 2, batch_size, demo, token_cache, gin_flags)}
    if (repo / "pretrain" / "compilation_cache.py").exists():
      shared = f"--gin.COMPILATION_CACHE_DIR='{model_dir / 'compilation_cache'}'"
      figures[SHARED] = train(repo, model, Path(scratch) / "new_run", 1, batch_size, demo, token_cache,
                              [*gin_flags, shared])
    return figures


def median_figures(runs: list) -> dict:
  """{start: {figure: median seconds}}; a figure the checkout does not record is left out."""
  return {start: {figure: statistics.median(run[start][figure] for run in runs) for figure in FIGURES
                  if figure in runs[0][start]} for start in runs[0]}


def table(results: dict, baseline: dict) -> str:
  header = "model | start | " + " | ".join(f"{f} (s)" for f in FIGURES)
  if baseline:
    header += " | " + " | ".join(f"{f} vs baseline" for f in FIGURES)
  lines = [header, "|".join("---" for _ in header.split("|"))]
  for model, figures in results.items():
    for start, ours in figures.items():
      row = [model, start, *(f"{ours[f]:.1f}" if f in ours else "-" for f in FIGURES)]
      if baseline:
        theirs = baseline[model].get(start, {})
        row += [f"{ours[f] / theirs[f]:.2f}x" if theirs.get(f) and f in ours else "-" for f in FIGURES]
      lines.append(" | ".join(row))
  return "\n".join(lines)


def main(argv) -> None:
  parser = argparse.ArgumentParser(prog="python benchmarks/start_up.py", description=__doc__,
                                   epilog=cli.gin_flags_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="bert_base,xlnet_base", help=f"comma-separated, of {sorted(MODELS)}")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=1, help="cold + resumed pairs per model and checkout")
  parser.add_argument("--baseline_repo", type=Path, help="another pod-pretrain checkout to compare with")
  gin_files, gin_bindings, rest = cli.split_gin_args(argv)
  gin_flags = [*(f"--gin_file={f}" for f in gin_files), *(f"--gin_bindings={b}" for b in gin_bindings)]
  args = parser.parse_args(rest)
  models = args.models.split(",")
  unknown = sorted(set(models) - set(MODELS))
  if unknown:
    parser.error(f"unknown model(s) {unknown}: choose from {sorted(MODELS)}")
  if args.baseline_repo and not (args.baseline_repo / "pretrain" / "train.py").exists():
    parser.error(f"--baseline_repo={args.baseline_repo} is not a pod-pretrain checkout (no pretrain/train.py)")
  from data_pipelines import demo_corpus
  demo = {k: str(v) for k, v in demo_corpus.ensure_demo_corpus().items()}
  repos = {"ours": ROOT, **({"baseline": args.baseline_repo.resolve()} if args.baseline_repo else {})}
  runs = {(name, model): [] for name in repos for model in models}
  began = time.time()
  for repeat in range(args.repeats):
    for model in models:
      for name, repo in repos.items():  # interleaved: a slower spell of the machine hits both alike
        runs[name, model].append(starts(repo, model, args.batch_size, demo, gin_flags))
        last = runs[name, model][-1]
        made = ", ".join(f"{start} {figures['to first line']:.1f} s" for start, figures in last.items())
        print(f"[{time.time() - began:.0f} s] {model} {name} #{repeat + 1}: {made} to the first step's line",
              flush=True)
  results = {model: median_figures(runs["ours", model]) for model in models}
  baseline = {model: median_figures(runs["baseline", model]) for model in models} if args.baseline_repo else {}
  print(f"\nbatch {args.batch_size}, JAX on {os.cpu_count()} CPUs, medians of {args.repeats}; ours: {ROOT}"
        + (f"; with {' '.join(gin_flags)}" if gin_flags else "")
        + (f"; baseline: {repos['baseline']}" if baseline else ""))
  print(table(results, baseline))
  if baseline:
    print("\nbaseline\n" + table(baseline, {}))


if __name__ == "__main__":
  main(sys.argv[1:])
