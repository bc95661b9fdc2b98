"""benchmarks/train_step.py at its tiny size on the CPU, in this process: our step with 'auto' attention (XLA's
on a CPU) and two ways of drawing dropout's masks, and transformers' step, plain and under torch.compile, train
from the same weights on one batch, the table has a row of figures for each, and each of ours is profiled by model
source. torch.compile runs with its aot_eager backend: the same graph capture of forward and backward, without
inductor's code generation, which takes some 30 s more of a CPU whose inductor cache is empty (as CI's is)."""
import re
import runpy

import pytest
from helpers import run_here


def test_the_step_benchmark_times_each_side_from_the_same_weights(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the script sets it for its comparison on the CPU
  out = run_here("benchmarks/train_step.py", "--families=bert", "--sizes=tiny", "--repeats=1", "--warmup=1",
                 "--attention=auto", "--attention_dropout=0", "--dropout_masks=auto,bernoulli",
                 "--hf_compile=aot_eager", "--profile=1").stdout
  row = r"^bert\s+tiny\s+{}\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)x\s+n/a\s+(\S+)\s+(\S+)\s+(\S+)$"
  sides = ("ours auto=xla", "ours auto=xla bernoulli", "HF sdpa", "HF sdpa compiled aot_eager")
  rows = [re.search(row.format(re.escape(side)), out, re.M) for side in sides]
  assert all(rows), out
  for ours in rows[:-2]:
    assert float(ours[3]) > 0 and float(ours[4]) > 0  # XLA's memory footprint in GiB; init seconds
  plain, compiled = rows[-2:]
  assert float(plain[3]) == 1.0 and plain[4] == "nan"  # HF against itself; torch reports no CPU peak
  assert float(compiled[6]) > 0  # torch.compile's first step
  against = re.search(r"against HF sdpa compiled aot_eager: ours auto=xla ([\d.]+)x, ours auto=xla bernoulli ([\d.]+)x",
                      out)
  assert against and abs(float(against[1]) - float(rows[0][3]) * float(compiled[1]) / float(plain[1])) < 0.02
  losses = re.search(r"last losses " + ", ".join(re.escape(side) + r" ([\d.]+)" for side in sides), out)
  losses = [float(loss) for loss in losses.groups()]
  assert losses[0] != losses[1]  # other dropout masks: on a CPU 'auto' draws hashed ones
  for loss in losses[:-2] + losses[-1:]:
    assert abs(loss - losses[-2]) < 0.02 * losses[-2]  # HF: the same weights, its own masks
  # One profile per side of ours, its kernels tied to the model's layers (folded) and to the backward pass.
  assert out.count("1 steps traced:") == 2
  profile = out[out.index("ours auto=xla, 1 steps traced:"):]
  assert re.search(r"device time per step [\d.]+ ms in \d+ kernels, \d+% of the [\d.]+ ms step", profile)
  assert re.search(r"^\s+[\d.]+\s+[\d.]+%\s+\d+\s+backward encoder/layer_\*/", profile, re.M)


def test_the_gelu_gradients_to_time_are_a_list_of_the_models_choices(capsys):
  parser = runpy.run_path("benchmarks/train_step.py")["make_parser"]()
  assert parser.parse_args([]).gelu_gradient == ["formula"]
  assert parser.parse_args(["--gelu_gradient=formula,autodiff"]).gelu_gradient == ["formula", "autodiff"]
  with pytest.raises(SystemExit) as exited:
    parser.parse_args(["--gelu_gradient=formula,checkpoint"])
  assert exited.value.code == 2
  assert "'formula,checkpoint': expected a comma-separated list of formula, autodiff" in capsys.readouterr().err


def test_an_unknown_torch_compile_backend_is_named_before_anything_runs(capsys):
  parser = runpy.run_path("benchmarks/train_step.py")["make_parser"]()
  assert parser.parse_args(["--hf_compile"]).hf_compile == "inductor"
  assert parser.parse_args(["--hf_compile=aot_eager"]).hf_compile == "aot_eager"
  with pytest.raises(SystemExit) as exited:
    parser.parse_args(["--hf_compile=inductr"])
  assert exited.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith("python benchmarks/train_step.py: error: argument --hf_compile: 'inductr': not a "
                         "torch.compile backend here (torch has ") and "inductor" in last, last


def test_a_timed_sample_reads_each_steps_loss_once_the_next_step_is_dispatched():
  side_class = runpy.run_path("benchmarks/train_step.py")["Side"]
  events, dispatched = [], iter(range(10))

  def dispatch():
    events.append(("dispatch", next(dispatched)))
    return events[-1][1]

  def read(step):
    events.append(("read", step))
    return float(step)

  side = side_class("a side", dispatch, read)
  side.timed(3)
  assert events == [("dispatch", 0), ("dispatch", 1), ("read", 0), ("dispatch", 2), ("read", 1), ("read", 2)]
  side.timed(1)  # one step a sample: waited for before the next sample's first
  assert events[6:] == [("dispatch", 3), ("read", 3)]
  assert side.losses == [0.0, 1.0, 2.0, 3.0] and len(side.times) == 2
