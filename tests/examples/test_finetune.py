"""The fine-tuning examples: the docstring-classes task, and a few steps of each example on conftest's tiny
BERT (its export for transformers, its MODEL_DIR for JAX), in this process."""
import sys

import numpy as np
import pytest

from helpers import EIGHT_DEVICE_STEPS, ROOT

sys.path.insert(0, str(ROOT / "examples"))  # the examples import each other as scripts do
import docstring_classes  # noqa: E402
import finetune_hf  # noqa: E402
import finetune_jax  # noqa: E402

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

NUM_CLASSES = 3
STEPS = 100  # the tiny model's loss stays near log(3) for some 40 steps, then falls
FEW_STEPS = [f"--steps={STEPS}", "--batch_size=32", "--learning_rate=2e-3", f"--num_classes={NUM_CLASSES}",
             "--max_length=32"]


@pytest.fixture(scope="module")
def task():
  return docstring_classes.load_task(NUM_CLASSES)


@pytest.fixture(scope="module")
def hf_dir(bert_on_eight_devices, tmp_path_factory):
  from pretrain import export
  out = tmp_path_factory.mktemp("finetune") / "hf"
  export.export(str(bert_on_eight_devices), str(out))
  return out


@pytest.fixture
def one_torch_thread():
  """torch's CPU threads wait for each other by spinning: with another busy process on a 2-CPU machine
  a step of this tiny model takes 40 times longer on 2 threads than on 1."""
  import torch
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


def spy(monkeypatch, module, name):
  """Replaces module.name by a wrapper that records each call's (args, result)."""
  calls, original = [], getattr(module, name)

  def wrapper(*args, **kwargs):
    result = original(*args, **kwargs)
    calls.append((args, result))
    return result
  monkeypatch.setattr(module, name, wrapper)
  return calls


def assert_learned(results, capsys):
  assert list(results) == ["pretrained", "random"]
  for result in results.values():
    losses = result["losses"]
    assert len(losses) == STEPS and np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.2, losses
    assert 1 / NUM_CLASSES + 0.1 < result["accuracy"] <= 1  # on held-out sentences: it generalises
  table = capsys.readouterr().out
  assert "held-out accuracy" in table and "chance: 0.333" in table


def test_task_has_balanced_classes_and_a_disjoint_held_out_split(task):
  assert len(task.labels) == NUM_CLASSES == len(set(task.labels))
  train, test = {s for s, _ in task.train}, {s for s, _ in task.test}
  assert len(train) == len(task.train) and len(test) == len(task.test)  # each sentence once
  assert not train & test
  sizes = np.bincount([label for _, label in task.train + task.test])
  assert len(set(sizes)) == 1 and sizes[0] > 300  # balanced: chance is 1 / NUM_CLASSES
  assert 0.15 < len(test) / (len(train) + len(test)) < 0.25
  assert np.bincount([label for _, label in task.test], minlength=NUM_CLASSES).min() > 50  # every class held out
  batches = [list(docstring_classes.train_batches(task, 8, 3, seed=1)) for _ in range(2)]
  assert all(a[0] == b[0] for a, b in zip(*batches))  # the same batches for both starts
  assert all(set(texts) <= train for texts, _ in batches[0])


def test_hf_example_fine_tunes_the_export_and_a_random_start(hf_dir, task, capsys, monkeypatch, one_torch_thread):
  from safetensors.numpy import load_file
  loads = spy(monkeypatch, finetune_hf, "load")
  evaluated = spy(monkeypatch, finetune_hf, "accuracy")
  results = finetune_hf.main([f"--export_dir={hf_dir}", *FEW_STEPS])
  assert_learned(results, capsys)
  assert [args[2] for args, _ in evaluated] == [task.test, task.test]
  assert [args[2] for args, _ in loads] == [True, False]  # pretrained, then random

  exported = load_file(str(hf_dir / "model.safetensors"))
  name = "bert.embeddings.word_embeddings.weight"
  (pretrained, _), (random, _) = (finetune_hf.load(str(hf_dir), NUM_CLASSES, start, 0) for start in (True, False))
  assert np.array_equal(pretrained.state_dict()[name].numpy(), exported[name])
  assert not np.allclose(random.state_dict()[name].numpy(), exported[name])
  assert pretrained.classifier.out_features == random.classifier.out_features == NUM_CLASSES


def test_jax_example_fine_tunes_the_checkpoint_and_a_random_start(bert_on_eight_devices, task, capsys, monkeypatch):
  from flax import traverse_util

  from pretrain import checkpoints
  finetunes = spy(monkeypatch, finetune_jax, "finetune")
  evaluated = spy(monkeypatch, finetune_jax, "accuracy")
  results = finetune_jax.main([f"--model_dir={bert_on_eight_devices}", *FEW_STEPS])
  assert_learned(results, capsys)
  assert [args[3] for args, _ in evaluated] == [task.test, task.test]
  flat = lambda tree: traverse_util.flatten_dict(tree, sep="/")
  trained = flat(checkpoints.restore_params(str(bert_on_eight_devices), EIGHT_DEVICE_STEPS))
  (pretrained_args, (pretrained_end, _)), (random_args, (random_end, _)) = finetunes
  pretrained_start, random_start = pretrained_args[1], random_args[1]
  started_from = flat(pretrained_start["model"])
  assert started_from.keys() == trained.keys() and all(np.array_equal(started_from[k], trained[k]) for k in trained)
  assert not np.allclose(flat(random_start["model"])["encoder/embeddings/word/embedding"],
                         trained["encoder/embeddings/word/embedding"])
  for start, end in ((pretrained_start, pretrained_end), (random_start, random_end)):
    assert flat(start["head"]).keys() == flat(end["head"]).keys() == {"output/kernel", "output/bias"}
    assert all(not np.allclose(start["head"]["output"][k], end["head"]["output"][k]) for k in ("kernel", "bias"))
    assert not np.allclose(flat(start["model"])["encoder/embeddings/word/embedding"],
                           flat(end["model"])["encoder/embeddings/word/embedding"])  # every weight is fine-tuned
  assert all(np.array_equal(pretrained_start["head"]["output"][k], random_start["head"]["output"][k])
             for k in ("kernel", "bias"))  # the same head for the same seed


BAD_DIRECTORIES = {  # example -> (its flag, its error for a missing directory, for the other kind of directory)
    "finetune_hf": ("--export_dir", "no such directory", "no config.json"),
    "finetune_jax": ("--model_dir", "no checkpoint", "no checkpoint"),
}


@pytest.mark.parametrize("name", sorted(BAD_DIRECTORIES))
def test_bad_directory_fails_with_one_line(name, tmp_path, bert_on_eight_devices, hf_dir, capsys):
  from pretrain import cli
  example = {"finetune_hf": finetune_hf, "finetune_jax": finetune_jax}[name]
  flag, missing, mixed_up = BAD_DIRECTORIES[name]
  other_kind = bert_on_eight_devices if name == "finetune_hf" else hf_dir  # the usual mix-up
  for directory, message in ((tmp_path / "missing", missing), (other_kind, mixed_up)):
    with pytest.raises(SystemExit) as exited:
      cli.run(name, lambda: example.main([f"{flag}={directory}", "--steps=1"]))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 1 and last.startswith(f"{name}: error:") and message in last, last
  assert f"python examples/{name}.py {flag}=" in example.make_parser().format_help()  # --help has an example
