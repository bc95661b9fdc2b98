"""Export to HuggingFace and import back: a trained checkpoint becomes a transformers model and
tokenizer that agree with ours, the round trip is bit-exact, training continues from imported
weights, and bad input fails with one line and leaves no output behind."""
import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sentencepiece as spm
import torch
import transformers
from safetensors.torch import load_file

from helpers import EIGHT_DEVICE_STEPS, SMALL_BERT, run_here, train
from models import layers
from pretrain import checkpoints, cli, export, import_hf, registry
from pretrain.hf_mappings import bart as bart_mapping
from pretrain.hf_mappings.common import flatten_params

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

TOLERANCE = 1e-4  # fp32 logits of the same weights, our kernels vs torch's
# The other families' tiny demo runs, shrunk to stay fast (BERT's: SMALL_BERT).
FAST_RUNS = {
    "albert": ["TASK_FEATURE_LENGTHS = {'input_ids': 64, 'masked_positions': 10}", "BATCH_SIZE = 8",
               "albert.AlbertConfig.hidden_size = 64", "EVAL_EVERY_STEPS = 0"],
    "xlnet": ["SEQ_LEN = 64", "MEM_LEN = 16", "REUSE_LEN = 32", "NUM_PREDICT = 10", "BATCH_SIZE = 4"],
    "bart": ["TASK_FEATURE_LENGTHS = {'encoder_input_ids': 64, 'decoder_input_ids': 64}", "BATCH_SIZE = 8",
             "EVAL_EVERY_STEPS = 0"],
}
HF_CLASSES = {"bert": transformers.AutoModelForPreTraining, "albert": transformers.AutoModelForPreTraining,
              "xlnet": transformers.XLNetLMHeadModel, "bart": transformers.BartForConditionalGeneration}
TRICKY_TEXTS = ["The [MASK] sat on the [SEP] mat.", "[CLS]x[MASK]y", "  spaces   and\ttabs ", "</s> <pad> <s>",
                "ﬁne café ½ 日本 🙂", ""]


@pytest.fixture(scope="module")
def bert_dir(bert_on_eight_devices):
  """BERT trained on 8 host devices (mesh data=4, model=2), in its own process (conftest)."""
  return bert_on_eight_devices


def assert_tokenizer_matches(tokenizer, vocabulary, lines, frame):
  """Bare text gets the seqio ids exactly; by default the family's frame is added around them."""
  for text in lines + TRICKY_TEXTS:
    ids = [int(i) for i in vocabulary.encode(text)]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text
    assert tokenizer(text)["input_ids"] == frame(ids), text


def hf_features(family, tokenizer, texts):
  """(our features, transformers kwargs) for equal-length texts, tokenized by the exported tokenizer."""
  encoded = tokenizer(texts, truncation=True, max_length=12, return_tensors="np")
  ids = encoded["input_ids"].astype(np.int32)
  assert (encoded["attention_mask"] == 1).all()  # no padding: every text fills max_length
  if family == "bart":
    start = np.full((len(texts), 1), bart_mapping.EOS_ID, np.int32)  # fairseq starts from </s>
    decoder_ids = np.concatenate([start, ids[:, :-1]], axis=1)
    return ({"encoder_input_ids": ids, "decoder_input_ids": decoder_ids},
            {"input_ids": ids, "decoder_input_ids": decoder_ids})
  segments = encoded["token_type_ids"].astype(np.int32)
  return {"input_ids": ids, "segment_ids": segments}, {"input_ids": ids, "token_type_ids": segments}


def assert_hf_matches_ours(family, model_dir, hf_dir, texts):
  model, params, vocabulary = export.load_pretrained(str(model_dir))
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  hf_model = HF_CLASSES[family].from_pretrained(hf_dir).eval()
  assert type(hf_model).__name__ == registry.get(family).hf_class
  features, hf_inputs = hf_features(family, tokenizer, texts)
  ours = model.apply({"params": params}, features)
  with torch.no_grad():
    theirs = hf_model(**{k: torch.from_numpy(v).long() for k, v in hf_inputs.items()})
  pairs = {"bert": [("mlm_logits", "prediction_logits"), ("nsp_logits", "seq_relationship_logits")],
           "albert": [("mlm_logits", "prediction_logits"), ("sop_logits", "sop_logits")]}.get(family,
                                                                                        [("logits", "logits")])
  diffs = {key: float(np.abs(np.asarray(ours[key]) - getattr(theirs, hf_key).numpy()).max()) for key, hf_key in pairs}
  print(f"{family}: max |logits - transformers| {diffs}")
  assert max(diffs.values()) < TOLERANCE
  return tokenizer, vocabulary


