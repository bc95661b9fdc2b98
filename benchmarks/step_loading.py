"""What a start pays for its train step: compiled cold, found in JAX's cache, and loaded untraced (#23).

  python benchmarks/step_loading.py [--families=bert,albert,xlnet,bart] [--sizes=tiny] [--device=cpu]
  python benchmarks/step_loading.py --device=gpu --sizes=large --families=xlnet

For each family and size, our model as benchmarks/train_step.py builds it (the run files' models at
--sizes=large), in one process with an empty compilation cache in a temporary directory:
- init: the state's initialisation (compiled and run), as a fresh start makes it;
- cold: the train step as pretrain.train gets it with nothing cached (`pretrain.step_cache`: its key, the trace
  and lowering, XLA's compile, and writing both caches' entries);
- JAX's cache: what a start found with JAX's persistent cache alone: the trace and lowering, then the load;
- step cache: what a resumed start now pays: the key, then the executable loaded without tracing the model.
JAX's in-memory caches are cleared between them, so each is what a new process would pay.
"""
import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(work):
  start = time.perf_counter()
  value = work()
  return value, time.perf_counter() - start


def measure(name: str, size_name: str, device) -> dict:
  """Seconds of each way to the train step of `name` at `size_name` (the module's docstring)."""
  import jax

  from hf_reference import AdamWSettings, OurTrainer
  from pretrain import compilation_cache, step_cache, steps
  from train_step import LEARNING_RATE, TOTAL_STEPS, WARMUP_STEPS, family_and_lengths
  family, lengths, batch_size = family_and_lengths(name, size_name, device.platform, attention_dropout=None)
  settings = AdamWSettings(LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS)
  with tempfile.TemporaryDirectory(prefix="step_loading_") as cache:
    with compilation_cache.used(cache, model_dir=cache):
      trainer, init = timed(lambda: OurTrainer(family, lengths, batch_size, settings, device).ready())
      setup = trainer.setup
      (_, untraced), cold = timed(lambda: step_cache.compiled_train_step(setup, cache, write=True, warn=print))
      assert not untraced, "an empty cache gave a train step"
      jax.clear_caches()
      lowered, lowering = timed(lambda: steps.lower_train_step(setup))
      _, jax_load = timed(lowered.compile)
      jax.clear_caches()
      (_, untraced), step_load = timed(lambda: step_cache.compiled_train_step(setup, cache, write=False, warn=print))
      if not untraced:
        sys.exit(f"benchmarks/step_loading.py: error: {name} {size_name}: the step cache did not give the train step")
  params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
  return {"model": f"{name} {size_name}", "params": params, "init": init, "cold": cold, "lowering": lowering,
          "jax cache": lowering + jax_load, "step cache": step_load}


def make_parser() -> argparse.ArgumentParser:
  sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), REPO]
  from train_step import DEVICES, FAMILY_NAMES, SIZE_NAMES, names
  parser = argparse.ArgumentParser(prog="python benchmarks/step_loading.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", type=lambda s: names(s, FAMILY_NAMES), default=list(FAMILY_NAMES))
  parser.add_argument("--sizes", type=lambda s: names(s, SIZE_NAMES), default=["tiny"],
                      help=f"comma-separated, of {','.join(SIZE_NAMES)} (default: tiny)")
  parser.add_argument("--device", choices=DEVICES, default="cpu")
  return parser


def main(argv) -> None:
  args = make_parser().parse_args(argv)
  if args.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  device = jax.devices(args.device)[0]
  print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  header = f"{'model':<14}{'params':>9}{'init s':>8}{'cold s':>8}{'JAX cache s':>12}{'(tracing)':>10}" \
           f"{'step cache s':>13}{'vs JAX cache':>13}"
  rows = []
  for size_name in args.sizes:
    for name in args.families:
      rows.append(measure(name, size_name, device))
      print(f"  {rows[-1]['model']}: done", flush=True)
  print(header)
  for r in rows:
    print(f"{r['model']:<14}{r['params'] / 1e6:>8.1f}M{r['init']:>8.1f}{r['cold']:>8.1f}{r['jax cache']:>12.2f}"
          f"{r['lowering']:>10.2f}{r['step cache']:>13.2f}{r['step cache'] / r['jax cache']:>12.2f}x")


if __name__ == "__main__":
  main(sys.argv[1:])
