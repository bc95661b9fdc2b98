"""The train step cache's key (`pretrain.step_cache`): the same run's settings give the same key, in this
process and another, and each kind of thing a train step is made of changes it. Its loads, misses and damaged
entries in real runs are in test_compilation_cache.py."""
import os
import re
import runpy
import shutil
import sys
import time

import pytest
from etils import epath

from helpers import ROOT, run, step_cache_key
from pretrain import step_cache


def test_the_same_settings_give_the_same_key_in_another_process():
  other = run([sys.executable, "-c", "import sys; sys.path.append('tests'); from helpers import step_cache_key; "
               "print(step_cache_key())"])
  assert other.returncode == 0, other.stderr[-2000:]
  assert other.stdout.split()[-1] == step_cache_key() == step_cache_key()


@pytest.mark.parametrize("change", [
    "bert.BertConfig.dropout_rate = 0.2",  # the model
    "LEARNING_RATE = 1e-3",  # the schedule, inside the optimizer
    "WEIGHT_DECAY = 0.02",  # the optimizer
    "BATCH_SIZE = 16",  # the shapes
    "MICROBATCHES = 2",  # the step
])
def test_what_makes_the_step_changes_the_key(change):
  assert step_cache_key(change) != step_cache_key()


def test_a_changed_source_file_changes_the_key(tmp_path):
  for copy in ("same", "changed"):
    for package in step_cache.PACKAGES:
      shutil.copytree(ROOT / package, tmp_path / copy / package, ignore=shutil.ignore_patterns("__pycache__"))
  layers = tmp_path / "changed" / "models" / "layers.py"
  layers.write_text(layers.read_text() + "\n# a comment is a change: nothing reads code to know what matters\n")
  assert step_cache.source_digest(tmp_path / "same") == step_cache.source_digest(ROOT)
  assert step_cache.source_digest(tmp_path / "changed") != step_cache.source_digest(ROOT)


def test_a_cache_keeps_its_newest_entries_and_removes_abandoned_partial_writes(tmp_path):
  now = time.time()
  seconds_old = {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10,
                 "just_kept": 100,  # kept, whatever its time says (another clock than the others')
                 ".c.1.partial": 2 * 3600,  # a process stopped while writing
                 ".g.2.partial": 5}  # a write under way
  for name, age in seconds_old.items():
    (tmp_path / name).write_bytes(b"an executable")
    os.utime(tmp_path / name, (now - age, now - age))
  step_cache.prune(epath.Path(tmp_path), keep=3, newest=epath.Path(tmp_path / "just_kept"))
  assert sorted(p.name for p in tmp_path.iterdir()) == [".g.2.partial", "d", "e", "just_kept"]


def test_the_step_loading_benchmark_loads_the_step_untraced(capsys, monkeypatch):
  """benchmarks/step_loading.py at tiny size on the CPU, in this process (it exits if the step cache did not give
  the train step untraced); timings are printed, not asserted."""
  monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  main = runpy.run_path("benchmarks/step_loading.py")["main"]
  main(["--families=bert", "--sizes=tiny"])
  rows = re.findall(r"^bert tiny\s+[\d.]+M((?:\s+[\d.]+){5})\s+[\d.]+x$", capsys.readouterr().out, re.M)
  assert len(rows) == 1 and all(float(s) > 0 for s in rows[0].split()), rows
