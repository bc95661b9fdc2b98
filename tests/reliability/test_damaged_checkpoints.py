"""A damaged newest checkpoint is caught at restore, named, set aside, and the run resumes from the newest
intact one; with none intact it stops, moving nothing. A save killed part-way is never loaded and its
leftovers are removed with a line that names them."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, SMALL_BERT, train
from pretrain import checkpoints
from pretrain.errors import TrainingStopped

BINDINGS = SMALL_BERT + ["CHECKPOINT_EVERY_STEPS = 2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run with checkpoints at steps 2 and 4."""
  model_dir = tmp_path_factory.mktemp("trained") / "run"
  train("bert_tiny_demo", model_dir, 4, BINDINGS)
  return model_dir


def copy_of(trained, tmp_path):
  shutil.copytree(trained, tmp_path / "run")
  return tmp_path / "run"


def largest_array_file(step_dir):
  return max((p for p in (step_dir / "state").rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_a_bit(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x08
  path.write_bytes(bytes(data))


def truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


DAMAGE = {
    "a flipped bit in array data": (lambda step: flip_a_bit(largest_array_file(step)), "checksum mismatch"),
    "truncated array data": (lambda step: truncate(largest_array_file(step)), "unreadable"),
    "a broken state metadata file": (lambda step: truncate(step / "state" / "_METADATA"), "unreadable"),
    "a missing state directory": (lambda step: shutil.rmtree(step / "state"), "unreadable"),
    "a garbage data-iterator file": (
        lambda step: next((step / "data_iterator").glob("process_0.data*")).write_bytes(b"garbage" * 99), "unreadable"),
    "a broken run config": (lambda step: truncate(step / "run_config" / "metadata"), "run_config is unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_resumes(damage, trained, tmp_path,
                                                                                    capsys):
  model_dir = copy_of(trained, tmp_path)
  make_damage, what = DAMAGE[damage]
  make_damage(model_dir / "checkpoints" / "4")
  capsys.readouterr()
  summary = train("bert_tiny_demo", model_dir, 2, BINDINGS)  # resumes at 2 of 2: restores, runs no step
  out = capsys.readouterr().out
  assert summary["steps"] == 2
  named = [line for line in out.splitlines() if "is damaged" in line]
  assert len(named) == 1 and f"checkpoint {model_dir / 'checkpoints' / '4'} is damaged" in named[0], out
  assert what in named[0] and f"set aside in {model_dir / 'damaged' / '4'}" in named[0], named
  assert f"resumed from step 2 in {model_dir / 'checkpoints'}" in out
  assert (model_dir / "damaged" / "4").is_dir() and not (model_dir / "checkpoints" / "4").exists()


def test_with_no_intact_checkpoint_the_run_stops_and_moves_nothing(trained, tmp_path):
  model_dir = copy_of(trained, tmp_path)
  for step in (2, 4):
    flip_a_bit(largest_array_file(model_dir / "checkpoints" / str(step)))
  with pytest.raises(TrainingStopped, match=r"no checkpoint in .* can be restored \(step 4: .*checksum mismatch.*; "
                                            r"step 2: .*checksum mismatch.*\); nothing was moved or deleted"):
    train("bert_tiny_demo", model_dir, 6, BINDINGS)
  assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["2", "4"]


SAVE_IN_A_LOOP = """
import sys, jax.numpy as jnp, tensorflow as tf
from pretrain import checkpoints
manager = checkpoints.make_manager(sys.argv[1], max_to_keep=100)
state = {"weights": jnp.arange(2**25, dtype=jnp.float32).reshape(2**12, 2**13)}  # 128 MiB
iterator = iter(tf.data.Dataset.range(10**6))
for step in range(1, 10**6):
  next(iterator)
  manager.wait_until_finished()
  checkpoints.save(manager, step, {**state, "step": jnp.int32(step)}, iterator, {"step": step})
  print("saving", step, flush=True)
"""


def test_a_save_killed_part_way_is_never_loaded_and_its_leftovers_are_removed(tmp_path):
  """SIGKILL at several delays after a save begins: the newest complete checkpoint restores intact, with
  its data position, and the unfinished one is removed."""
  import jax
  import jax.numpy as jnp
  import tensorflow as tf
  abstract = {"weights": jax.ShapeDtypeStruct((2**12, 2**13), jnp.float32), "step": jax.ShapeDtypeStruct((), jnp.int32)}
  leftovers = 0
  for delay in (0.0, 0.2, 0.5):
    model_dir = tmp_path / f"killed_after_{delay}"
    saving = subprocess.Popen([sys.executable, "-c", SAVE_IN_A_LOOP, str(model_dir)], cwd=ROOT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    for line in saving.stdout:
      if line.startswith("saving 2"):
        time.sleep(delay)
        saving.send_signal(signal.SIGKILL)
        break
    saving.wait()
    unfinished = checkpoints.unfinished_saves(model_dir)
    leftovers += len(unfinished)
    manager = checkpoints.make_manager(model_dir)
    newest = manager.latest_step()
    assert newest in (1, 2, 3) and all(int(name.split(".")[0]) > newest for name in unfinished), (newest, unfinished)
    iterator = iter(tf.data.Dataset.range(10**6))
    restored, data_note = checkpoints.restore(manager, newest, abstract, iterator)
    assert data_note is None and int(restored["step"]) == newest and int(next(iterator)) == newest
    checkpoints.save(manager, 100, restored, iterator, {})  # the manager clears the leftovers before a save
    manager.wait_until_finished()
    assert checkpoints.unfinished_saves(model_dir) == []
    manager.close()
  assert leftovers > 0, "no kill landed inside a save: the delays missed every save"
