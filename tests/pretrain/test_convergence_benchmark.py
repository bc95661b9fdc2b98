"""benchmarks/convergence.py on a few steps of every family: with dropout off, our training step and
transformers' (same initial weights, same batches of our pipeline, torch AdamW) give the same losses step
by step, which checks the optimizer, schedule, clipping, weight-decay mask and loss normalisation."""
import json
import sys

import pytest
from helpers import run


# Part of `make test` (85 s on 2 CPUs): the script broke unseen while this test was left to `make test-all`.
def test_every_family_trains_step_by_step_as_transformers_does(tmp_path):
  curves = tmp_path / "curves.json"
  result = run([sys.executable, "benchmarks/convergence.py", "--steps=6", "--parity_steps=6", "--eval_every=3",
                "--eval_batches=1", "--plot=", f"--curves={curves}"], timeout=1200)  # no plot: no matplotlib
  assert result.returncode == 0, result.stderr[-3000:]
  for family in json.loads(curves.read_text()):
    assert len(family["parity"]) == 6, family["family"]
    for ours, theirs in family["parity"]:
      assert ours == pytest.approx(theirs, rel=1e-4), family["family"]
    for _, ours, theirs, _, _ in family["eval"]:
      assert ours == pytest.approx(theirs, rel=0.02), family["family"]
