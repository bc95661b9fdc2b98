"""The persistent compilation cache (`pretrain.compilation_cache`) and the train step's cache beside it
(`pretrain.step_cache`): a resumed run compiles nothing and does not trace its train step, a changed setting
compiles and caches its own programs, on local disk and on Cloud Storage, and a damaged entry is compiled again
with a warning. Counted with JAX's compile and cache-hit events and the train step's traces, not timed."""
import re
import shutil
import subprocess
import warnings

import jax
import pytest

from helpers import SMALL_BERT, flip_a_bit, train
from pretrain import goodput, step_cache, steps

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

CACHE_ENTRY = "*-cache"  # the files JAX writes, one per executable


def cached_run(model_dir, cache, steps: int, *bindings):
  """A run in this process that, like a new process, finds no program in JAX's in-memory caches."""
  jax.clear_caches()
  return train("bert_tiny_demo", model_dir, steps, SMALL_BERT + [f"COMPILATION_CACHE_DIR = '{cache}'", *bindings])


@pytest.fixture
def step_traces(monkeypatch):
  """The train steps traced from here on (each `steps.lower_train_step` call traces one)."""
  traced, lower = [], steps.lower_train_step

  def counted(setup):
    traced.append(setup)
    return lower(setup)
  monkeypatch.setattr(steps, "lower_train_step", counted)
  return traced


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """(root, summary) of a 2-step run with an empty cache in root/cache; its MODEL_DIR is root/run."""
  root = tmp_path_factory.mktemp("compilation_cache")
  return root, cached_run(root / "run", root / "cache", 2)


def step_entries(cache):
  return sorted(p.name for p in (cache / step_cache.SUBDIRECTORY).iterdir())


def test_a_resumed_run_loads_every_program_untraced_and_says_so(first_run, step_traces, capsys):
  root, first = first_run
  assert first["compiled"] > 0 and first["loaded"] == 0, first
  assert len(list((root / "cache").glob(CACHE_ENTRY))) == first["compiled"]
  assert len(step_entries(root / "cache")) == 1
  capsys.readouterr()
  resumed = cached_run(root / "run", root / "cache", 4)
  assert resumed["steps"] == 4 and resumed["compiled"] == 0 and resumed["loaded"] > 0, resumed
  assert f"compilation cache {root / 'cache'}: all {resumed['loaded']} programs loaded (1 untraced), nothing " \
         "compiled" in capsys.readouterr().out
  assert step_traces == []
  compiles = [r for r in goodput.read_records(str(root / "run")) if r["kind"] == "compile"]
  assert [r["untraced"] for r in compiles if r["what"] == "train_step"] == [False, True]  # the first run, then this


def test_a_new_run_with_the_same_settings_loads_every_program_from_an_earlier_runs_cache(first_run, step_traces,
                                                                                          tmp_path):
  """COMPILATION_CACHE_DIR shared by runs in other MODEL_DIRs (here another seed, as in a sweep): a new run's first
  start compiles and traces nothing."""
  root, first = first_run
  shutil.copytree(root / "cache", tmp_path / "cache")  # the module's cache stays as its first run left it
  new = cached_run(tmp_path / "new_run", tmp_path / "cache", 2, "SEED = 1")
  assert new["steps"] == 2 and new["compiled"] == 0 and new["loaded"] == first["compiled"], (new, first)
  assert step_traces == []
  assert new["first_loss"] != first["first_loss"]  # its own weights and data order: the seed is a program's input


