"""A resume whose settings do not fit the checkpoint stops before any compile with one line naming each
differing setting and both values; settings a run may change on resume do not stop it, and an array
saved in another dtype than the run's state is checked as saved, then cast, with a line."""
import gin
import pytest

from helpers import SMALL_BERT, logged_losses, run_module, train
from pretrain import cli
from pretrain import train as train_program


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("trained")
  train("bert_tiny_demo", model_dir, 2, SMALL_BERT + ["CHECKPOINT_EVERY_STEPS = 2"])
  return model_dir


def resume_flags(model_dir, *bindings):
  return ["--gin_file=gin_configs/runs/bert_tiny_demo.gin", *[f"--gin_bindings={b}" for b in SMALL_BERT],
          f"--gin.MODEL_DIR='{model_dir}'", "--gin.TRAIN_STEPS=3", *[f"--gin_bindings={b}" for b in bindings]]


def resume(model_dir, *bindings):
  gin.clear_config()
  cli.run("pretrain.train", lambda: train_program.main(["pretrain.train", *resume_flags(model_dir, *bindings)]))


@pytest.mark.parametrize("bindings, named", [
    (["BATCH_SIZE = 16"], ["BATCH_SIZE: 8 -> 16"]),
    (["TASK_FEATURE_LENGTHS = {'input_ids': 32, 'masked_positions': 5}"],
     ["TASK_FEATURE_LENGTHS: {'input_ids': 64, 'masked_positions': 10} -> {'input_ids': 32, 'masked_positions': 5}"]),
    (["bert.BertConfig.hidden_size = 32", "bert.BertConfig.scan_layers = True"],
     ["BertConfig.hidden_size: 64 -> 32", "BertConfig.scan_layers: False -> True"]),
])
def test_a_changed_setting_is_named_with_both_values(trained, bindings, named, capsys):
  with pytest.raises(SystemExit) as exited:
    resume(trained, *bindings)
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert exited.value.code == 1 and last.startswith("pretrain.train: error: this run does not match the checkpoint")
  for text in named:
    assert text in last, last


def test_another_optimizer_is_named_before_anything_is_restored(trained):
  """In a process of its own: the train step compiles in a thread beside the restore that fails, and a process
  that exits while a thread compiles aborts (Python's exit cuts the thread off in native code)."""
  process = run_module("pretrain.train", *resume_flags(trained, "OPTIMIZER = 'lamb'"))
  last = process.stderr.strip().splitlines()[-1]
  assert process.returncode == 1, process.stderr[-2000:]
  assert last.startswith("pretrain.train: error: the train state in step 2 has other arrays than this run's") and (
      "resume with the checkpoint's OPTIMIZER and its settings") in last, last


def test_settings_that_may_change_on_resume_do_not_stop_it(trained):
  resume(trained, "LOG_EVERY_STEPS = 1", "LEARNING_RATE = 1e-3", "bert.BertConfig.remat_policy = 'full'",
         "bert.BertConfig.dtype = 'bfloat16'", "bert.BertConfig.gelu_gradient = 'autodiff'")
  assert max(logged_losses(trained)) == 3


def _saved_small_state(directory):
  """(state, abstract state, a new data iterator) of a small state saved at step 1 in `directory`: XLNet's memory
  cache in fp32, as saved before it followed the compute dtype."""
  import jax
  import jax.numpy as jnp
  import tensorflow as tf

  from data_pipelines.input_pipeline import ShardIterators
  from pretrain import checkpoints

  def data_iterator():
    return ShardIterators({0: iter(tf.data.Dataset.range(10))}, num_shards=1)

  state = {"carry": {"mems": jnp.linspace(-2, 2, 24, dtype=jnp.float32).reshape(2, 3, 4)},
           "params": {"w": jnp.arange(5.0)}}
  manager = checkpoints.make_manager(str(directory), async_save=False)
  checkpoints.save(manager, 1, state, data_iterator(), {})
  manager.close()
  return state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state), data_iterator


def test_an_array_saved_in_another_dtype_is_checked_as_saved_then_cast_with_a_line(tmp_path):
  """As XLNet's memory cache, saved in fp32 before it followed the compute dtype, resumed by a bf16 run."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pretrain import checkpoints
  state, abstract, data_iterator = _saved_small_state(tmp_path)
  abstract["carry"]["mems"] = jax.ShapeDtypeStruct((2, 3, 4), jnp.bfloat16)
  restored, notes = checkpoints.restore(checkpoints.make_manager(str(tmp_path)), 1, abstract, data_iterator())
  assert restored["carry"]["mems"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(restored["carry"]["mems"], state["carry"]["mems"].astype(jnp.bfloat16))
  np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
  assert notes == ["step 1 holds ['carry']['mems'] as float32; cast to this run's bfloat16"]


def test_a_resume_in_the_saved_dtypes_does_not_read_orbax_metadata(tmp_path, monkeypatch):
  """The saved dtypes come from orbax's metadata, which opens every array (a second of a BERT-base resume): read
  only when the checksums of the arrays read in the run's dtypes do not match."""
  import numpy as np

  from pretrain import checkpoints
  state, abstract, data_iterator = _saved_small_state(tmp_path)
  read_metadata = []
  monkeypatch.setattr(checkpoints, "_with_saved_dtypes", lambda *args: read_metadata.append(args) or args[-1])
  restored, notes = checkpoints.restore(checkpoints.make_manager(str(tmp_path)), 1, abstract, data_iterator())
  np.testing.assert_array_equal(restored["carry"]["mems"], state["carry"]["mems"])
  assert notes == [] and read_metadata == []
