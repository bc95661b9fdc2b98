"""gs:// for real: training, checkpoints, resume, metrics, export and import against a local Cloud
Storage server (conftest's gcs_bucket), with the text and the vocabulary read from the bucket too.

Every path of these runs is gs://: orbax writes the arrays through tensorstore, epath and
data_pipelines.storage the rest through gcsfs, and what only TensorFlow can do (tf.data's text
reading, the vocabulary, the data iterator's tf.train.Checkpoint, TensorBoard events) is staged on the
local disk by data_pipelines.storage and copied to or from the bucket.
"""
import json
import os
import subprocess

import numpy as np
import pytest

from helpers import ROOT, SMALL_BERT, flip_a_bit, module_command, train

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

STEPS, STOP_AT = 6, 3


@pytest.fixture(scope="module")
def gcs_data(gcs_bucket, demo_paths):
  """The demo text and vocabulary, uploaded: {'train', 'validation', 'vocab_model'} as gs:// paths."""
  import fsspec
  data = {name: f"{gcs_bucket}/data/{os.path.basename(path)}" for name, path in demo_paths.items()}
  for name, path in demo_paths.items():
    fsspec.filesystem("gs").put_file(path, data[name])
  return data


def bindings(data):
  return SMALL_BERT + ["LOG_EVERY_STEPS = 1", f"CHECKPOINT_EVERY_STEPS = {STOP_AT}",
                       "optimizers.warmup_linear_decay.total_steps = 6", f"TRAIN_FILES = '{data['train']}'",
                       f"VALIDATION_FILES = '{data['validation']}'", f"VOCAB_MODEL = '{data['vocab_model']}'"]


