"""Our attention implementations alone, forward and backward, on one device: time, memory and the Triton kernel's error.

  python benchmarks/attention.py --device=gpu [--implementations=xla,cudnn,triton] [--batch=32] [--length=512]
      [--heads=16] [--head_dim=64] [--rate=0.1] [--repeats=20] [--tilings=128x64/8/2,64x128/4/3]

BERT-Large's self-attention by default (bf16 on a GPU, fp32 on the CPU, where the Triton kernel is interpreted): q, k
and v of [batch, length, heads, head_dim], the last tenth of the keys padding in every other row. Each
implementation runs through `layers.dot_product_attention` as the models call it, jitted with its gradient (a
weighted sum of the output), in training mode: with the probabilities dropped out at --rate, and again at rate 0.
A kernel that takes no dropout (cudnn) is timed at rate 0 only; at --rate XLA's attention would run in its place.
Prints each one's median milliseconds per forward and backward, interleaved, XLA's temporary memory of the
compiled program, and for Triton's kernel the largest error of its output and gradients against XLA's attention
in fp32 given the kernel's own keep-or-drop decisions (`flash_dropout.reference_attention`), relative to the
largest value. On a GPU this is what decides whether the kernel is right there and how much of BERT-Large's
step it can save; benchmarks/train_step.py times whole steps. `--tilings` also times the kernel called directly
with each tiling (flash_dropout.Tiling: queries x keys per tile / warps / stages; the default is
flash_dropout.TILING, untuned), with its error: what chooses the default on a GPU.
"""
import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLEMENTATIONS = ("xla", "cudnn", "triton")
DROPOUT_FREE = ("cudnn",)  # timed at rate 0 only: no dropout inside


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python benchmarks/attention.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
  parser.add_argument("--implementations", default="xla,cudnn,triton",
                      help=f"comma-separated, of {','.join(IMPLEMENTATIONS)} (ones the device cannot run are skipped)")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--rate", type=float, default=0.1, help="attention dropout (BERT's recipe: 0.1)")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--tilings", default="", help="comma-separated QUERIESxKEYS/WARPS/STAGES: the Triton kernel "
                                                     "also timed with each (e.g. 64x64/4/2,128x64/8/2)")
  return parser


def inputs(args, dtype):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models import layers
  rng = np.random.default_rng(0)
  shape = (args.batch, args.length, args.heads, args.head_dim)
  q, k, v, weights = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(4))
  real = np.where(np.arange(args.batch) % 2, args.length - args.length // 10, args.length)
  valid = jnp.asarray(np.arange(args.length)[None, :] < real[:, None])
  return (q, k, v), weights, layers.AttentionMask(query_valid=valid, key_valid=valid), jax.random.key(0)


def weighted_step(attend, weights):
  """jit of (q, k, v) -> (loss, gradients) of `attend`'s output weighted by `weights`, summed."""
  import jax
  import jax.numpy as jnp

  loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * weights.astype(jnp.float32)).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def attention_step(implementation: str, rate: float, weights, mask, rng):
  """weighted_step through layers.dot_product_attention in training mode."""
  from models import layers
  from models.dropout import Dropout
  return weighted_step(lambda q, k, v: Dropout(rate).apply({}, method=lambda dropout: layers.dot_product_attention(
      q, k, v, mask, implementation=implementation, dropout=dropout, deterministic=False), rngs={"dropout": rng}),
      weights)


def tiled_step(tiling, rate: float, weights, mask, rng):
  """weighted_step through the Triton kernel called directly with `tiling`."""
  import jax
  import jax.numpy as jnp

  from models import flash_dropout
  seed, key_valid = jax.random.bits(rng, (2,), jnp.uint32), mask.key_valid.astype(jnp.int32)
  return weighted_step(lambda q, k, v: flash_dropout.attention(q, k, v, key_valid=key_valid, rate=rate, seed=seed,
                                                               tiling=tiling), weights)