@pytest.mark.parametrize("damage", ["flipped", "partial"])
def test_a_damaged_train_step_entry_is_traced_and_compiled_with_a_warning(first_run, damage, step_traces, tmp_path,
                                                                          capsys):
  root, first = first_run
  shutil.copytree(root / "cache", tmp_path / "cache")
  entry = tmp_path / "cache" / step_cache.SUBDIRECTORY / step_entries(root / "cache")[0]
  if damage == "flipped":
    flip_a_bit(entry)
  else:
    entry.write_bytes(entry.read_bytes()[:entry.stat().st_size // 2])
  capsys.readouterr()
  again = cached_run(tmp_path / "run", tmp_path / "cache", 2)
  out = capsys.readouterr().out
  assert f"ignoring the cached train step {entry}: its checksum does not match (a write cut short or a damaged " \
         "file), removed it; tracing and compiling it" in out, out
  assert len(step_traces) == 1 and again["steps"] == 2
  assert again["compiled"] == 0, again  # JAX's cache, keyed by the traced program, serves its compile
  assert step_entries(tmp_path / "cache") == []  # and a step that JAX's cache gave is not kept again (below)


def test_a_step_that_jax_cache_gave_is_traced_at_each_start_not_kept(first_run, tmp_path, step_traces):
  """XLA's CPU executable loaded from JAX's cache and serialized again has lost its kernels: kept, it would
  load at the next start and fail at its first step ("Function ... not found"). Such a step is used, not kept."""
  root, _ = first_run
  for name in ("run", "cache"):
    shutil.copytree(root / name, tmp_path / name)
  shutil.rmtree(tmp_path / "cache" / step_cache.SUBDIRECTORY)  # the step's entry gone, JAX's still there
  for steps_reached in (5, 6):  # past where the module's other tests leave the run (2 or 4)
    resumed = cached_run(tmp_path / "run", tmp_path / "cache", steps_reached)
    assert resumed["steps"] == steps_reached and resumed["compiled"] == 0, resumed
  assert len(step_traces) == 2 and not (tmp_path / "cache" / step_cache.SUBDIRECTORY).exists()


def test_a_damaged_entry_is_compiled_again_with_a_warning(first_run, tmp_path):
  """A partial entry (a write cut short) and a corrupt one: each read fails, JAX warns and compiles it."""
  root, first = first_run
  shutil.copytree(root / "cache", tmp_path / "cache")
  partial, corrupt = sorted((tmp_path / "cache").glob(CACHE_ENTRY), key=lambda p: p.stat().st_size)[:2]
  partial.write_bytes(partial.read_bytes()[:len(partial.read_bytes()) // 2])
  corrupt.write_bytes(bytes(range(256)) * 4)
  with pytest.warns(UserWarning, match="Error reading persistent compilation cache entry") as warned:
    again = cached_run(tmp_path / "run", tmp_path / "cache", 2)  # the first run's programs
  assert len([w for w in warned if "persistent compilation cache" in str(w.message)]) == 2
  assert again["compiled"] == 2 and again["loaded"] == first["compiled"] - 2, again


def test_a_cache_that_cannot_be_written_costs_the_start_its_cache_said_in_one_line(tmp_path, capsys):
  """The cache's directory made immutable (root's writes refused too): the run compiles everything, JAX is given no
  cache to warn about at each entry, and the line after start-up says why, not that the programs were cached."""
  cache = tmp_path / "cache"
  cache.mkdir()
  subprocess.run(["chattr", "+i", str(cache)], check=True, capture_output=True)
  try:
    with warnings.catch_warnings():
      # JAX's warning about a cache entry it could not write or read would fail the run.
      warnings.filterwarnings("error", message=".*persistent compilation cache")
      summary = cached_run(tmp_path / "run", cache, 1)
  finally:
    subprocess.run(["chattr", "-i", str(cache)], check=True, capture_output=True)
  assert summary["steps"] == 1 and summary["loaded"] == 0 and summary["compiled"] > 0, summary
  assert list(cache.iterdir()) == []
  [line] = [line for line in capsys.readouterr().out.splitlines() if "compilation cache" in line]
  assert re.fullmatch(rf"no compilation cache \({cache} cannot be written: PermissionError: Operation not permitted\): "
                      r"\d+ programs compiled", line), line


def test_on_cloud_storage_a_changed_setting_compiles_what_changed_and_loads_the_rest(first_run, gcs_bucket,
                                                                                     monkeypatch):
  import fsspec
  root, first = first_run
  gcs, cache = fsspec.filesystem("gs"), f"{gcs_bucket}/compilation_cache"
  gcs.put(str(root / "cache"), cache, recursive=True)
  monkeypatch.setattr(step_cache, "KEPT", 1)  # the old setting's train step goes when the new one is kept
  changed = cached_run(f"{gcs_bucket}/changed", cache, 2, "LEARNING_RATE = 1e-3")
  assert changed["compiled"] > 0 and changed["loaded"] > 0, changed  # the steps changed; the init did not
  assert len(gcs.glob(f"{cache}/{CACHE_ENTRY}")) == first["compiled"] + changed["compiled"]
  kept = gcs.ls(f"{cache}/{step_cache.SUBDIRECTORY}")
  assert len(kept) == 1 and kept[0].rsplit("/", 1)[1] not in step_entries(root / "cache")


def test_on_cloud_storage_a_resumed_run_loads_its_train_step_untraced(first_run, gcs_bucket, step_traces):
  import fsspec
  root, _ = first_run
  gcs, cache = fsspec.filesystem("gs"), f"{gcs_bucket}/resumed_cache"
  gcs.put(str(root / "cache"), cache, recursive=True)
  cached_run(f"{gcs_bucket}/resumed", cache, 1)
  resumed = cached_run(f"{gcs_bucket}/resumed", cache, 2)
  assert resumed["steps"] == 2 and resumed["compiled"] == 0 and len(step_traces) == 0, resumed