def metrics_rows(model_dir):
  from etils import epath
  return [json.loads(line) for line in (epath.Path(model_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def gcs_runs(gcs_bucket, gcs_data):
  """MODEL_DIRs in the bucket: 'straight' trained STEPS steps in this process; 'split' stopped at STOP_AT
  in this process, then resumed by `python -m pretrain.train` with nothing but STORAGE_EMULATOR_HOST
  set: the program points epath, gcsfs and tensorstore at the server itself."""
  runs = {"straight": f"{gcs_bucket}/straight", "split": f"{gcs_bucket}/split"}
  train("bert_tiny_demo", runs["straight"], STEPS, bindings(gcs_data))
  train("bert_tiny_demo", runs["split"], STOP_AT, bindings(gcs_data))
  derived = {"EPATH_USE_TF", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
             "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
  env = {k: v for k, v in os.environ.items() if k not in derived}
  result = subprocess.run(module_command("pretrain.train", "--gin_file=gin_configs/runs/bert_tiny_demo.gin",
                                         *[f"--gin_bindings={b}" for b in bindings(gcs_data)],
                                         f"--gin.MODEL_DIR='{runs['split']}'", f"--gin.TRAIN_STEPS={STEPS}"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"resumed from step {STOP_AT} in {runs['split']}/checkpoints" in result.stdout, result.stdout[-2000:]
  return runs


def test_training_on_gs_resumes_exactly(gcs_runs):
  """The resumed run (train state through tensorstore, data position through the staged
  tf.train.Checkpoint) logs the losses of the uninterrupted one, bit for bit."""
  straight, split = (metrics_rows(gcs_runs[name]) for name in ("straight", "split"))
  assert [r["step"] for r in split] == list(range(1, STEPS + 1))  # appended across the two runs, not replaced
  assert [r["loss"] for r in split] == [r["loss"] for r in straight]
  assert np.isfinite([r["loss"] for r in straight]).all() and straight[0]["loss"] != straight[-1]["loss"]


def test_outputs_of_a_run_land_in_the_bucket(gcs_runs, gcs_data):
  from etils import epath

  from pretrain import checkpoints
  model_dir = epath.Path(gcs_runs["straight"])
  assert sorted(int(p.name) for p in (model_dir / "checkpoints").iterdir()) == [STOP_AT, STEPS]
  step_dir = model_dir / "checkpoints" / str(STEPS)
  assert {"state", "data_iterator", "run_config", "checksums"} <= {p.name for p in step_dir.iterdir()}
  assert [p.name for p in (step_dir / "data_iterator").iterdir() if p.name.endswith(".index")] == ["shard_0_of_1.index"]
  assert checkpoints.unfinished_saves(str(model_dir)) == []
  assert (model_dir / "vocab.model").read_bytes() == epath.Path(gcs_data["vocab_model"]).read_bytes()
  events = list((model_dir / "tensorboard" / "train").iterdir())
  assert len(events) == 1 and events[0].name.startswith("events.out.tfevents.")
  assert _logged_scalars(events[0], "loss") == [r["loss"] for r in metrics_rows(model_dir)]
  assert not (model_dir / "RUNNING").exists()  # the lease is given back


def test_a_damaged_newest_checkpoint_in_the_bucket_is_set_aside(gcs_runs, gcs_bucket, gcs_data, capsys):
  """A bit flipped in the newest checkpoint's array data, in the bucket: the resume names it, moves it to
  MODEL_DIR/damaged/<step> in the bucket, and restores the older one."""
  import fsspec
  from etils import epath
  bucket, model_dir = fsspec.filesystem("gs"), f"{gcs_bucket}/damaged_run"
  bucket.copy(f"{gcs_runs['straight']}/checkpoints", f"{model_dir}/checkpoints", recursive=True)
  state = bucket.find(f"{model_dir}/checkpoints/{STEPS}/state", detail=True)
  arrays = {path: info["size"] for path, info in state.items() if "/d/" in path}
  flip_a_bit(epath.Path(f"gs://{max(arrays, key=arrays.get)}"))
  capsys.readouterr()
  assert train("bert_tiny_demo", model_dir, STOP_AT, bindings(gcs_data))["steps"] == STOP_AT  # restores, trains none
  out = capsys.readouterr().out
  assert (f"checkpoint {model_dir}/checkpoints/{STEPS} is damaged: the data of " in out and "(checksum mismatch); set "
          f"aside in {model_dir}/damaged/{STEPS}\n" in out), out
  assert f"resumed from step {STOP_AT} in {model_dir}/checkpoints" in out
  assert bucket.exists(f"{model_dir}/damaged/{STEPS}/state") and not bucket.exists(f"{model_dir}/checkpoints/{STEPS}")


def _logged_scalars(event_file, tag):
  """The values of `tag` in a TensorBoard event file, read back from the bucket."""
  import tensorflow as tf
  from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

  from data_pipelines import storage
  values = []
  for event in LegacyEventFileLoader(storage.tf_readable(str(event_file))).Load():
    for value in event.summary.value:
      if value.tag == tag:
        values.append(float(tf.make_ndarray(value.tensor)))
  return values


def test_export_and_import_between_buckets(gcs_runs, gcs_bucket):
  """export reads gs:// and writes the HF directory to gs://; import_hf reads it back into a new gs://
  MODEL_DIR; both load the same params as the trained checkpoint."""
  from etils import epath

  from pretrain import export, import_hf
  hf_dir, imported = f"{gcs_bucket}/hf", f"{gcs_bucket}/imported"
  assert export.export(gcs_runs["straight"], hf_dir, check=False)["step"] == STEPS  # the check reads a local copy
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"} <= {
      p.name for p in epath.Path(hf_dir).iterdir()}
  import_hf.import_hf(hf_dir, imported)
  _, trained, _ = export.load_pretrained(gcs_runs["straight"])
  _, loaded, vocabulary = export.load_pretrained(imported)
  flat_trained, flat_loaded = (dict(_flatten(p)) for p in (trained, loaded))
  assert flat_trained.keys() == flat_loaded.keys()
  for name, value in flat_trained.items():
    np.testing.assert_array_equal(flat_loaded[name], value, err_msg=name)
  assert vocabulary.encode("gs:// works") == export.load_pretrained(gcs_runs["straight"])[2].encode("gs:// works")


def _flatten(tree, prefix=""):
  for key, value in tree.items():
    yield from _flatten(value, f"{prefix}{key}/") if isinstance(value, dict) else [(prefix + key, value)]


def test_xlnet_token_files_are_made_and_read_on_gs(gcs_data, gcs_bucket, demo_paths, tmp_path):
  """XLNet's input in the bucket: split_text cuts the text into parts there, token_files tokenizes them
  into a token directory there, and TokenFile reads spans back (ranged reads, across parts and around
  the end): the same tokens as the same steps on local files."""
  from data_pipelines import split_text, tasks, token_files
  read = {}
  for where, text, root in (("gs", gcs_data["validation"], f"{gcs_bucket}/xlnet"),
                            ("local", demo_paths["validation"], str(tmp_path))):
    assert split_text.split_text(text, f"{root}/parts", 3) == 3
    name = tasks.text_task("xlnet_plm", f"{root}/parts/*.txt", vocab_model=gcs_data["vocab_model"],
                           corpus=f"gcs_test_{where}", token_dir=f"{root}/tokens")
    token_files.write(tasks.get_task_or_mixture(name), "train", f"{root}/tokens/train", progress=False)
    tokens = token_files.TokenFile(f"{root}/tokens/train")
    middle = tokens.info["parts"][0]["tokens"] - 7  # across the first two parts
    read[where] = ([p["tokens"] for p in tokens.info["parts"]], tokens.read(middle, 20),
                   tokens.read_text(tokens.size - 10, 30, backward=True)[0], tokens.read(0, tokens.size))
  assert read["gs"][0] == read["local"][0] and min(read["gs"][0]) > 0
  for ours, theirs in zip(read["gs"][1:], read["local"][1:]):
    np.testing.assert_array_equal(ours, theirs)