def validation_lines(demo_paths, count):
  lines = [line for line in Path(demo_paths["validation"]).read_text().splitlines() if len(line.split()) > 12]
  assert len(lines) >= count
  return lines[:count]


def current_umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def test_bert_trained_on_eight_devices_exports_on_one(bert_dir, tmp_path, demo_paths, monkeypatch):
  assert jax.device_count() == 1
  monkeypatch.chdir(bert_dir.parent)
  summary = export.export(bert_dir.name, str(tmp_path / "hf"))  # a relative MODEL_DIR, as it was trained with
  assert summary["step"] == EIGHT_DEVICE_STEPS and max(summary["max_logit_diff"].values()) < export.TOLERANCE
  assert sorted(os.listdir(tmp_path)) == ["hf"]  # the staging directory is gone
  modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir()}
  assert set(modes.values()) == {0o666 & ~current_umask()}, modes  # others can read the weights, as the config
  lines = validation_lines(demo_paths, 300)
  tokenizer, vocabulary = assert_hf_matches_ours("bert", bert_dir, tmp_path / "hf", [lines[0], lines[1]])
  cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
  assert (cls, sep, tokenizer.mask_token_id, tokenizer.pad_token_id) == (4, 5, 6, 0)
  assert_tokenizer_matches(tokenizer, vocabulary, lines, lambda ids: [cls] + ids + [sep])
  first, second = [int(i) for i in vocabulary.encode("a b")], [int(i) for i in vocabulary.encode("c")]
  pair = tokenizer("a b", "c")
  assert pair["input_ids"] == [cls] + first + [sep] + second + [sep]
  assert pair["token_type_ids"] == [0] * (len(first) + 2) + [1] * (len(second) + 1)


def test_bfloat16_export_stores_bf16_close_to_fp32(bert_dir, tmp_path):
  export.export(str(bert_dir), str(tmp_path / "fp32"))
  summary = export.export(str(bert_dir), str(tmp_path / "bf16"), dtype="bfloat16")
  assert max(summary["max_logit_diff"].values()) < export.TOLERANCE  # same bf16 weights on both sides
  fp32, bf16 = load_file(str(tmp_path / "fp32" / "model.safetensors")), load_file(
      str(tmp_path / "bf16" / "model.safetensors"))
  assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
  for key, value in fp32.items():  # 8 significant bits, rounded to nearest: relative error at most 2^-8
    np.testing.assert_allclose(bf16[key].float().numpy(), value.numpy(), rtol=2.0 ** -8, atol=0)


def test_round_trip_is_bit_exact_and_training_continues_from_imported_weights(bert_dir, tmp_path):
  export.export(str(bert_dir), str(tmp_path / "hf"))
  import_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
  export.export(str(tmp_path / "imported"), str(tmp_path / "again"))
  first, again = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("hf", "again"))
  assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
  assert (tmp_path / "imported" / "vocab.model").read_bytes() == (bert_dir / "vocab.model").read_bytes()

  # A learning rate of 0 keeps the weights: step 1 must hold exactly the imported (= trained) ones.
  train("bert_tiny_demo", tmp_path / "imported", 1, SMALL_BERT + ["LEARNING_RATE = 0.0", "VOCAB_MODEL = None"],
        gin_files=[str(tmp_path / "imported" / "import.gin")])
  trained = flatten_params(checkpoints.restore_params(str(bert_dir), EIGHT_DEVICE_STEPS))
  continued = flatten_params(checkpoints.restore_params(str(tmp_path / "imported"), 1))
  assert trained.keys() == continued.keys() and all(np.array_equal(trained[k], continued[k]) for k in trained)
  assert checkpoints.has_data_iterator(str(tmp_path / "imported"), 1)


