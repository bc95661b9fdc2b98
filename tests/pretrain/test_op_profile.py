"""pretrain.op_profile on a real jax.profiler trace of a small layered model's training step on the CPU:
kernel times are tied to the model code that made them, layers folded, and other programs left out."""
import glob
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from pretrain import op_profile
from tests.helpers import run_here

STEPS = 2


class Layered(nn.Module):
  @nn.compact
  def __call__(self, x):
    for index in range(3):
      x = jnp.tanh(nn.Dense(64, name=f"layer_{index}")(x))
    return x


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
  """(trace path, the step's compiled text, the trace of the step alone per kernel) for STEPS steps of a
  gradient step, with another program run inside the trace."""
  model, x = Layered(), jnp.ones((256, 64))
  params = model.init(jax.random.PRNGKey(0), x)

  def train_step(p):
    return jax.grad(lambda q: jnp.sum(model.apply(q, x) ** 2))(p)

  def other_program(y):
    return jnp.cos(y) @ y.T

  compiled = jax.jit(train_step).lower(params).compile()
  other = jax.jit(other_program)
  other(x).block_until_ready()
  directory = tmp_path_factory.mktemp("trace")
  jax.profiler.start_trace(str(directory))
  for _ in range(STEPS):
    jax.block_until_ready(compiled(params))
  other(x).block_until_ready()
  jax.profiler.stop_trace()
  trace = glob.glob(str(directory / "**" / "*.xplane.pb"), recursive=True)[0]
  return trace, compiled.as_text()


def test_the_steps_kernels_are_summed_by_source_with_layers_folded(traced):
  trace, program = traced
  times = op_profile.kernel_times(trace, op_profile.module_name(program))
  everything = op_profile.kernel_times(trace)
  sources = op_profile.instruction_sources(program)
  assert times and all(t.seconds > 0 for t in times.values())
  # Every kernel is one of the step's instructions, and most (not all: XLA adds some) name their source.
  assert all(re.search(rf"^\s*(ROOT )?%?{re.escape(name)} = ", program, re.M) for name in times)
  assert len(set(times) & set(sources)) > len(times) / 2
  assert sum(t.launches for t in everything.values()) > sum(t.launches for t in times.values())  # the other program
  groups = op_profile.grouped(times, sources)
  assert any("layer_*/" in key for key in groups) and not any("layer_0" in key for key in groups)
  assert any(key.startswith("backward ") for key in groups) and any(key.startswith("forward ") for key in groups)
  assert sum(g.seconds for g in groups.values()) == pytest.approx(sum(t.seconds for t in times.values()))
  report = op_profile.report(times, sources, STEPS, step_seconds=1.0)
  total_ms = 1e3 * sum(t.seconds for t in times.values()) / STEPS
  assert f"device time per step {total_ms:.1f} ms" in report and "% of the 1000.0 ms step" in report


def test_the_command_reports_a_trace_and_refuses_files_that_are_no_trace_or_program(traced, tmp_path):
  trace, program = traced
  hlo = tmp_path / "step.hlo.txt"
  hlo.write_text(program)
  done = run_here("pretrain.op_profile", trace, f"--hlo={hlo}", f"--steps={STEPS}")
  assert done.returncode == 0, done.stderr
  assert "device time per step" in done.stdout and "layer_*/" in done.stdout
  not_hlo = tmp_path / "notes.txt"
  not_hlo.write_text("step times\n")
  done = run_here("pretrain.op_profile", trace, f"--hlo={not_hlo}")
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.strip().splitlines() == [f"pretrain.op_profile: error: {not_hlo}: not an HLO module's text: "
                                              "it does not begin with 'HloModule NAME'"]
  done = run_here("pretrain.op_profile", str(not_hlo))
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.strip().splitlines() == [f"pretrain.op_profile: error: {not_hlo}: not a jax.profiler trace "
                                              "(an .xplane.pb file): Failed to parse XSpace from array"]
  missing = tmp_path / "missing.xplane.pb"
  done = run_here("pretrain.op_profile", str(missing))
  assert done.returncode == 1 and done.stdout == ""
  assert done.stderr.strip().splitlines() == [f"pretrain.op_profile: error: [Errno 2] No such file or directory: "
                                              f"'{missing}'"]
