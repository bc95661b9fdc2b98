"""The persistent compilation cache (`pretrain.compilation_cache`): a resumed run compiles nothing, a changed
setting compiles and caches its own programs, on local disk and on Cloud Storage, and a damaged entry is
compiled again with a warning. Counted with JAX's compile and cache-hit events, not timed."""
import shutil

import jax
import pytest

from helpers import SMALL_BERT, train

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

CACHE_ENTRY = "*-cache"  # the files JAX writes, one per executable


def cached_run(model_dir, cache, steps: int, *bindings):
  """A run in this process that, like a new process, finds no program in JAX's in-memory caches."""
  jax.clear_caches()
  return train("bert_tiny_demo", model_dir, steps, SMALL_BERT + [f"COMPILATION_CACHE_DIR = '{cache}'", *bindings])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
  """(root, summary) of a 2-step run with an empty cache in root/cache; its MODEL_DIR is root/run."""
  root = tmp_path_factory.mktemp("compilation_cache")
  return root, cached_run(root / "run", root / "cache", 2)


def test_a_resumed_run_loads_every_program_and_says_so(first_run, capsys):
  root, first = first_run
  assert first["compiled"] > 0 and first["loaded"] == 0, first
  assert len(list((root / "cache").glob(CACHE_ENTRY))) == first["compiled"]
  capsys.readouterr()
  resumed = cached_run(root / "run", root / "cache", 4)
  assert resumed["steps"] == 4 and resumed["compiled"] == 0 and resumed["loaded"] > 0, resumed
  assert f"compilation cache {root / 'cache'}: all {resumed['loaded']} programs loaded, nothing compiled" in (
      capsys.readouterr().out)


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


def test_on_cloud_storage_a_changed_setting_compiles_what_changed_and_loads_the_rest(first_run, gcs_bucket):
  import fsspec
  root, first = first_run
  gcs, cache = fsspec.filesystem("gs"), f"{gcs_bucket}/compilation_cache"
  for entry in (root / "cache").glob(CACHE_ENTRY):
    gcs.put_file(str(entry), f"{cache}/{entry.name}")
  changed = cached_run(f"{gcs_bucket}/changed", cache, 2, "LEARNING_RATE = 1e-3")
  assert changed["compiled"] > 0 and changed["loaded"] > 0, changed  # the steps changed; the init did not
  assert len(gcs.ls(cache)) == first["compiled"] + changed["compiled"]