def test_imported_weights_continue_with_scanned_layers_and_export_the_same(bert_dir, tmp_path):
  export.export(str(bert_dir), str(tmp_path / "hf"))
  imported = tmp_path / "imported"
  import_hf.import_hf(str(tmp_path / "hf"), str(imported))
  keep_weights = ["LEARNING_RATE = 0.0", "VOCAB_MODEL = None"]
  train("bert_tiny_demo", imported, 1, SMALL_BERT + keep_weights + ["bert.BertConfig.scan_layers = True"],
        gin_files=[str(imported / "import.gin")])
  scanned = checkpoints.restore_params(str(imported), 1)
  assert scanned["encoder"]["layers"]["attention"]["norm"]["scale"].shape[0] == 2  # SMALL_BERT's 2 layers, stacked
  trained = flatten_params(checkpoints.restore_params(str(bert_dir), EIGHT_DEVICE_STEPS))
  continued = flatten_params(layers.unstack_layer_params(scanned))
  assert trained.keys() == continued.keys() and all(np.array_equal(trained[k], continued[k]) for k in trained)

  # The export of the scanned checkpoint is checked against the scanned model and holds the same weights.
  summary = export.export(str(imported), str(tmp_path / "again"))
  assert max(summary["max_logit_diff"].values()) < export.TOLERANCE
  first, again = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("hf", "again"))
  assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)

  # Resuming with the other layout would restore an optimizer state of the wrong shape: refused.
  with pytest.raises(ValueError, match="BertConfig.scan_layers: True -> False"):
    train("bert_tiny_demo", imported, 2, SMALL_BERT + keep_weights, gin_files=[str(imported / "import.gin")])


# The pretraining frame around one text (ids: <s>=3 </s>=1 [CLS]=4 [SEP]=5) and the padding side.
FRAMES = {"albert": (lambda ids: [4] + ids + [5], "right"), "xlnet": (lambda ids: ids + [5, 4], "left"),
          "bart": (lambda ids: [3] + ids + [1], "right")}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FRAMES))
def test_family_trains_exports_and_round_trips(family, tmp_path, demo_paths):
  train(f"{family}_tiny_demo", tmp_path / "run", 2, FAST_RUNS[family])
  export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  lines = validation_lines(demo_paths, 100)
  tokenizer, vocabulary = assert_hf_matches_ours(family, tmp_path / "run", tmp_path / "hf", [lines[0], lines[1]])
  frame, padding_side = FRAMES[family]
  assert_tokenizer_matches(tokenizer, vocabulary, lines, frame)
  assert tokenizer.padding_side == padding_side
  import_hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
  export.export(str(tmp_path / "imported"), str(tmp_path / "again"))
  first, again = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("hf", "again"))
  assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_bpe_vocabulary_tokenizes_like_seqio(tmp_path, demo_paths):
  from data_pipelines import vocab
  path = vocab.train_sentencepiece([demo_paths["train"]], 1000, str(tmp_path / "bpe"), model_type="bpe")
  tokenizer = export.hf_tokenizer(Path(path).read_bytes(), registry.get("bert").layout, 512)
  assert type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
  assert_tokenizer_matches(tokenizer, vocab.load_vocabulary(path), validation_lines(demo_paths, 300),
                           lambda ids: [4] + ids + [5])


def fake_checkpoint(model_dir, run_config, vocab_model):
  manager = checkpoints.make_manager(str(model_dir), async_save=False)
  manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": {"w": np.zeros(2, np.float32)}}),
                                          run_config=ocp.args.JsonSave(run_config)))
  manager.wait_until_finished()
  shutil.copy(vocab_model, Path(model_dir) / "vocab.model")
  return model_dir


BAD_INPUTS = {  # case -> (program, words of its one-line error)
    "no_checkpoint": ("pretrain.export", "no checkpoint"), "missing_step": ("pretrain.export", "step 7 not in"),
    "unknown_family": ("pretrain.export", "unknown model family 'gpt2'"),
    "output_not_empty": ("pretrain.export", "is not empty"),
    "output_is_a_file": ("pretrain.export", "notes.txt is a file"),
    "vocab_too_large": ("pretrain.export", "more than the model's vocab_size=100"),
    "vocab_cut_short": ("pretrain.export", "vocab.model' is not a sentencepiece model"),
    "unsupported_hf_model": ("pretrain.import_hf", "model_type='gpt2'"),
    "hf_config_cut_short": ("pretrain.import_hf", "config.json is not JSON"),
    "hf_weights_cut_short": ("pretrain.import_hf", "its weights cannot be read"),
    "hf_vocabulary_cut_short": ("pretrain.import_hf", "tokenizer.model is not a sentencepiece model")}
# Run from their command lines: one export case (its flags, one line and exit code) and every import case.
AS_PROGRAMS = ("no_checkpoint", *(case for case, (program, _) in BAD_INPUTS.items() if program == "pretrain.import_hf"))


