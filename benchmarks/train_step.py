"""Our training step against HuggingFace transformers' PyTorch one, on one CPU, GPU or TPU.

  python benchmarks/train_step.py [--families=bert,albert,xlnet,bart] [--sizes=tiny,small] [--repeats=10]
  python benchmarks/train_step.py --device=gpu --sizes=large --attention=xla,auto
  python benchmarks/train_step.py --device=gpu --sizes=large --families=bert --attention_dropout=0
  python benchmarks/train_step.py --device=gpu --sizes=large --families=bert --attention=auto,triton

For each family and size, builds our model exactly as pretrain.train does (the family fitted to a
32000-piece vocabulary, `steps.make_setup` on a one-device mesh, the default AdamW of
gin_configs/runs/pretrain.gin with clipping at 1.0, `steps.jit_train_step`) and the transformers model
of the same dimensions, built from its config through `pretrain.registry`'s mapping and loaded with our
initial weights (no download): BertForPreTraining (MLM + NSP), AlbertForPreTraining (MLM + SOP),
XLNetLMHeadModel (permutation LM: perm_mask, target_mapping, bi_data, memory) and
BartForConditionalGeneration (denoising seq2seq), trained with torch.optim.AdamW (decaying the weights
ours decays), the gradients clipped to norm 1.0 and the same warmup and linear decay, on the loss our
family computes (benchmarks/hf_reference.py builds both sides). Both take the same random batch of the
objective's shapes, in train mode (dropout on), and a step is forward, backward and the optimizer's
update.

On the CPU both compute in fp32. On a GPU (`--device=gpu`) ours computes in bf16 with fp32 parameters, as
the run files do, and transformers runs with bf16 autocast, fused AdamW and its default attention for
the model (sdpa, or eager where it has none: XLNet), named in the table. `--attention` lists our
attention implementations to time side by side (models/layers.py: xla, cudnn, pallas, splash, triton, auto);
of the fused kernels only triton (models/flash_dropout.py) drops out attention probabilities, so where the
model drops them out in training (BERT: 0.1) our step runs XLA's attention for the others;
`--attention_dropout=0` sets that rate to 0 on both sides, to time them there too.

`--prng_impl` lists the random-key implementations of our dropout to time side by side (JAX's default
threefry2x32; rbg draws its bits with XLA's RngBitGenerator), and `--dropout_masks` the ways of drawing its
masks (models/dropout.py: bernoulli, packed, hashed; auto is the chip's), and `--gelu_gradient` what the GELU
keeps for the backward pass (models/layers.py: formula, autodiff). `--hf_compile` adds transformers' model
under torch.compile (inductor, or the backend that `--hf_compile=BACKEND` names) as another peer (its first
warm-up step compiles it; the ratios stay against the plain one, and a line gives ours against it).
`--profile=N` then traces N steps of each of ours and prints their device time by model source, layers folded
(pretrain.op_profile); `--profile_dir` keeps each trace and compiled program there, for
`python -m pretrain.op_profile` or TensorBoard.

After `--warmup` steps of each (ours compiles ahead of its first), the steps are timed interleaved,
ours then theirs, `--repeats` samples of `--steps_per_sample` steps each. Within a sample each side runs
as a training loop does, pretrain.train's included: a step's loss is read once the next step is
dispatched, so the device has the next step queued while the host reads (with `--steps_per_sample=1`
each step is waited for before the next is dispatched, and the device idles meanwhile). Prints the
median step time and tokens per second of each (input tokens of a batch: encoder plus decoder for BART),
the ratio ours / HF, MFU (model FLOPs per step as `pretrain.plan` counts them, over the device's peak,
for both sides), peak memory (ours: XLA's footprint of the compiled step; HF: torch's maximum allocated
during its steps) and our initialisation and compile times. Torch uses as many threads as the machine has
CPUs; XLA's CPU backend uses its own pool of the same size.

Sizes: tiny = hidden 128, 2 layers (BART 2 + 2), 2 heads, sequence 128, batch 16; small = hidden 256,
4 layers (BART 4 + 4), 4 heads, sequence 256, batch 8. Feed-forward 4 x hidden, ALBERT's embedding
hidden / 2; MLM predicts 20 (40) positions; XLNet reuses half the sequence, predicts 21 (42) positions
and carries a memory of 3/4 of the sequence (96, 192) from step to step, in both models. large = the run
files' models (gin_configs/models/bert_large.gin, albert_xxlarge.gin, xlnet_large.gin, bart_large.gin)
at sequence 512 with their objectives' settings (BERT and ALBERT predict 77 positions, XLNet 85 with a
memory of 384), batch 32 (BERT), 8 (ALBERT-xxlarge) and 16 (XLNet, BART).
"""
import argparse
import dataclasses
import math
import os
import re
import statistics
import sys
import time
from typing import Optional

