"""benchmarks/convergence.py on a few steps of every family: with dropout off, our training step and
transformers' (same initial weights, same batches of our pipeline, torch AdamW) give the same losses step
by step, which checks the optimizer, schedule, clipping, weight-decay mask and loss normalisation. The script
runs in this process, as a process of its own would run it, without first spending some 15 s of CPU on importing
TensorFlow, torch and transformers again."""
import json

import pytest
from helpers import run_here


# `make test` runs the script on ALBERT and XLNet (about 90 s on 2 CPUs): the script broke unseen while it was left
# to `make test-all` alone. ALBERT's side shares BERT's torch trainer (MLM and a sentence-pair head) and XLNet's is
# the most intricate (perm_mask, target_mapping, mems); BERT and BART (the slowest, 70 s) run in `make test-all`.
@pytest.mark.parametrize("families", ["albert,xlnet", pytest.param("bert,bart", marks=pytest.mark.slow)])
def test_each_family_trains_step_by_step_as_transformers_does(tmp_path, families):
  import torch
  curves = tmp_path / "curves.json"
  threads = torch.get_num_threads()  # the script sets torch's (--torch_threads)
  try:
    result = run_here("benchmarks/convergence.py", f"--families={families}", "--steps=6", "--parity_steps=6",
                      "--eval_every=3", "--eval_batches=1", "--plot=", f"--curves={curves}")  # no matplotlib
  finally:
    torch.set_num_threads(threads)
  assert result.returncode == 0, result.stderr[-3000:]
  trained = json.loads(curves.read_text())
  assert [family["family"] for family in trained] == families.split(",")
  for family in trained:
    assert len(family["parity"]) == 6, family["family"]
    for ours, theirs in family["parity"]:
      assert ours == pytest.approx(theirs, rel=1e-4), family["family"]
    for _, ours, theirs, _, _ in family["eval"]:
      assert ours == pytest.approx(theirs, rel=0.02), family["family"]
