"""Plain helpers shared by the test files: subprocess runs of the programs, tiny training runs, rate
checks, HF model building. Heavy libraries are imported inside the helpers that need them, so that
tests which use none of them (the launchers') stay free of TF, torch and JAX."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- programs in subprocesses


def module_command(module, *args):
  """`python -m module args` with this interpreter."""
  return [sys.executable, "-m", module, *args]


def host_devices(count):
  """Environment that makes XLA's CPU backend show `count` devices."""
  return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}


def _env(extra):
  return {**os.environ, "JAX_PLATFORMS": "cpu", **(extra or {})}


def run(command, env=None, timeout=600):
  """Runs `command` from the repository root with JAX on the CPU, `env` added to (or replacing) the
  inherited variables; returns the CompletedProcess with text stdout and stderr."""
  return subprocess.run(command, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)


def run_module(module, *args, env=None, timeout=600):
  """`run` of `python -m module args`."""
  return run(module_command(module, *args), env=env, timeout=timeout)


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
  return gin.get_configurable(trainer.train)()


def logged_losses(model_dir):
  """step -> training loss from metrics.jsonl; a resumed run's rows come later and win."""
  rows = [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "split" not in r}


# ----------------------------------------------------------------------------- objectives' statistics

# A rate measured over N independent trials may miss by Z standard errors of a binomial,
# sqrt(p (1 - p) / N): a false alarm about once in 150,000 checks.
Z = 4.5


def assert_rate(hits, trials, rate, what):
  tolerance = Z * math.sqrt(rate * (1 - rate) / trials)
  assert abs(hits / trials - rate) <= tolerance, f"{what}: {hits / trials:.4f} vs {rate:.4f} ± {tolerance:.4f}"


def map_examples(fn, elements: dict) -> list:
  """fn(element) in a tf.data map (graph mode, as in the pipeline); numpy results."""
  import tensorflow as tf
  dataset = tf.data.Dataset.from_tensor_slices(elements).map(fn, num_parallel_calls=2, deterministic=True)
  return list(dataset.as_numpy_iterator())


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
