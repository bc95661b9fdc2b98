"""benchmarks/train_step.py at its tiny size on the CPU, in this process: two of our attention choices and
transformers' step train from the same weights on one batch, the table has a row of figures for each, and
each of ours is profiled by model source."""
import re
import runpy
import sys


def test_the_step_benchmark_times_each_side_from_the_same_weights(capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["benchmarks/train_step.py", "--families=bert", "--sizes=tiny", "--repeats=1",
                                    "--warmup=1", "--attention=xla,auto", "--attention_dropout=0", "--profile=1"])
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the script sets it for its comparison on the CPU
  runpy.run_path("benchmarks/train_step.py", run_name="__main__")
  out = capsys.readouterr().out
  row = r"^bert\s+tiny\s+{}\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)x\s+n/a\s+(\S+)\s+(\S+)\s+(\S+)$"
  ours_xla, ours_auto, theirs = (re.search(row.format(re.escape(side)), out, re.M)
                                 for side in ("ours xla", "ours auto=xla", "HF sdpa"))
  assert ours_xla and ours_auto and theirs, out
  for ours in (ours_xla, ours_auto):
    assert float(ours[3]) > 0 and float(ours[4]) > 0  # XLA's memory footprint in GiB; init seconds
  assert float(theirs[3]) == 1.0 and theirs[4] == "nan"  # HF against itself; torch reports no CPU peak
  losses = re.search(r"last losses ours xla ([\d.]+), ours auto=xla ([\d.]+), HF sdpa ([\d.]+)", out)
  # On a CPU 'auto' is XLA's attention: the same program, weights, batch and dropout masks.
  assert losses[1] == losses[2]
  assert abs(float(losses[1]) - float(losses[3])) < 0.02 * float(losses[3])  # HF: the same weights, its own masks
  # One profile per side of ours, its kernels tied to the model's layers (folded) and to the backward pass.
  assert out.count("1 steps traced:") == 2
  profile = out[out.index("ours xla, 1 steps traced:"):]
  assert re.search(r"device time per step [\d.]+ ms in \d+ kernels, \d+% of the [\d.]+ ms step", profile)
  assert re.search(r"^\s+[\d.]+\s+[\d.]+%\s+\d+\s+backward encoder/layer_\*/", profile, re.M)
