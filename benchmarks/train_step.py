"""Our training step against HuggingFace transformers' PyTorch one, on this machine's CPU.

  python benchmarks/train_step.py [--families=bert,albert,xlnet,bart] [--sizes=tiny,small] [--repeats=10]
  python benchmarks/train_step.py --families=xlnet --sizes=small --repeats=20

For each family and size, builds our model exactly as pretrain.train does (the family fitted to a
32000-piece vocabulary, `steps.make_setup` on a one-device CPU mesh, fp32, the default AdamW of
gin_configs/runs/pretrain.gin with clipping at 1.0, `steps.jit_train_step`) and the transformers model
of the same dimensions, built from its config through `pretrain.registry`'s mapping and loaded with our
initial weights (no download): BertForPreTraining (MLM + NSP), AlbertForPreTraining (MLM + SOP),
XLNetLMHeadModel (permutation LM: perm_mask, target_mapping, bi_data, memory) and
BartForConditionalGeneration (denoising seq2seq), trained with torch.optim.AdamW (decaying the weights
ours decays), the gradients clipped to norm 1.0 and the same warmup and linear decay, on the loss our
family computes (benchmarks/hf_reference.py builds both sides). Both take the same random batch of the
objective's shapes, in train mode (dropout on), and a step is forward, backward and the optimizer's
update.

After `--warmup` steps of each (ours compiles in its first), the steps are timed interleaved, ours then
theirs, `--repeats` times; prints the median tokens per second of each (input tokens of a batch:
encoder plus decoder for BART) and the ratio ours / HF. Torch uses as many threads as the machine has
CPUs; XLA's CPU backend uses its own pool of the same size.

Sizes: tiny = hidden 128, 2 layers (BART 2 + 2), 2 heads, sequence 128, batch 16; small = hidden 256,
4 layers (BART 4 + 4), 4 heads, sequence 256, batch 8. Feed-forward 4 x hidden, ALBERT's embedding
hidden / 2; MLM predicts 20 (40) positions; XLNet reuses half the sequence, predicts 21 (42) positions
and carries a memory of 3/4 of the sequence (96, 192) from step to step, in both models.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings

from pretrain import cli

FAMILY_NAMES = ("bert", "albert", "xlnet", "bart")
VOCAB_SIZE = 32000
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 1e-4, 10, 10000  # the schedule's shape only; no run ends


@dataclasses.dataclass(frozen=True)
class Size:
  hidden: int
  layers: int
  heads: int
  seq: int
  batch: int


SIZES = {"tiny": Size(hidden=128, layers=2, heads=2, seq=128, batch=16),
         "small": Size(hidden=256, layers=4, heads=4, seq=256, batch=8)}


def names(text: str, known) -> list:
  chosen = [name.strip() for name in text.split(",") if name.strip()]
  unknown = [name for name in chosen if name not in known]
  if unknown or not chosen:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(known)}")
  return chosen


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python benchmarks/train_step.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", type=lambda s: names(s, FAMILY_NAMES), default=list(FAMILY_NAMES),
                      help=f"comma-separated, of {','.join(FAMILY_NAMES)} (default: all)")
  parser.add_argument("--sizes", type=lambda s: names(s, tuple(SIZES)), default=list(SIZES),
                      help=f"comma-separated, of {','.join(SIZES)} (default: both)")
  parser.add_argument("--repeats", type=int, default=10, help="timed steps of each, interleaved; medians are printed")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (ours compiles in the first)")
  return parser


# ----------------------------------------------------------------------------- one family at one size


def family_and_lengths(name: str, size: Size):
  """(our family with the run's vocabulary left unset, its objective, TASK_FEATURE_LENGTHS)."""
  from models.albert import AlbertConfig
  from models.bart import BartConfig
  from models.bert import BertConfig
  from models.xlnet import XLNetConfig
  from pretrain.families.albert import AlbertFamily
  from pretrain.families.bart import BartFamily
  from pretrain.families.bert import BertFamily
  from pretrain.families.xlnet import XLNetFamily
  h, layers, heads, seq = size.hidden, size.layers, size.heads, size.seq
  mlm_lengths = {"input_ids": seq, "masked_positions": 20 * seq // 128}
  if name == "bert":
    config = BertConfig(vocab_size=None, hidden_size=h, num_layers=layers, num_heads=heads, mlp_dim=4 * h)
    return BertFamily(config=config), "bert_mlm_nsp", mlm_lengths
  if name == "albert":
    config = AlbertConfig(vocab_size=None, embedding_size=h // 2, hidden_size=h, num_layers=layers, num_heads=heads,
                          mlp_dim=4 * h)
    return AlbertFamily(config=config), "albert_mlm_sop", mlm_lengths
  if name == "xlnet":
    config = XLNetConfig(vocab_size=None, d_model=h, n_layer=layers, n_head=heads, d_head=h // heads, d_inner=4 * h,
                         mem_len=3 * seq // 4, bi_data=True)
    return XLNetFamily(config=config), "xlnet_plm", {"input_ids": seq, "target_ids": 21 * seq // 128,
                                                     "reuse_len": seq // 2}
  config = BartConfig(vocab_size=None, d_model=h, encoder_layers=layers, decoder_layers=layers, num_heads=heads,
                      ffn_dim=4 * h, max_position_embeddings=512)
  return BartFamily(config=config), "bart_denoising", {"encoder_input_ids": seq, "decoder_input_ids": seq}


def random_batch(family, batch_size: int, lengths, rng):
  """A batch of the objective's features (numpy, the pipeline's dtypes): random ordinary pieces, no padding,
  distinct masked positions, and for XLNet a factorisation order over its targets."""
  import numpy as np

  from data_pipelines.vocab import FIRST_NORMAL_ID
  from pretrain.hf_mappings.bart import EOS_ID
  shapes = family.feature_shapes(batch_size, lengths)
  batch = {}
  for name, spec in shapes.items():
    if name.endswith("_ids") and name != "segment_ids":
      batch[name] = rng.integers(FIRST_NORMAL_ID, VOCAB_SIZE, spec.shape)
    elif name.endswith("_weights"):
      batch[name] = np.ones(spec.shape)
    elif name.endswith("_label"):
      batch[name] = rng.integers(0, 2, spec.shape)
  seq = next(v for k, v in lengths.items() if k.endswith("input_ids"))
  if "segment_ids" in shapes:  # two segments; XLNet's last position is its <cls>, segment 2
    batch["segment_ids"] = np.tile((np.arange(seq) >= seq // 2).astype(int), (batch_size, 1))
    if family.name == "xlnet":
      batch["segment_ids"][:, -1] = 2
  if "masked_positions" in shapes:
    predictions = shapes["masked_positions"].shape[1]
    batch["masked_positions"] = np.stack([np.sort(rng.choice(np.arange(1, seq - 1), predictions, replace=False))
                                          for _ in range(batch_size)])
  if "decoder_input_ids" in shapes:
    batch["decoder_input_ids"][:, 0] = EOS_ID  # fairseq's decoder start
  if "perm_mask" in shapes:
    predictions = shapes["target_mapping"].shape[1]
    batch["perm_mask"] = np.zeros(shapes["perm_mask"].shape)
    batch["target_mapping"] = np.zeros(shapes["target_mapping"].shape)
    for row in range(batch_size):
      targets = np.sort(rng.choice(seq - 1, predictions, replace=False))
      order = np.full(seq, -1)
      order[targets] = rng.permutation(predictions)
      # i may not see j if j is a target no earlier than i in the order (as pretrain.registry's XLNet check).
      batch["perm_mask"][row] = (order[:, None] <= order[None, :]) & (order[None, :] >= 0)
      batch["target_mapping"][row, np.arange(predictions), targets] = 1.0
  return {name: batch[name].astype(spec.dtype) for name, spec in shapes.items()}


def ours_and_theirs(family, lengths, batch_size: int, numpy_batch, device):
  """Our step as pretrain.train builds and runs it, and transformers' from the same initial weights: two
  functions that each run one step on the batch and give its loss; ours has `.params`."""
  from hf_reference import AdamWSettings, HFTrainer, OurTrainer
  settings = AdamWSettings(LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS)  # the defaults of gin_configs/runs/pretrain.gin
  our_trainer = OurTrainer(family, lengths, batch_size, settings, device)
  their_trainer = HFTrainer(family, batch_size, settings, our_trainer.numpy_params())
  batch = our_trainer.device_batch(numpy_batch)
  our_step = lambda: our_trainer.step(batch)["loss"]
  our_step.params = our_trainer.num_params
  return our_step, lambda: their_trainer.step(numpy_batch)["loss"]


def compare(name: str, size_name: str, args, device) -> dict:
  import math

  import numpy as np

  from pretrain import steps
  size = SIZES[size_name]
  family, objective, lengths = family_and_lengths(name, size)
  family = family.fit_to_data(VOCAB_SIZE, objective, lengths)  # as trainer.fitted_family does with the task
  numpy_batch = random_batch(family, size.batch, lengths, np.random.default_rng(0))
  our_step, their_step = ours_and_theirs(family, lengths, size.batch, numpy_batch, device)
  start = time.perf_counter()
  our_step()
  compile_seconds = time.perf_counter() - start
  for _ in range(args.warmup - 1):
    our_step()
  for _ in range(args.warmup):
    their_step()
  our_times, their_times, losses = [], [], []
  for _ in range(args.repeats):
    start = time.perf_counter()
    ours_loss = our_step()
    our_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    their_loss = their_step()
    their_times.append(time.perf_counter() - start)
    losses.append((ours_loss, their_loss))
  if not all(math.isfinite(x) for pair in losses for x in pair):
    raise RuntimeError(f"{name} {size_name}: a loss is not finite: {losses}")
  tokens = steps.tokens_per_batch(size.batch, lengths)
  ours_s, theirs_s = statistics.median(our_times), statistics.median(their_times)
  return {"family": name, "size": size_name, "params": our_step.params, "tokens": tokens, "ours_s": ours_s,
          "theirs_s": theirs_s, "compile_s": compile_seconds, "losses": losses[-1]}


def main():
  args = make_parser().parse_args()
  if args.repeats < 1 or args.warmup < 1:
    make_parser().error("--repeats and --warmup must be >= 1")
  import jax
  import torch
  # The trainer enters its mesh the same way; JAX's advice to use jax.set_mesh is the trainer's business.
  warnings.filterwarnings("ignore", message="`with mesh:` context manager has been deprecated")
  torch.set_num_threads(os.cpu_count())
  device = jax.devices("cpu")[0]
  print(f"{os.cpu_count()} CPUs; torch {torch.__version__} with {torch.get_num_threads()} threads; "
        f"jax {jax.__version__} on one {device.platform} device; fp32; {args.repeats} timed steps of each, "
        f"interleaved, after {args.warmup} untimed", flush=True)
  rows = []
  for size_name in args.sizes:
    for name in args.families:
      row = compare(name, size_name, args, device)
      rows.append(row)
      print(f"  {name} {size_name}: {row['params'] / 1e6:.2f}M params, tokens/batch {row['tokens']}, compile "
            f"{row['compile_s']:.1f} s, last losses ours {row['losses'][0]:.3f} HF {row['losses'][1]:.3f}", flush=True)
  header = f"{'family':<8}{'size':<7}{'ours ms':>9}{'HF ms':>9}{'ours tok/s':>12}{'HF tok/s':>11}{'ours/HF':>9}"
  print(header)
  for r in rows:
    print(f"{r['family']:<8}{r['size']:<7}{1e3 * r['ours_s']:>9.1f}{1e3 * r['theirs_s']:>9.1f}"
          f"{r['tokens'] / r['ours_s']:>12,.0f}{r['tokens'] / r['theirs_s']:>11,.0f}"
          f"{r['theirs_s'] / r['ours_s']:>8.2f}x")


if __name__ == "__main__":
  os.environ["JAX_PLATFORMS"] = "cpu"  # the comparison is on the CPU, whatever accelerator is attached
  cli.start(sys.argv, make_parser().format_help())
  # benchmarks/ is not a package: its scripts import their shared module by name, from their own directory.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
