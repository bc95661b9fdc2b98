"""What verifying a checkpoint costs: the checksums of a train state against saving and restoring it.

  python benchmarks/checkpoint_checksums.py [--millions=100] [--repeats=3]
  python benchmarks/checkpoint_checksums.py --millions=20 --repeats=5

Builds a state of float32 arrays shaped like a transformer's (params plus Adam's two moments, so
3 x `--millions` million numbers), then times, interleaved, `checkpoints.checksums` (one pass over
the arrays on the devices: what a save and a restore each add) and an orbax save and restore of the
same state to a local temporary directory. Prints medians and the ratio.
"""
import argparse
import statistics
import sys
import tempfile
import time

from pretrain import cli


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python benchmarks/checkpoint_checksums.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--millions", type=int, default=100, help="millions of parameters")
  parser.add_argument("--repeats", type=int, default=3, help="timings of each, interleaved; the medians are printed")
  return parser


def state_of(millions: int):
  """Layers of [1024, 4096] float32 matrices (4M numbers each), three copies: params, mu, nu."""
  import jax
  import jax.numpy as jnp
  layers = max(1, millions // 4)
  keys = jax.random.split(jax.random.PRNGKey(0), layers)
  params = {f"layer_{i}": jax.random.normal(k, (1024, 4096)) for i, k in enumerate(keys)}
  return {"params": params, "mu": jax.tree.map(jnp.zeros_like, params), "nu": jax.tree.map(jnp.ones_like, params)}


def main():
  import jax
  import orbax.checkpoint as ocp

  from pretrain import checkpoints
  args = make_parser().parse_args()
  state = state_of(args.millions)
  numbers = sum(x.size for x in jax.tree.leaves(state))
  checkpoints.checksums(state)  # compiles
  sums, round_trips = [], []
  with tempfile.TemporaryDirectory() as directory:
    manager = checkpoints.make_manager(directory, max_to_keep=1, async_save=False)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    for repeat in range(args.repeats):
      start = time.perf_counter()
      checkpoints.checksums(state)
      sums.append(time.perf_counter() - start)
      start = time.perf_counter()
      manager.save(repeat, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
      manager.wait_until_finished()
      restored = manager.restore(repeat, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
      jax.block_until_ready(restored)
      round_trips.append(time.perf_counter() - start)
    manager.close()
  checksum, round_trip = statistics.median(sums), statistics.median(round_trips)
  print(f"state: {numbers / 1e6:.0f}M float32 numbers ({numbers * 4 / 2**30:.2f} GiB) on {jax.devices()[0].platform}")
  print(f"{'checksums (median)':<32}{checksum:>8.2f} s")
  print(f"{'orbax save + restore (median)':<32}{round_trip:>8.2f} s")
  print(f"{'verifying costs':<32}{100 * 2 * checksum / round_trip:>7.1f} % of a save + restore (one pass each)")


if __name__ == "__main__":
  cli.start(sys.argv, make_parser().format_help())
  main()
