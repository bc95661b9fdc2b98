"""Plain helpers shared by the test files: runs of the programs (in subprocesses, or in this process), tiny
training runs, rate checks, HF model building. Heavy libraries are imported inside the helpers that need them,
so that tests which use none of them (the launchers') stay free of TF, torch and JAX."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# jax's CUDA plugin and cuDNN (the gpu-plan extra), which `make install` puts beside the venv, not in it
# (Makefile): conftest adds them to the test workers' path; the tests' subprocesses run without them.
GPU_PLAN_PACKAGES = str(Path(sys.prefix) / "gpu-plan")

# ----------------------------------------------------------------------------- programs, in subprocesses or here


def module_command(module, *args):
  """`python -m module args` with this interpreter."""
  return [sys.executable, "-m", module, *args]


def host_devices(count):
  """Environment that makes XLA's CPU backend show `count` devices (the other XLA flags kept)."""
  return {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()}


def _env(extra):
  return {**os.environ, "JAX_PLATFORMS": "cpu", **(extra or {})}


def run(command, env=None, timeout=600, cwd=ROOT):
  """Runs `command` (from the repository root, unless `cwd`) with JAX on the CPU, `env` added to (or replacing)
  the inherited variables; returns the CompletedProcess with text stdout and stderr."""
  return subprocess.run(command, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=timeout)


def run_module(module, *args, env=None, timeout=600, cwd=ROOT):
  """`run` of `python -m module args`."""
  return run(module_command(module, *args), env=env, timeout=timeout, cwd=cwd)


def run_here(program, *args):
  """`python -m program args` (`python program args` for a .py path from the repository root), run in this
  process as a process of its own would run it; returns a CompletedProcess with its stdout, its stderr (what
  Python writes) and its exit code (a message given to sys.exit goes to stderr, with code 1, as Python does).
  The absl programs define flags of the same names (--input, --output), and a module run as a program
  defines them again: the project's flags are forgotten before the program runs and after. sys.path is put back
  after it (the benchmark scripts put benchmarks/ on it)."""
  import contextlib
  import io
  import runpy
  import warnings
  stdout, stderr, code, argv, path = io.StringIO(), io.StringIO(), 0, sys.argv, list(sys.path)
  _forget_project_flags()
  sys.argv = [program, *args]
  try:
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
      warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # a module tests import too
      try:
        if program.endswith(".py"):
          runpy.run_path(str(ROOT / program), run_name="__main__")
        else:
          runpy.run_module(program, run_name="__main__", alter_sys=True)
      except SystemExit as exited:
        if exited.code is None or isinstance(exited.code, int):
          code = exited.code or 0
        else:
          print(exited.code, file=sys.stderr)
          code = 1
  finally:
    sys.argv, sys.path[:] = argv, path
    _forget_project_flags()
  return subprocess.CompletedProcess([program, *args], code, stdout.getvalue(), stderr.getvalue())


def _forget_project_flags():
  """absl files a program's flags under its path (or sys.argv[0]), a module's under its name."""
  from absl import flags
  for module, module_flags in list(flags.FLAGS.flags_by_module_dict().items()):
    if module.endswith(".py") or module.startswith(("pretrain", "data_pipelines", "benchmarks")):
      for flag in list(module_flags):  # forgetting one takes it off this list
        if flag.name in flags.FLAGS:
          delattr(flags.FLAGS, flag.name)


def start_module(module, *args, stderr=subprocess.PIPE):
  """Starts `python -m module args` as `run` would, without waiting: a Popen with text stdout piped
  (stderr too unless redirected, e.g. to subprocess.STDOUT)."""
  return subprocess.Popen(module_command(module, *args), cwd=ROOT, env=_env(None), stdout=subprocess.PIPE,
                          stderr=stderr, text=True)


# ----------------------------------------------------------------------------- tiny training runs

SMALL_BERT = [
    "bert.BertConfig.hidden_size = 64", "bert.BertConfig.num_heads = 2", "bert.BertConfig.mlp_dim = 128",
    "TASK_FEATURE_LENGTHS = {'input_ids': 64, 'masked_positions': 10}", "BATCH_SIZE = 8",
    "LEARNING_RATE = 2e-3", "WARMUP_STEPS = 5", "EVAL_EVERY_STEPS = 0",
]