def exported_in_this_process(arguments):
  """(stderr, exit code) of pretrain.export with these `--flag=value` arguments, run through cli.run as its main is."""
  flags = dict(argument.split("=", 1) for argument in arguments)
  step = int(flags["--step"]) if "--step" in flags else None
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
    cli.run("pretrain.export", lambda: export.export(flags["--model_dir"], flags["--output_dir"], step))
  return stderr.getvalue(), exited.value.code


@pytest.fixture(scope="module")
def bad_runs(bert_dir, tmp_path_factory, demo_paths):
  """Runs every bad input: ({case: (stderr, exit code)}, folder, its listing). AS_PROGRAMS run from their command
  lines; the other export cases through pretrain.export's function."""
  root = tmp_path_factory.mktemp("bad")
  (root / "empty" / "checkpoints").mkdir(parents=True)
  (root / "taken").mkdir()
  (root / "taken" / "keep.txt").write_text("mine")
  (root / "notes.txt").write_text("mine")
  (root / "gpt2_hf").mkdir()
  gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
  (root / "gpt2_hf" / "config.json").write_text(json.dumps(gpt2))
  pieces = spm.SentencePieceProcessor(model_file=demo_paths["vocab_model"]).get_piece_size()
  tiny_bert = transformers.BertConfig(vocab_size=pieces, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                      intermediate_size=8)
  for part in ("config", "weights", "vocabulary"):  # a HuggingFace BERT with that file cut to half its bytes
    hf_dir = root / f"hf_{part}_cut_short"
    transformers.BertForPreTraining(tiny_bert).save_pretrained(hf_dir)
    shutil.copy(demo_paths["vocab_model"], hf_dir / "tokenizer.model")
    cut = hf_dir / {"config": "config.json", "weights": "model.safetensors", "vocabulary": "tokenizer.model"}[part]
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
  small_bert = {"family": "bert", "model_config": {"vocab_size": 100, "hidden_size": 8, "num_layers": 1,
                                                    "num_heads": 1, "mlp_dim": 8}, "vocab_model": "vocab.model"}
  gpt = fake_checkpoint(root / "gpt", {**small_bert, "family": "gpt2"}, demo_paths["vocab_model"])
  small = fake_checkpoint(root / "small", small_bert, demo_paths["vocab_model"])
  cut = fake_checkpoint(root / "cut", small_bert, demo_paths["vocab_model"])
  (cut / "vocab.model").write_bytes((cut / "vocab.model").read_bytes()[:1000])
  output = lambda case: f"--output_dir={root / case}"
  args = {"no_checkpoint": [f"--model_dir={root / 'empty'}", output("no_checkpoint")],
          "missing_step": [f"--model_dir={bert_dir}", "--step=7", output("missing_step")],
          "unknown_family": [f"--model_dir={gpt}", output("unknown_family")],
          "vocab_too_large": [f"--model_dir={small}", output("vocab_too_large")],
          "vocab_cut_short": [f"--model_dir={cut}", output("vocab_cut_short")],
          "output_not_empty": [f"--model_dir={bert_dir}", output("taken")],
          "output_is_a_file": [f"--model_dir={bert_dir}", output("notes.txt")],
          "unsupported_hf_model": [f"--hf_dir={root / 'gpt2_hf'}", f"--model_dir={root / 'imported'}"],
          **{case: [f"--hf_dir={root / case}", f"--model_dir={root / 'imported'}"]
             for case in ("hf_config_cut_short", "hf_weights_cut_short", "hf_vocabulary_cut_short")}}
  before = sorted(os.listdir(root))
  programs = {case: run_here(BAD_INPUTS[case][0], *args[case]) for case in AS_PROGRAMS}
  results = {case: exported_in_this_process(arguments) for case, arguments in args.items() if case not in programs}
  results.update({case: (program.stderr, program.returncode) for case, program in programs.items()})
  return results, root, before


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_with_one_line_and_no_output(case, bad_runs):
  results, root, before = bad_runs
  stderr, returncode = results[case]
  program, message = BAD_INPUTS[case]
  last = stderr.strip().splitlines()[-1]
  assert returncode != 0 and last.startswith(f"{program}: error:") and message in last, stderr[-1500:]
  assert sorted(os.listdir(root)) == before  # no output and no staging directory, for any case
  assert os.listdir(root / "taken") == ["keep.txt"] and (root / "notes.txt").read_text() == "mine"
