"""One host's input pipeline for a run, on this machine: how fast it makes that host's batches.

  python benchmarks/input_pipeline.py --gin_file=gin_configs/runs/xlnet_large_v3_512.gin \\
      [--processes=64] [--batches=20] [--step_seconds=1.56] [--gin.KEY=VALUE ...]

Builds the run's data exactly as pretrain.train does on process 0 of `--processes` (its share of
the global batch: its data shards, or XLNet's row streams), then times the first batch
(start-up: reading, tokenizing and filling buffers) and the next `--batches`. With
`--step_seconds` (e.g. the plan's step-time estimate) it prints the examples per second one host
must reach, and the peak RSS of the process. The run file's TRAIN_FILES (unset: the demo corpus)
are read (XLNet: tokenized first, unless TOKEN_DIR is set; that time is not counted); point them at
real data for real figures. A TPU v3 host has 96 vCPUs: compare per-core rates, not totals.
"""
import argparse
import os
import resource
import sys
import time

from pretrain import cli
from pretrain.errors import user_settings

DATA_ARGUMENTS = ("family", "mixture_or_task_name", "task_feature_lengths", "batch_size", "seed", "data_shards")


def make_parser() -> argparse.ArgumentParser:
  """Its flags besides the gin ones (which cli.split_gin_args takes out first)."""
  parser = argparse.ArgumentParser(prog="python benchmarks/input_pipeline.py", description=__doc__,
                                   epilog=cli.gin_flags_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=64, help="hosts that share the global batch")
  parser.add_argument("--batches", type=int, default=20, help="batches timed after the first")
  parser.add_argument("--step_seconds", type=float, help="the step time the pipeline must keep up with")
  return parser


def parse(argv):
  files, bindings, rest = cli.split_gin_args(argv)
  parser = make_parser()
  args = parser.parse_args(rest)
  if not files:
    parser.error("give the run: --gin_file=gin_configs/runs/<run>.gin")
  if args.processes < 1 or args.batches < 1:
    parser.error("--processes and --batches must be >= 1")
  return files, bindings, args


def main(argv) -> None:
  files, bindings, args = parse(argv)
  from pretrain import trainer
  cli.parse_gin(files, bindings)
  run = cli.bound_arguments(trainer.train, DATA_ARGUMENTS)
  family = trainer.fitted_family(run["family"], run["mixture_or_task_name"], run["task_feature_lengths"])
  data = trainer.input_pipeline_for_run(family, run["mixture_or_task_name"], run["task_feature_lengths"],
                                        run["batch_size"], 1, run["seed"], run["data_shards"], process_index=0,
                                        process_count=args.processes)
  reads = ("row streams of one token file, in one pipeline" if data.reads_streams else
           f"{data.shards_per_process} data shard(s) of {data.num_data_shards}")
  print(f"{family.name}: global batch {run['batch_size']}, {args.processes} hosts -> {data.host_batch_size} "
        f"rows per host from {reads}; this machine has {os.cpu_count()} CPUs")
  with user_settings():  # text the objective makes no example of: one line, as pretrain.train says it
    data.check_examples("train")  # XLNet: tokenized ahead, as a pod run's TOKEN_DIR is; not part of the start-up
  start = time.perf_counter()
  batches = data.iterator("train")
  next(batches)
  first = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(args.batches):
    next(batches)
  per_batch = (time.perf_counter() - start) / args.batches
  examples_per_second = data.host_batch_size / per_batch
  peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
  print(f"first batch after {first:.1f} s; then {per_batch:.2f} s per batch = {examples_per_second:.1f} examples/s "
        f"({examples_per_second / os.cpu_count():.1f} per CPU); peak RSS {peak_rss:.2f} GiB")
  if args.step_seconds:
    needed = data.host_batch_size / args.step_seconds
    verdict = "keeps up" if examples_per_second >= needed else f"needs {needed / examples_per_second:.1f}x this speed"
    print(f"a {args.step_seconds} s step needs {needed:.1f} examples/s per host: this machine {verdict}")


if __name__ == "__main__":
  cli.start(sys.argv, make_parser().format_help())
  cli.run("input_pipeline", lambda: main(sys.argv[1:]))
