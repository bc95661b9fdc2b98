"""Updates with non-finite gradients are skipped and counted; a run that keeps making them stops with one
line naming the step and the last checkpoint, and no checkpoint ever holds non-finite params."""
import json

import gin
import jax
import numpy as np
import pytest

from helpers import SMALL_BERT
from pretrain import checkpoints, cli
from pretrain import train as train_program


def test_a_diverging_run_skips_counts_and_stops_with_finite_checkpoints(tmp_path, capsys):
  # A learning rate of 1e12 blows the params up in one update; the loss and gradients are then infinite.
  flags = ["--gin_file=gin_configs/runs/bert_tiny_demo.gin", *[f"--gin_bindings={b}" for b in SMALL_BERT],
           f"--gin.MODEL_DIR='{tmp_path}'", "--gin.TRAIN_STEPS=40", "--gin.LEARNING_RATE=1e12",
           "--gin.WARMUP_STEPS=1", "--gin.LOG_EVERY_STEPS=1", "--gin.CHECKPOINT_EVERY_STEPS=2",
           "--gin.MAX_SKIPPED_IN_A_ROW=4"]
  gin.clear_config()
  with pytest.raises(SystemExit) as exited:
    cli.run("pretrain.train", lambda: train_program.main(["pretrain.train", *flags]))
  assert exited.value.code == 1
  last = capsys.readouterr().err.strip().splitlines()[-1]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  skipped = [r["step"] for r in rows if r["skipped_in_a_row"] > 0]
  assert len(skipped) >= 4 and skipped == list(range(skipped[0], skipped[0] + len(skipped)))
  assert [r["skipped_steps"] for r in rows if r["step"] in skipped] == list(range(1, len(skipped) + 1))
  assert not np.isfinite(rows[-1]["loss"])
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert last.startswith(f"pretrain.train: error: the gradients were not finite at 4 steps in a row, up to step "
                         f"{skipped[0] + 3}") and f"the last checkpoint is step {saved[-1]}" in last, last
  assert saved[-1] >= skipped[0]  # checkpoints went on while updates were skipped, with the last good params
  for step in saved:
    params = checkpoints.restore_params(str(tmp_path), step)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params)), f"step {step} saved non-finite params"
