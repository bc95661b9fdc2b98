"""The train loop end to end: loss falls, outputs are written, sharding does not change the maths, and the
model caches exactly the tokens the data's windows continue. (Exact resume: XLNet's, with held-out evaluation,
in tests/pretrain/test_multihost.py; BERT's after a preemption, in tests/reliability.)"""
import json
import re

import gin
import numpy as np
import pytest

from helpers import EIGHT_DEVICE_STEPS, SMALL_BERT, logged_losses, small_bert_flags, train
from data_pipelines import vocab
from pretrain import train as train_program

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)


def test_loss_falls_outputs_are_written_and_the_finished_run_started_again_trains_nothing(tmp_path, capsys):
  train("bert_tiny_demo", tmp_path, 60, SMALL_BERT + ["LOG_EVERY_STEPS = 5", "CHECKPOINT_EVERY_STEPS = 30",
                                                      "PROFILE_STEPS = (11, 12)"])
  losses = logged_losses(tmp_path)
  first, last = np.mean([losses[s] for s in (5, 10, 15)]), np.mean([losses[s] for s in (50, 55, 60)])
  assert last < first - 0.5, losses
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "mlm_accuracy", "nsp_accuracy"):
    assert key in records[0]
  for record in records:  # the speed of each window; no MFU on a CPU, whose peak is unknown
    assert record["step_time"] > 0 and 0 <= record["input_wait"] <= 1 and "mfu" not in record, record
    assert record["tokens_per_second"] == pytest.approx(record["examples_per_second"] * 64)  # 8 rows of 64
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [30, 60]
  assert list((tmp_path / "tensorboard" / "train").iterdir())
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  assert (tmp_path / "profile" / "train_step.hlo.txt").read_text().startswith("HloModule jit_train_step")
  summary = capsys.readouterr().out
  assert re.search(r"device time per step [\d.]+ ms in \d+ kernels; top 15 of \d+ sources", summary), summary
  assert re.search(r"^\s+[\d.]+\s+[\d.]+%\s+\d+\s+(forward |backward) encoder/layer_\*/", summary, re.M), summary
  gin.clear_config()  # the command again, or an older one's, through the program's main
  train_program.main(["pretrain.train", *small_bert_flags(tmp_path, 50)])
  assert capsys.readouterr().out.splitlines()[-1] == (
      "done: nothing to train, the checkpoint is at step 60 and TRAIN_STEPS=50 (raise TRAIN_STEPS to train on); "
      f"checkpoints in {tmp_path}/checkpoints")
  assert logged_losses(tmp_path) == losses


def test_a_start_traces_the_train_step_first_and_its_model_in_one_thread_at_a_time(tmp_path, model_traces_at_once,
                                                                                    monkeypatch):
  """The train step is traced in a thread beside the state's init, and first: its compile is the longer way to
  the first step. Its cache key, needed only to keep it, is traced while XLA compiles it."""
  from pretrain import step_cache, steps
  happened = []

  def noted(name, function):
    def call(*args, **kwargs):
      happened.append(f"{name} begins")
      try:
        return function(*args, **kwargs)
      finally:
        happened.append(f"{name} ends")
    return call

  monkeypatch.setattr(steps, "lower_train_step", noted("lowering", steps.lower_train_step))
  monkeypatch.setattr(steps.Setup, "init_state", noted("init", steps.Setup.init_state))
  monkeypatch.setattr(step_cache, "key", noted("key", step_cache.key))
  new_cache = f"COMPILATION_CACHE_DIR = '{tmp_path / 'cache'}'"  # not the session's, which may hold this step
  summary = train("bert_tiny_demo", tmp_path / "run", 2, SMALL_BERT + ["LOG_EVERY_STEPS = 1", new_cache])
  assert not model_traces_at_once, model_traces_at_once
  assert summary["steps"] == 2 and np.isfinite(summary["last_loss"]), summary
  assert happened.index("lowering ends") < happened.index("init begins"), happened
  assert happened.index("lowering ends") < happened.index("key begins"), happened


def test_one_device_and_eight_devices_agree(tmp_path, bert_on_eight_devices):
  """This process has one CPU device; the eight-device run (data 4 × model 2) is conftest's."""
  one_device = ["LOG_EVERY_STEPS = 1", "MESH_SHAPE = {'data': 1}"]
  train("bert_tiny_demo", tmp_path, EIGHT_DEVICE_STEPS, SMALL_BERT + one_device)
  one, eight = logged_losses(tmp_path), logged_losses(bert_on_eight_devices)
  steps = range(1, EIGHT_DEVICE_STEPS + 1)
  np.testing.assert_allclose([one[s] for s in steps], [eight[s] for s in steps], rtol=2e-5)


def test_the_model_caches_what_the_next_window_continues():
  """REUSE_LEN (TASK_FEATURE_LENGTHS' reuse_len) sets both the data's windows and the model's cache.

  Each window of a row is [reuse part | A SEP B SEP CLS]; the next window's reuse part is the text
  right after this one's, so it begins with A. The model caches the first reuse_len positions.
  """
  import gin

  from pretrain import cli, trainer
  reuse = 16  # not the paper's half of the window (32), which the data used whatever REUSE_LEN said
  gin.clear_config()
  cli.parse_gin(["gin_configs/runs/xlnet_tiny_demo.gin"],
                ["SEQ_LEN = 64", f"REUSE_LEN = {reuse}", "NUM_PREDICT = 6", "MODEL_DIR = '/unused'"])
  run = cli.bound_arguments(trainer.train, ["family", "mixture_or_task_name", "task_feature_lengths"])
  family = trainer.fitted_family(run["family"], run["mixture_or_task_name"], run["task_feature_lengths"])
  assert family.config.reuse_len == reuse
  data = trainer.input_pipeline_for_run(family, run["mixture_or_task_name"], run["task_feature_lengths"], 4, 1, 0,
                                        None, process_index=0, process_count=1)
  sep = vocab.special_ids(data.vocabulary).sep
  batches = data.iterator("train")
  windows = [{k: np.asarray(v)[0] for k, v in next(batches).items()} for _ in range(8)]  # row 0 reads forwards
  for before, after in zip(windows, windows[1:]):
    len_a = int(np.sum(before["segment_ids"] == 0)) - reuse - 1
    assert len_a >= 1 and before["input_ids"][reuse + len_a] == sep, "A ends with SEP"
    shared = min(reuse, len_a)
    np.testing.assert_array_equal(after["input_ids"][:shared], before["input_ids"][reuse:reuse + shared])
