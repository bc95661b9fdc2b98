"""The training path end to end: loss falls, resume is exact, sharding does not change the maths,
and bad configuration fails with one line."""
import json

import numpy as np
import pytest

from helpers import SMALL_BERT, host_devices, logged_losses, run_module, small_bert_flags, train

SMALL_XLNET = [
    "xlnet.XLNetConfig.d_model = 32", "xlnet.XLNetConfig.d_head = 16", "xlnet.XLNetConfig.d_inner = 64",
    "SEQ_LEN = 32", "MEM_LEN = 16", "REUSE_LEN = 16", "NUM_PREDICT = 6", "BATCH_SIZE = 4", "WARMUP_STEPS = 2",
]
SMALL = {"bert_tiny_demo": SMALL_BERT, "xlnet_tiny_demo": SMALL_XLNET}


def test_loss_falls_and_outputs_are_written(tmp_path):
  train("bert_tiny_demo", tmp_path, 60, SMALL_BERT + ["LOG_EVERY_STEPS = 5", "CHECKPOINT_EVERY_STEPS = 30"])
  losses = logged_losses(tmp_path)
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
  train(run, straight, 12, SMALL[run] + bindings)
  train(run, split, 5, SMALL[run] + bindings)
  train(run, split, 12, SMALL[run] + bindings)  # resumes from step 5
  a, b = logged_losses(straight), logged_losses(split)
  assert [a[s] for s in range(6, 13)] == [b[s] for s in range(6, 13)]  # bitwise on CPU


def test_one_device_and_eight_devices_agree(tmp_path):
  losses = {}
  for name, devices, mesh in (("one", 1, "{'data': 1}"), ("eight", 8, "{'data': 4, 'model': 2}")):
    result = run_module("pretrain.train", *small_bert_flags(tmp_path / name, 5), "--gin.LOG_EVERY_STEPS=1",
                        f"--gin.MESH_SHAPE={mesh}", env=host_devices(devices))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"'data': {4 if devices == 8 else 1}" in result.stdout
    losses[name] = [logged_losses(tmp_path / name)[s] for s in range(1, 6)]
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
    ([BERT_RUN, "--gin_file=gin_configs/objectives/tfds_source.gin", "--gin.TFDS_DATA_DIR='/nonexistent'",
      "--gin.VOCAB_MODEL='/data/spm.model'"],
     "TFDS dataset 'wikipedia/20230601.en:1.0.0' is not prepared in TFDS_DATA_DIR='/nonexistent'"),
    ([XLNET_RUN, "--gin.DATA_SHARDS=2"], "DATA_SHARDS=2: xlnet reads one data shard per batch row (BATCH_SIZE=16)"),
])
def test_bad_configuration_fails_with_one_line(args, message, tmp_path):
  result = run_module("pretrain.train", *args, f"--gin.MODEL_DIR='{tmp_path}'", timeout=300)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.train: error:") and message in last, result.stderr[-1500:]