def triton_error(qkv, weights, mask, rate: float, tiling) -> float:
  """The Triton kernel's largest error (output and gradients) against XLA's attention in fp32 with its decisions,
  relative to the largest magnitude of each."""
  import jax
  import jax.numpy as jnp

  from models import flash_dropout
  seed = jax.random.bits(jax.random.key(1), (2,), jnp.uint32)
  key_valid = mask.key_valid.astype(jnp.int32)
  reference = lambda q, k, v: flash_dropout.reference_attention(q, k, v, key_valid=key_valid, rate=rate, seed=seed)
  kernel = lambda q, k, v: flash_dropout.attention(q, k, v, key_valid=key_valid, rate=rate, seed=seed, tiling=tiling)
  rows = mask.query_valid[:, :, None, None].astype(jnp.float32)  # padded queries' outputs are read by nobody

  def outputs(attend):
    out, vjp = jax.vjp(lambda *x: attend(*x).astype(jnp.float32) * rows, *qkv)
    return (out, *vjp(weights.astype(jnp.float32)))

  ours, theirs = jax.jit(lambda: outputs(kernel))(), jax.jit(lambda: outputs(reference))()
  return max(float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max()) for a, b in zip(ours, theirs))


def print_table(times: dict, memory: dict) -> None:
  """A row per (implementation, dropout rate): median milliseconds and XLA's temporary memory in MiB."""
  print(f"{'implementation':<24}{'dropout':>8}{'ms':>10}{'temp MiB':>10}")
  for (name, rate), measured in times.items():
    print(f"{name:<24}{rate:>8g}{1e3 * statistics.median(measured):>10.2f}{memory[(name, rate)]:>10.1f}")


def main(argv=None) -> None:
  args = make_parser().parse_args(argv)
  if args.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp

  from models import flash_dropout, layers
  device = jax.devices(args.device)[0]
  dtype = jnp.float32 if args.device == "cpu" else jnp.bfloat16
  requested = [name.strip() for name in args.implementations.split(",") if name.strip()]
  unknown = [name for name in requested if name not in IMPLEMENTATIONS]
  if unknown:
    make_parser().error(f"--implementations: unknown {unknown}; expected some of {', '.join(IMPLEMENTATIONS)}")
  try:
    tilings = [flash_dropout.Tiling.parse(text) for text in args.tilings.split(",") if text.strip()]
  except ValueError as e:
    make_parser().error(f"--tilings: {e}")
  runnable = [name for name in requested if not layers.attention_refusal(name, device)]
  for name in set(requested) - set(runnable):
    print(f"skipping {name}: {layers.attention_refusal(name, device)}")
  qkv, weights, mask, rng = inputs(args, dtype)
  rates = list(dict.fromkeys((args.rate, 0.0)))
  variants = [(name, rate) for rate in rates for name in runnable if not (rate and name in DROPOUT_FREE)]
  if "triton" not in runnable:
    tilings = []
  tiled = {(f"triton {tiling}", rate): tiling for rate in rates for tiling in tilings}
  print(f"{device.device_kind}; jax {jax.__version__}; q, k, v {args.batch}x{args.length}x{args.heads}x"
        f"{args.head_dim} {jnp.dtype(dtype).name}; forward and backward, medians of {args.repeats}", flush=True)
  steps, memory = {}, {}
  for variant in variants + list(tiled):
    step = (tiled_step(tiled[variant], variant[1], weights, mask, rng) if variant in tiled
            else attention_step(*variant, weights, mask, rng))
    compiled = step.lower(*qkv).compile()
    memory[variant] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(compiled(*qkv))
    steps[variant] = compiled
  times = {variant: [] for variant in steps}
  for _ in range(args.repeats):
    for variant, compiled in steps.items():
      began = time.perf_counter()
      jax.block_until_ready(compiled(*qkv))
      times[variant].append(time.perf_counter() - began)
  print_table(times, memory)
  for tiling in dict.fromkeys([flash_dropout.TILING, *tilings]) if "triton" in runnable else ():
    for rate in rates:
      error = triton_error(qkv, weights, mask, rate, tiling)
      print(f"triton {tiling} at dropout {rate:g}: largest error against XLA's attention in fp32 with the same "
            f"decisions {error:.2e} (relative)")


if __name__ == "__main__":
  sys.path.insert(0, REPO)  # models/ from the repository root; jax is all this needs (no TensorFlow, no gin)
  main(sys.argv[1:])