FAMILY_NAMES = ("bert", "albert", "xlnet", "bart")
DEVICES = ("cpu", "gpu", "tpu")
VOCAB_SIZE = 32000
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 1e-4, 10, 10000  # the schedule's shape only; no run ends
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Size:
  hidden: int
  layers: int
  heads: int
  seq: int
  batch: int


SIZES = {"tiny": Size(hidden=128, layers=2, heads=2, seq=128, batch=16),
         "small": Size(hidden=256, layers=4, heads=4, seq=256, batch=8)}
# The run files' models: (model gin, objective gin, TASK_FEATURE_LENGTHS over the objective's, batch).
LARGE = {"bert": ("bert_large", "bert_mlm_nsp", {"input_ids": 512, "masked_positions": 77}, 32),
         "albert": ("albert_xxlarge", "albert_mlm_sop", None, 8),
         "xlnet": ("xlnet_large", "xlnet_plm", None, 16),
         "bart": ("bart_large", "bart_denoising", None, 16)}
SIZE_NAMES = tuple(SIZES) + ("large",)
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")  # jax_default_prng_impl's; the first is JAX's default


def names(text: str, known) -> list:
  chosen = [name.strip() for name in text.split(",") if name.strip()]
  unknown = [name for name in chosen if name not in known]
  if unknown or not chosen:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(known)}")
  return chosen


def torch_compile_backend(name: str) -> str:
  """A backend of torch.compile, checked before minutes of our side's compiling, not at transformers' turn."""
  import torch
  known = torch._dynamo.list_backends(exclude_tags=())
  if name not in known:
    raise argparse.ArgumentTypeError(f"{name!r}: not a torch.compile backend here (torch has "
                                     f"{', '.join(torch._dynamo.list_backends())}, and aot_eager and eager to debug)")
  return name


def make_parser() -> argparse.ArgumentParser:
  from models.dropout import DROPOUT_MASKS
  from models.layers import ATTENTION_IMPLEMENTATIONS, GELU_GRADIENTS
  parser = argparse.ArgumentParser(prog="python benchmarks/train_step.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", type=lambda s: names(s, FAMILY_NAMES), default=list(FAMILY_NAMES),
                      help=f"comma-separated, of {','.join(FAMILY_NAMES)} (default: all)")
  parser.add_argument("--sizes", type=lambda s: names(s, SIZE_NAMES), default=list(SIZES),
                      help=f"comma-separated, of {','.join(SIZE_NAMES)} (default: tiny,small)")
  parser.add_argument("--device", choices=DEVICES, default="cpu", help="where both sides run (default: cpu)")
  parser.add_argument("--attention", type=lambda s: names(s, ATTENTION_IMPLEMENTATIONS), default=["auto"],
                      help="our attention implementations to time side by side (default: auto)")
  parser.add_argument("--attention_dropout", type=float, default=None,
                      help="the attention-probability dropout of BERT, ALBERT and BART on both sides (default: "
                           "the model's)")
  parser.add_argument("--prng_impl", type=lambda s: names(s, PRNG_IMPLS), default=[PRNG_IMPLS[0]],
                      help="the random-key implementations of our dropout to time side by side (default: "
                           f"{PRNG_IMPLS[0]})")
  parser.add_argument("--dropout_masks", type=lambda s: names(s, DROPOUT_MASKS), default=["auto"],
                      help="how our dropout draws its masks (models/dropout.py), side by side (default: auto)")
  parser.add_argument("--gelu_gradient", type=lambda s: names(s, GELU_GRADIENTS), default=["formula"],
                      help="how our GELU is differentiated (models/layers.py), side by side (default: formula)")
  parser.add_argument("--hf_compile", nargs="?", const="inductor", type=torch_compile_backend, metavar="BACKEND",
                      help="also time transformers' model under torch.compile, with torch's default backend "
                           "(inductor) or the one named, e.g. --hf_compile=aot_eager (it compiles in its first "
                           "warm-up step, whose time is its compile figure)")
  parser.add_argument("--repeats", type=int, default=10,
                      help="timed samples of each, interleaved; the medians of their mean step times are printed")
  parser.add_argument("--steps_per_sample", type=int, default=4,
                      help="steps in a timed sample, each step's loss read once the next is dispatched, as "
                           "pretrain.train reads it (default 4; 1: each step waited for before the next)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (ours compiles before them)")
  parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                      help="then trace this many steps of each of ours and print where their device time goes, by "
                           "model source (pretrain.op_profile)")
  parser.add_argument("--profile_dir", help="keep each profiled trace and its compiled program's text in this "
                                            "(existing) directory")
  return parser


