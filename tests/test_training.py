"""The training path end to end: loss falls, resume is exact, sharding does not change the maths,
and bad configuration fails with one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import gin
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL_BERT = [
    "bert.BertConfig.hidden_size = 64", "bert.BertConfig.num_heads = 2", "bert.BertConfig.mlp_dim = 128",
    "TASK_FEATURE_LENGTHS = {'input_ids': 64, 'masked_positions': 10}", "BATCH_SIZE = 8",
    "LEARNING_RATE = 2e-3", "WARMUP_STEPS = 5", "EVAL_EVERY_STEPS = 0",
]


SMALL_XLNET = [
    "xlnet.XLNetConfig.d_model = 32", "xlnet.XLNetConfig.d_head = 16", "xlnet.XLNetConfig.d_inner = 64",
    "SEQ_LEN = 32", "MEM_LEN = 16", "REUSE_LEN = 16", "NUM_PREDICT = 6", "BATCH_SIZE = 4", "WARMUP_STEPS = 2",
]
SMALL = {"bert_tiny_demo": SMALL_BERT, "xlnet_tiny_demo": SMALL_XLNET}


def run_training(model_dir, steps, extra=(), run="bert_tiny_demo"):
  from pretrain import cli, trainer
  gin.clear_config()
  cli.parse_gin([f"gin_configs/runs/{run}.gin"],
                SMALL[run] + [f"MODEL_DIR = '{model_dir}'", f"TRAIN_STEPS = {steps}", *extra])
  return gin.get_configurable(trainer.train)()


def logged(model_dir, key="loss"):
  rows = [json.loads(line) for line in (Path(model_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r[key] for r in rows if "split" not in r}


def test_loss_falls_and_outputs_are_written(tmp_path):
  run_training(tmp_path, 60, ["LOG_EVERY_STEPS = 5", "CHECKPOINT_EVERY_STEPS = 30"])
  losses = logged(tmp_path)
  first, last = np.mean([losses[s] for s in (5, 10, 15)]), np.mean([losses[s] for s in (50, 55, 60)])
  assert last < first - 0.5, losses
  record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "mlm_accuracy", "nsp_accuracy"):
    assert key in record
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [30, 60]
  assert list((tmp_path / "tensorboard" / "train").iterdir())


@pytest.mark.parametrize("run, layout", [("bert_tiny_demo", []), ("xlnet_tiny_demo", ["xlnet.XLNetConfig.scan_layers = True"])])
def test_resume_is_exact(tmp_path, run, layout):
  """A run stopped at step 5 and resumed logs the losses of an uninterrupted one.

  The learning-rate schedule is pinned to 12 steps so that stopping early (TRAIN_STEPS = 5) does not
  change it; XLNet also carries its memory through the checkpoint, and runs with scanned layers.
  """
  straight, split = tmp_path / "straight", tmp_path / "split"
  bindings = ["LOG_EVERY_STEPS = 1", "CHECKPOINT_EVERY_STEPS = 5", "optimizers.warmup_linear_decay.total_steps = 12",
              *layout]
  run_training(straight, 12, bindings, run)
  run_training(split, 5, bindings, run)
  run_training(split, 12, bindings, run)  # resumes from step 5
  a, b = logged(straight), logged(split)
  assert [a[s] for s in range(6, 13)] == [b[s] for s in range(6, 13)]  # bitwise on CPU


def _cli(args, env_extra=None, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
  return subprocess.run([sys.executable, "-m", "pretrain.train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_one_device_and_eight_devices_agree(tmp_path):
  losses = {}
  for name, devices, mesh in (("one", 1, "{'data': 1}"), ("eight", 8, "{'data': 4, 'model': 2}")):
    args = ["--gin_file=gin_configs/runs/bert_tiny_demo.gin", *[f"--gin_bindings={b}" for b in SMALL_BERT],
            f"--gin.MODEL_DIR='{tmp_path / name}'", "--gin.TRAIN_STEPS=5", "--gin.LOG_EVERY_STEPS=1",
            f"--gin.MESH_SHAPE={mesh}"]
    result = _cli(args, {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"'data': {4 if devices == 8 else 1}" in result.stdout
    losses[name] = [logged(tmp_path / name)[s] for s in range(1, 6)]
  np.testing.assert_allclose(losses["one"], losses["eight"], rtol=2e-5)


BERT_RUN, XLNET_RUN = "--gin_file=gin_configs/runs/bert_tiny_demo.gin", "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin"


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.NO_SUCH_MACRO_OR_CONFIG.x=1"], "NO_SUCH_MACRO_OR_CONFIG"),
    ([BERT_RUN, "--gin.MIXTURE_OR_TASK_NAME='no_such_task'"], "unknown task or mixture 'no_such_task'"),
    ([BERT_RUN, "--gin.TRAIN_FILES='/nonexistent/*.txt'"], "TRAIN_FILES='/nonexistent/*.txt' matches no files"),
    ([BERT_RUN, "--gin.PER_DEVICE_BATCH=3"], "PER_DEVICE_BATCH=3 does not divide the 32 rows"),
    ([BERT_RUN, "--gin.PER_DEVICE_BATCH=8", "--gin.MICROBATCHES=2"],
     "MICROBATCHES=2 and PER_DEVICE_BATCH=8: set one of them"),
    ([BERT_RUN, "--gin_file=gin_configs/objectives/wikipedia_books.gin"],
     "VOCAB_MODEL is not set: the TFDS task 'wikipedia/20230601.en:1.0.0' needs the sentencepiece model"),
    ([XLNET_RUN, "--gin.DATA_SHARDS=2"], "DATA_SHARDS=2: xlnet reads one data shard per batch row (BATCH_SIZE=16)"),
])
def test_bad_configuration_fails_with_one_line(args, message):
  result = _cli([*args, "--gin.MODEL_DIR='/tmp/unused'"], timeout=300)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.train: error:") and message in last, result.stderr[-1500:]