EIGHT_DEVICE_STEPS = 5  # the steps of conftest's bert_on_eight_devices run
STDERR_FILE = "stderr.txt"  # that run's stderr, beside its MODEL_DIR


def small_bert_flags(model_dir, steps):
  """pretrain.train's flags for `steps` steps of the tiny BERT demo at SMALL_BERT's sizes."""
  return ["--gin_file=gin_configs/runs/bert_tiny_demo.gin", *[f"--gin_bindings={b}" for b in SMALL_BERT],
          f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}"]


def train(run_name, model_dir, steps, bindings=(), gin_files=()):
  """Trains in this process: gin_configs/runs/<run_name>.gin, then `gin_files`, with `bindings`;
  returns the trainer's summary."""
  import gin

  from pretrain import cli, trainer
  gin.clear_config()
  cli.parse_gin([f"gin_configs/runs/{run_name}.gin", *gin_files],
                [*bindings, f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}"])
  return trainer.train(**cli.bound_arguments(trainer.train))


def step_cache_key(*bindings) -> str:
  """`pretrain.step_cache.key` of the tiny BERT demo's train step at SMALL_BERT's sizes with `bindings`, fitted
  to a 1000-piece vocabulary (no data read)."""
  import gin

  from pretrain import cli, partitioning, roofline, step_cache, steps, trainer
  gin.clear_config()
  cli.parse_gin(["gin_configs/runs/bert_tiny_demo.gin"], [*SMALL_BERT, *bindings])
  args = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
  family = args["family"].fitted(1000, args["task_feature_lengths"])
  setup = steps.make_setup(family, args["task_feature_lengths"], args["batch_size"],
                           partitioning.make_mesh(args["mesh_shape"]), args["optimizer"], args["schedule"],
                           args["microbatches"])
  return step_cache.key(setup)


def run_train(capsys, tmp_path, *args):
  """(exit code, last stderr line) of `python -m pretrain.train args` (MODEL_DIR tmp_path unless given),
  run in this process: for runs that fail before training."""
  import gin
  import pytest

  from pretrain import cli
  from pretrain import train as train_program
  gin.clear_config()
  argv = ["pretrain.train", f"--gin.MODEL_DIR='{tmp_path}'", *args]
  with pytest.raises(SystemExit) as exited:
    cli.run("pretrain.train", lambda: train_program.main(argv))
  return exited.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def largest_array_file(step_dir):
  """The biggest file of a checkpoint step's array data (orbax's `state/**/d/*`)."""
  return max((p for p in (Path(step_dir) / "state").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_a_bit(path):
  """Damages a file for real: one bit in its middle is flipped on disk (any path with read/write_bytes)."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x08
  path.write_bytes(bytes(data))


def logged_losses(model_dir, split=None):
  """step -> training loss from metrics.jsonl (with `split`, e.g. 'eval': that split's loss); a resumed run's
  rows come later and win."""
  rows = [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if r.get("split") == split}


# ----------------------------------------------------------------------------- objectives' statistics

# A rate measured over N independent trials may miss by Z standard errors of a binomial,
# sqrt(p (1 - p) / N): a false alarm about once in 150,000 checks.
Z = 4.5


def assert_rate(hits, trials, rate, what):
  tolerance = Z * math.sqrt(rate * (1 - rate) / trials)
  assert abs(hits / trials - rate) <= tolerance, f"{what}: {hits / trials:.4f} vs {rate:.4f} ± {tolerance:.4f}"


def map_examples(fn, elements: dict) -> list:
  """fn(element) in a tf.data map (graph mode, without autograph, as in the pipeline); numpy results."""
  import tensorflow as tf
  fn = tf.autograph.experimental.do_not_convert(fn)
  dataset = tf.data.Dataset.from_tensor_slices(elements).map(fn, num_parallel_calls=2, deterministic=True)
  return list(dataset.as_numpy_iterator())


def nested_lists(ragged) -> list:
  """An eager tf.RaggedTensor as nested Python lists, from its flat values and row splits (RaggedTensor.to_list
  slices row by row: seconds for a few thousand rows)."""
  lists = ragged.flat_values.numpy().tolist()
  for splits in reversed(ragged.nested_row_splits):
    splits = splits.numpy()
    lists = [lists[begin:end] for begin, end in zip(splits[:-1], splits[1:])]
  return lists


def seeds(num, salt=0):
  """One [index, salt] seed per example."""
  return np.stack([np.arange(num), np.full(num, salt)], axis=1).astype(np.int64)


def restored(example):
  """input_ids of an MLM example with the masked positions put back to their original tokens."""
  ids = example["input_ids"].copy()
  real = example["masked_weights"] > 0
  ids[example["masked_positions"][real]] = example["masked_ids"][real]
  return ids


# ----------------------------------------------------------------------------- HuggingFace counterparts


def build_hf(mapping, config, params):
  """The HF model (eval mode) of a hf_mappings module holding our params; returns it with
  load_state_dict's missing keys."""
  import torch
  import transformers

  from pretrain.hf_mappings.common import to_hf
  kwargs = dict(mapping.hf_config(config))
  hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
  model = getattr(transformers, mapping.HF_CLASS)(hf_config).eval()
  state = {key: torch.from_numpy(value) for key, value in to_hf(params, mapping.rules(config)).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected
  return model, set(missing)


def assert_round_trip(mapping, config, params, state):
  """The HF state dict `state`, read back through the mapping, gives exactly `params`."""
  from pretrain.hf_mappings.common import flatten_params, from_hf
  flat = flatten_params(params)
  back = flatten_params(from_hf(state, mapping.rules(config), {path: v.shape for path, v in flat.items()}))
  assert back.keys() == flat.keys()
  for path, value in flat.items():
    np.testing.assert_array_equal(back[path], value, err_msg=path)


# ----------------------------------------------------------------------------- small models with random weights


def random_ids(rng, shape, lengths, vocab_size):
  """Ids in [1, vocab) with trailing pad (0) beyond each row's length."""
  ids = rng.integers(1, vocab_size, shape)
  return np.where(np.arange(shape[1])[None] < np.asarray(lengths)[:, None], ids, 0).astype(np.int32)


def random_params(model, features):
  """Random values in the model's param shapes (LayerNorm scales around 1). No zero biases or unit scales
  to hide a mapping error, and activations large enough that, e.g., the wrong GELU flavour (about 8e-4
  here) exceeds TOLERANCE. Built from shapes alone: an eager init would cost seconds."""
  import flax.linen as nn
  import jax
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), features)["params"])
  rng = np.random.default_rng(1)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: float(path[-1].key == "scale") + 0.2 * rng.standard_normal(leaf.shape).astype(np.float32),
      shapes)


def random_batch(family, feature_lengths, rng):
  """Token ids for the *_ids features, 0 or 1 for the rest (segments, labels, positions, weights)."""
  import jax.numpy as jnp
  batch = {}
  for name, spec in family.feature_shapes(2, feature_lengths).items():
    low, high = (1, 50) if name.endswith("_ids") and name != "segment_ids" else (0, 2)
    batch[name] = jnp.asarray(rng.integers(low, high, spec.shape), spec.dtype)
  return batch


def target_log_probs(logits, targets):
  """log p(target) at every position, from a plain log-softmax."""
  from scipy import special
  log_probs = special.log_softmax(np.asarray(logits, np.float64), axis=-1)
  return np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


def assert_bf16_close(case):
  """A case's model in bf16 compute stays finite and within bf16's rounding of its fp32 outputs."""
  import dataclasses

  import jax.numpy as jnp
  model = type(case["model"])(dataclasses.replace(case["model"].config, dtype=jnp.bfloat16))
  reference = case["model"].apply({"params": case["params"]}, case["features"])
  out = model.apply({"params": case["params"]}, case["features"])
  for name, logits in out.items():
    logits, expected = np.asarray(logits), np.asarray(reference[name])
    assert logits.dtype == np.float32 and np.isfinite(logits).all(), name
    # bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.004); a few layers of rounding stay well under 5%.
    relative = np.abs(logits - expected).max() / np.abs(expected).max()
    assert relative < 0.05, (name, relative)