# ----------------------------------------------------------------------------- one family at one size


def sized_family(name: str, size: Size):
  """(our family with the run's vocabulary left unset, TASK_FEATURE_LENGTHS) of a tiny or small size."""
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
    return BertFamily(config=config), mlm_lengths
  if name == "albert":
    config = AlbertConfig(vocab_size=None, embedding_size=h // 2, hidden_size=h, num_layers=layers, num_heads=heads,
                          mlp_dim=4 * h)
    return AlbertFamily(config=config), mlm_lengths
  if name == "xlnet":
    config = XLNetConfig(vocab_size=None, d_model=h, n_layer=layers, n_head=heads, d_head=h // heads, d_inner=4 * h,
                         mem_len=3 * seq // 4, bi_data=True)
    return XLNetFamily(config=config), {"input_ids": seq, "target_ids": 21 * seq // 128, "reuse_len": seq // 2}
  config = BartConfig(vocab_size=None, d_model=h, encoder_layers=layers, decoder_layers=layers, num_heads=heads,
                      ffn_dim=4 * h, max_position_embeddings=512)
  return BartFamily(config=config), {"encoder_input_ids": seq, "decoder_input_ids": seq}


def run_file_family(name: str):
  """(family, TASK_FEATURE_LENGTHS, batch) of the run files' large model, read from its gin files."""
  import copy

  import gin
  model_file, objective_file, lengths, batch = LARGE[name]
  gin.clear_config()
  gin.add_config_file_search_path(REPO)
  gin.parse_config_files_and_bindings(
      [f"gin_configs/models/{model_file}.gin", f"gin_configs/objectives/{objective_file}.gin"], [])
  # gin calls a @reference's configurable (a %MACRO's too) as it copies it
  family = copy.deepcopy(gin.query_parameter("%FAMILY"))
  return family, lengths or copy.deepcopy(gin.query_parameter("%TASK_FEATURE_LENGTHS")), batch


def family_and_lengths(name: str, size_name: str, device: str, attention_dropout):
  """(family fitted to its vocabulary (tiny and small: 32000 pieces), in the device's compute dtype,
  TASK_FEATURE_LENGTHS, batch size)."""
  import jax.numpy as jnp
  if size_name == "large":
    family, lengths, batch = run_file_family(name)
  else:
    (family, lengths), batch = sized_family(name, SIZES[size_name]), SIZES[size_name].batch
  changes = {"dtype": jnp.float32 if device == "cpu" else jnp.bfloat16}
  if attention_dropout is not None and hasattr(family.config, "attention_dropout"):
    changes["attention_dropout"] = attention_dropout
  family = dataclasses.replace(family, config=dataclasses.replace(family.config, **changes))
  return family.fitted(family.config.vocab_size or VOCAB_SIZE, lengths), lengths, batch


def random_batch(family, batch_size: int, lengths, rng):
  """A batch of the objective's features (numpy, the pipeline's dtypes): random ordinary pieces, no padding,
  distinct masked positions, and for XLNet a factorisation order over its targets."""
  import numpy as np

  from data_pipelines.pieces import FIRST_NORMAL_ID
  from pretrain.hf_mappings.bart import EOS_ID
  shapes = family.feature_shapes(batch_size, lengths)
  batch = {}
  for name, spec in shapes.items():
    if name.endswith("_ids") and name != "segment_ids":
      batch[name] = rng.integers(FIRST_NORMAL_ID, family.config.vocab_size, spec.shape)
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


def with_choices(family, attention: str, dropout_masks: str, gelu_gradient: str):
  """The family with our model's attention, dropout masks and GELU gradient set (XLNet's relative attention takes
  auto, xla and triton)."""
  return dataclasses.replace(family, config=dataclasses.replace(family.config, dropout_masks=dropout_masks,
                                                                attention_implementation=attention,
                                                                gelu_gradient=gelu_gradient))


def attention_label(trainer, requested: str) -> str:
  """What our step's attention computes with in training, e.g. 'auto=cudnn' or 'cudnn (xla: dropout)'."""
  from models import flash_dropout, layers
  config = trainer.setup.family.config
  chosen = config.attention_implementation
  label = chosen if requested == chosen else f"{requested}={chosen}"
  seq = max(s.shape[1] for s in trainer.setup.batch_shapes.values() if len(s.shape) == 2)
  if hasattr(config, "d_head"):  # XLNet: the content stream's seq queries over mem_len + seq keys in the kernel
    tiles = chosen == "xla" or flash_dropout.applies(seq, config.mem_len + seq, config.d_head)
    return f"{label} (relative{'' if tiles else ', trains with xla'})"
  rate = getattr(config, "attention_dropout_rate", getattr(config, "attention_dropout", 0.0))
  if chosen != "xla" and not layers.fused_attention_applies(chosen, dtype=config.dtype, head_dim=config.head_dim,
                                                            query_length=seq, key_length=seq, dropout_rate=rate,
                                                            deterministic=False):
    label += " (trains with xla)"
  return label


@dataclasses.dataclass
class Side:
  """One trainer of the comparison and what was measured of it."""
  label: str
  dispatch: object  # () -> the step's loss on the device, not waited for
  read: object  # that loss -> float, once its step has finished
  params: int = 0
  init_s: float = math.nan
  compile_s: float = math.nan
  memory_bytes: float = math.nan
  times: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)
  trainer: object = None
  compiles_on_first_step: bool = False  # its first call's time is its compile figure

  def step(self) -> float:
    """One step, waited for: its loss."""
    return self.read(self.dispatch())

  def timed(self, steps: int) -> None:
    """Times `steps` steps as pretrain.train's loop runs them: each step's loss is read once the next step is
    dispatched, so that the device has the next step queued while the host waits (with 1, each step is waited
    for before the next starts). Keeps the mean time per step, and every loss."""
    start, unread = time.perf_counter(), None
    for _ in range(steps):
      loss = self.dispatch()
      if unread is not None:
        self.losses.append(self.read(unread))
      unread = loss
    self.losses.append(self.read(unread))
    self.times.append((time.perf_counter() - start) / steps)


def our_side(family, lengths, batch_size: int, numpy_batch, device, requested: str, prng_impl: str,
             dropout_masks: str, gelu_gradient: str) -> Side:
  """Our step as pretrain.train builds it, compiled ahead of its first call, its random keys (dropout's) of
  `prng_impl`, its dropout masks drawn as `dropout_masks` says, its GELU differentiated by `gelu_gradient`."""
  import jax
  from hf_reference import AdamWSettings, OurTrainer
  jax.config.update("jax_default_prng_impl", prng_impl)
  settings = AdamWSettings(LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS)  # the defaults of gin_configs/runs/pretrain.gin
  start = time.perf_counter()
  trainer = OurTrainer(with_choices(family, requested, dropout_masks, gelu_gradient), lengths, batch_size, settings,
                       device)
  init_s = time.perf_counter() - start
  print(f"  ours {requested} ({prng_impl}, {dropout_masks} dropout masks, GELU by {gelu_gradient}): initialised in "
        f"{init_s:.1f} s; compiling the step", flush=True)
  batch = trainer.device_batch(numpy_batch)
  start = time.perf_counter()
  memory = trainer.compile(batch)
  label = (attention_label(trainer, requested) + ("" if prng_impl == PRNG_IMPLS[0] else f" {prng_impl}")
           + ("" if dropout_masks == "auto" else f" {dropout_masks}")
           + ("" if gelu_gradient == "formula" else f" gelu={gelu_gradient}"))
  return Side(f"ours {label}", lambda: trainer.dispatch(batch)["loss"], lambda loss: float(jax.device_get(loss)),
              trainer.num_params, init_s, time.perf_counter() - start, memory, trainer=trainer)


def their_side(family, batch_size: int, numpy_batch, params, device: str, compile_backend: Optional[str]) -> Side:
  """transformers' step from the same initial weights, its model under torch.compile with `compile_backend` if
  one is given; on a GPU, its peak memory is torch's maximum allocated over its steps."""
  import torch
  from hf_reference import AdamWSettings, HFTrainer
  settings = AdamWSettings(LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS)
  trainer = HFTrainer(family, batch_size, settings, params, device="cuda" if device == "gpu" else "cpu",
                      compile_backend=compile_backend)
  suffix = {None: "", "inductor": " compiled"}.get(compile_backend, f" compiled {compile_backend}")
  batch = trainer.device_batch(numpy_batch)  # placed once, as ours is
  side = Side(f"HF {trainer.attention}{suffix}", None, lambda loss: loss.item(), trainer.num_params, memory_bytes=0,
              compiles_on_first_step=compile_backend is not None)

  def dispatch():
    if trainer.on_gpu:
      torch.cuda.reset_peak_memory_stats()
    loss = trainer.dispatch(batch)["loss"]
    if trainer.on_gpu:  # torch allocates as it dispatches: the step's peak is known without waiting for it
      side.memory_bytes = max(side.memory_bytes, torch.cuda.max_memory_allocated())
    return loss

  side.dispatch = dispatch
  if not trainer.on_gpu:
    side.memory_bytes = math.nan
  return side


def profile(side: Side, steps: int, step_seconds: float, keep_as) -> None:
  """Traces `steps` more steps of our side and prints its device time by source; `keep_as` (a path
  prefix), if given, keeps the trace and the compiled program as KEEP_AS.xplane.pb and KEEP_AS.hlo.txt."""
  import glob
  import shutil
  import tempfile

  import jax

  from pretrain import op_profile
  with tempfile.TemporaryDirectory(prefix="train_step_trace_") as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(steps):
      side.step()
    jax.profiler.stop_trace()
    trace = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    program = side.trainer.program_text()
    text = op_profile.summary(trace, program, steps, step_seconds=step_seconds)
    if keep_as:
      shutil.copy(trace, keep_as + ".xplane.pb")
  if keep_as:
    with open(keep_as + ".hlo.txt", "w") as f:
      f.write(program)
  print(f"  {side.label}, {steps} steps traced:", flush=True)
  print(text, flush=True)


def compare(name: str, size_name: str, args, device) -> list:
  """Our variants and HF's, timed interleaved; a row of figures for each."""
  import numpy as np

  from pretrain import roofline, steps
  family, lengths, batch_size = family_and_lengths(name, size_name, args.device, args.attention_dropout)
  numpy_batch = random_batch(family, batch_size, lengths, np.random.default_rng(0))
  known = family.device_choices["attention_implementation"][0]  # XLNet's model takes auto, xla and triton
  requested = [attention for attention in args.attention if attention in known] or ["auto"]
  variants = [(attention, prng, masks, gelu) for gelu in args.gelu_gradient for masks in args.dropout_masks
              for prng in args.prng_impl for attention in requested]
  ours = []
  for variant in variants:
    try:
      ours.append(our_side(family, lengths, batch_size, numpy_batch, device, *variant))
      print(f"  {name} {size_name}: {ours[-1].label}: init {ours[-1].init_s:.1f} s, compile {ours[-1].compile_s:.1f} s",
            flush=True)  # progress: a large model's compile takes minutes
    except Exception as e:  # an implementation the chip or library refuses: the others still run
      if variant == variants[-1] and not ours:
        raise
      attention, prng, masks, gelu = variant
      print(f"  {name} {size_name}: our attention {attention!r} ({prng}, {masks} dropout masks, GELU by {gelu}) "
            f"failed: {str(e).splitlines()[0][:300]}", flush=True)
  hf_sides = []
  for backend in [None, args.hf_compile] if args.hf_compile else [None]:
    start = time.perf_counter()
    hf_sides.append(their_side(family, batch_size, numpy_batch, ours[0].trainer.numpy_params(), args.device,
                               backend))
    print(f"  {name} {size_name}: {hf_sides[-1].label}: built in {time.perf_counter() - start:.1f} s", flush=True)
  theirs = hf_sides[0]  # the ratios' reference
  sides = ours + hf_sides
  for side in sides:
    for warmup in range(args.warmup):
      start = time.perf_counter()
      side.step()
      if warmup == 0 and side.compiles_on_first_step:
        side.compile_s = time.perf_counter() - start
        print(f"  {name} {size_name}: {side.label}: compiled in its first step, {side.compile_s:.1f} s", flush=True)
    side.losses.clear()
  for _ in range(args.repeats):
    for side in sides:
      side.timed(args.steps_per_sample)
  losses = [loss for side in sides for loss in side.losses]
  if not all(math.isfinite(x) for x in losses):
    raise RuntimeError(f"{name} {size_name}: a loss is not finite: {[s.losses for s in sides]}")
  tokens = steps.tokens_per_batch(batch_size, lengths)
  peak = roofline.peak_flops_per_device(device)
  flops = roofline.model_flops_per_step(ours[0].trainer.setup) if peak else None
  theirs_s = statistics.median(theirs.times)
  rows = []
  for side in sides:
    seconds = statistics.median(side.times)
    rows.append({"family": name, "size": size_name, "side": side.label, "params": side.params, "tokens": tokens,
                 "seconds": seconds, "vs_hf": theirs_s / seconds, "mfu": flops / seconds / peak if peak else None,
                 "memory_gib": side.memory_bytes / GIB, "init_s": side.init_s, "compile_s": side.compile_s,
                 "last_loss": side.losses[-1]})
  print_table(rows)
  for compiled in hf_sides[1:]:
    against = statistics.median(compiled.times)
    print(f"  {name} {size_name}: against {compiled.label}: " + ", ".join(
        f"{side.label} {against / statistics.median(side.times):.2f}x" for side in ours), flush=True)
  if args.profile:
    for side in ours:
      file_name = re.sub(r"\W+", "_", f"{name}_{size_name}_{side.label}")
      keep_as = args.profile_dir and os.path.join(args.profile_dir, file_name)
      try:
        profile(side, args.profile, statistics.median(side.times), keep_as)
      except Exception as e:  # the figures above stand without it
        print(f"  {side.label}: profiling failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
  return rows


def print_table(rows: list) -> None:
  print(f"{'family':<8}{'size':<7}{'side':<28}{'ms/step':>9}{'tokens/s':>11}{'vs HF':>7}{'MFU':>7}{'peak GiB':>10}"
        f"{'init s':>8}{'compile s':>10}")
  for r in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    print(f"{r['family']:<8}{r['size']:<7}{r['side']:<28}{1e3 * r['seconds']:>9.1f}{r['tokens'] / r['seconds']:>11,.0f}"
          f"{r['vs_hf']:>6.2f}x{mfu:>7}{r['memory_gib']:>10.1f}{r['init_s']:>8.1f}{r['compile_s']:>10.1f}")


def main(args):
  import jax
  import torch

  torch.set_num_threads(os.cpu_count())
  device = jax.devices(args.device)[0]
  versions = f"jax {jax.__version__}, torch {torch.__version__}"
  if args.device == "cpu":
    print(f"{os.cpu_count()} CPUs; {versions}, torch with {torch.get_num_threads()} threads; fp32", flush=True)
  else:
    import transformers
    print(f"{device.device_kind} ({device.platform}); {versions}, transformers {transformers.__version__}; ours "
          f"bf16 compute with fp32 params, HF bf16 autocast and fused AdamW", flush=True)
  print(f"{args.repeats} timed samples of {args.steps_per_sample} steps of each, interleaved, after {args.warmup} "
        "untimed steps; " + ("each step's loss read once the next is dispatched" if args.steps_per_sample > 1
                             else "each step waited for before the next"), flush=True)
  rows = []
  for size_name in args.sizes:
    for name in args.families:
      family_rows = compare(name, size_name, args, device)
      rows += family_rows
      print(f"  {name} {size_name}: {family_rows[0]['params'] / 1e6:.1f}M params, tokens/batch "
            f"{family_rows[0]['tokens']}, last losses " + ", ".join(f"{r['side']} {r['last_loss']:.4f}"
                                                                    for r in family_rows), flush=True)
  if len(rows) > len(family_rows):
    print_table(rows)


if __name__ == "__main__":
  # benchmarks/ is not a package: its scripts import their shared module by name, from their own directory;
  # the project's packages come from the repository root.
  sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), REPO]
  arguments = make_parser().parse_args()
  if min(arguments.repeats, arguments.warmup, arguments.steps_per_sample) < 1:
    make_parser().error("--repeats, --warmup and --steps_per_sample must be >= 1")
  if arguments.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"  # the comparison is on the CPU, whatever accelerator is attached
  else:  # JAX takes its memory as it needs it, leaving the rest of the device to torch
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  main(arguments)
