"""Bad input ends pretrain.train before any training with one line naming the file, setting or value and
exit code 1, or is skipped with a warning that counts it. The runs fail early, so they run in this process
(tests/pretrain/test_cli.py has the bad bindings and flags; tests/data_pipelines the empty and non-UTF-8
text)."""
import io
import re
import subprocess

import pytest
import seqio
import sentencepiece as spm

from helpers import host_devices, restored, run_here, run_module, run_train
from data_pipelines import sources, tasks

BERT_RUN = "--gin_file=gin_configs/runs/bert_tiny_demo.gin"
XLNET_RUN = "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin"
BART_RUN = "--gin_file=gin_configs/runs/bart_tiny_demo.gin"
ERROR = "pretrain.train: error: "


def test_a_50_mb_line_is_skipped_and_counted_not_tokenized(tmp_path, demo_paths, demo_vocab, capfd):
  """Tokenizing a line holds hundreds of times its size: a file without line breaks would take gigabytes."""
  path = tmp_path / "a.txt"
  path.write_bytes(b"First one.\nFirst two.\n\n" + b"lorem ipsum " * (50 * 2**20 // 12) +
                   b"\nSecond one.\nSecond two.\n")
  source = sources.TextDocumentSource({"train": str(path)})
  documents = [d["text"].decode() for d in source.get_dataset("train", shuffle=False).as_numpy_iterator()]
  assert documents == ["First one.\nFirst two.", "Second one.\nSecond two."]
  assert f'warning: skipping 1 line(s) longer than 1048576 bytes in "{path}"' in capfd.readouterr().err
  name = tasks.text_task("bert_mlm_nsp", train_files=str(path), vocab_model=demo_paths["vocab_model"])
  dataset = tasks.get_task_or_mixture(name).get_dataset({"input_ids": 32, "masked_positions": 4}, split="train",
                                                        shuffle=False, num_epochs=1, seed=0)
  texts = [demo_vocab.tokenizer.decode_ids(restored(example).tolist()) for example in dataset.as_numpy_iterator()]
  assert texts and not any("lorem" in text for text in texts), texts


@pytest.fixture(scope="module")
def bad_vocabularies(tmp_path_factory, demo_paths):
  """Kind -> (a VOCAB_MODEL that is no vocabulary of ours, the start of the line naming it)."""
  where = tmp_path_factory.mktemp("vocabularies")
  (where / "spm").mkdir()
  (where / "spm.txt").write_text("[CLS]\n[SEP]\n[MASK]\n")
  model = io.BytesIO()  # sentencepiece's defaults: no [CLS], [SEP], [MASK], no pad, eos=2
  spm.SentencePieceTrainer.train(input=demo_paths["validation"], model_writer=model, vocab_size=200,
                                 input_sentence_size=2000, minloglevel=2)
  (where / "plain.model").write_bytes(model.getvalue())
  return {
      "directory": (f"{where}/spm", f"VOCAB_MODEL='{where}/spm' is a directory: expected the .model file"),
      "text": (f"{where}/spm.txt", f"VOCAB_MODEL='{where}/spm.txt' is not a sentencepiece model (Error parsing"),
      "no special pieces": (f"{where}/plain.model", f"VOCAB_MODEL='{where}/plain.model' was not trained with this "
                            "framework's special pieces (no [CLS] piece, no [SEP] piece, no [MASK] piece, pad id -1, "
                            "not 0, eos id 2, not 1): train one with `python -m data_pipelines.vocab`"),
  }


@pytest.mark.parametrize("kind", ["directory", "text", "no special pieces"])
def test_a_vocabulary_that_is_no_model_of_ours_is_named(kind, bad_vocabularies, tmp_path, demo_paths, capsys):
  vocab_model, message = bad_vocabularies[kind]
  code, last = run_train(capsys, tmp_path, BERT_RUN, f"--gin.TRAIN_FILES='{demo_paths['validation']}'",
                         f"--gin.VOCAB_MODEL='{vocab_model}'")
  assert code == 1 and last.startswith(ERROR + message), last


def test_train_files_naming_a_directory_is_named(tmp_path, capsys):
  (tmp_path / "text").mkdir()
  (tmp_path / "text" / "a.txt").write_text("One.\nTwo.\n")
  code, last = run_train(capsys, tmp_path / "run", BERT_RUN, f"--gin.TRAIN_FILES='{tmp_path}/text'")
  assert code == 1 and last == (f"{ERROR}TRAIN_FILES='{tmp_path}/text' matches the directory {tmp_path}/text: expected "
                                f"text files, e.g. TRAIN_FILES='{tmp_path}/text/*.txt'"), last


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_shuffle_buffer_that_is_no_positive_count_is_named(value, tmp_path, capsys, monkeypatch, demo_paths):
  monkeypatch.setenv(tasks.SHUFFLE_BUFFER_VARIABLE, value)
  code, last = run_train(capsys, tmp_path, BERT_RUN, f"--gin.TRAIN_FILES='{demo_paths['validation']}'")
  assert code == 1 and last == (f"{ERROR}POD_PRETRAIN_SHUFFLE_BUFFER='{value}': expected a whole number of "
                                "examples, 1 or more"), last


def test_an_xlnet_corpus_of_blank_lines_is_named(tmp_path, capsys, demo_paths):
  """XLNet tokenizes its text into token files before the first step: nothing to tokenize is one line."""
  (tmp_path / "blank.txt").write_text("\n \n\t\n\n")
  code, last = run_train(capsys, tmp_path / "run", XLNET_RUN, f"--gin.TRAIN_FILES='{tmp_path}/*.txt'",
                         f"--gin.VOCAB_MODEL='{demo_paths['vocab_model']}'")
  assert code == 1 and last == (f"{ERROR}the train text of text_xlnet_plm holds no sentences to tokenize (1 file(s), "
                                f"e.g. {tmp_path}/blank.txt)"), last


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.TASK_FEATURE_LENGTHS={'input_ids': 8, 'masked_positions': 20}"],
     "TASK_FEATURE_LENGTHS={'input_ids': 8, 'masked_positions': 20} do not fit the bert_mlm_nsp objective: "
     "masked_positions=20 is more than the 5 tokens of A and B in input_ids=8 ([CLS] A [SEP] B [SEP]): input_ids must "
     "be at least 23"),
    ([BERT_RUN, "--gin.TASK_FEATURE_LENGTHS={'input_ids': 4, 'masked_positions': 1}"],
     "input_ids=4 is less than 5, the shortest [CLS] A [SEP] B [SEP]"),
    (["--gin_file=gin_configs/runs/albert_tiny_demo.gin",
      "--gin.TASK_FEATURE_LENGTHS={'input_ids': 128, 'masked_positions': 0}"],
     "do not fit the albert_mlm_sop objective: masked_positions=0: must be at least 1"),
    ([XLNET_RUN, "--gin.SEQ_LEN=32"],
     "TASK_FEATURE_LENGTHS={'input_ids': 32, 'target_ids': 21, 'reuse_len': 64} do not fit the xlnet_plm objective: "
     "seq_len=32 is less than reuse_len + 5 = 69"),
    ([XLNET_RUN, "--gin.NUM_PREDICT=200"],
     "do not fit the xlnet_plm objective: num_predict=200: must be 0 to 123, the most targets that fit"),
    ([BART_RUN, "--gin.TASK_FEATURE_LENGTHS={'encoder_input_ids': 2, 'decoder_input_ids': 128}"],
     "do not fit the bart_denoising objective: denoising: encoder_length=2 / decoder_length=128 leave no room"),
], ids=["bert masked_positions", "bert input_ids", "albert masked_positions", "xlnet seq_len", "xlnet num_predict",
        "bart encoder"])
def test_lengths_too_short_for_the_objective_are_named_with_the_minimum(args, message, tmp_path, capsys):
  code, last = run_train(capsys, tmp_path, *args)
  assert code == 1 and last.startswith(ERROR) and message in last, last


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.MICROBATCHES=3"], "BATCH_SIZE=32 is not divisible by MICROBATCHES=3"),
    ([BERT_RUN, "--gin.DATA_SHARDS=3"], "BATCH_SIZE=32 is not divisible by the 3 data shards"),
], ids=["MICROBATCHES", "DATA_SHARDS"])
def test_a_batch_size_that_does_not_split_evenly_is_named(args, message, tmp_path, capsys):
  code, last = run_train(capsys, tmp_path, *args)
  assert code == 1 and last.startswith(ERROR + message), last


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.bert.BertConfig.num_heads=3"], "hidden_size=128 is not divisible by num_heads=3"),
    (["--gin_file=gin_configs/runs/albert_tiny_demo.gin", "--gin.albert.AlbertConfig.num_heads=3"],
     "hidden_size=128 is not divisible by num_heads=3"),
    ([BART_RUN, "--gin.bart.BartConfig.num_heads=3"], "d_model=128 is not divisible by num_heads=3"),
    ([BERT_RUN, "--gin.bert.BertConfig.num_heads=0"], "num_heads=0: must be at least 1"),
    ([XLNET_RUN, "--gin.xlnet.XLNetConfig.n_head=0"], "n_head=0: must be at least 1"),
], ids=["bert", "albert", "bart", "no heads", "xlnet no heads"])
def test_head_counts_the_model_cannot_use_are_named(args, message, tmp_path, capsys):
  """Each head would get 128 // 3 = 42 features, so attention would use 126 of the 128, silently. No heads at
  all stopped the run with a traceback of a division by zero."""
  code, last = run_train(capsys, tmp_path, *args, "--gin.TRAIN_STEPS=1")  # a step at most, were it not refused
  assert code == 1 and last == ERROR + message, last
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # a process of its own, for two devices
def test_a_batch_size_the_data_parallel_groups_do_not_divide_is_named(tmp_path):
  result = run_module("pretrain.train", BERT_RUN, f"--gin.MODEL_DIR='{tmp_path}'", "--gin.MESH_SHAPE={'data': 2}",
                      "--gin.BATCH_SIZE=31", env=host_devices(2))
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
      f"{ERROR}BATCH_SIZE=31 is not divisible by MICROBATCHES=1 × the mesh's 2 data-parallel groups"), result.stderr


# ----------------------------------------------------------------------------- input that makes no example
# Each of these spun tf.data forever (or ended in OutOfRangeError's traceback) before the input was checked.


def no_example(objective, task, reason):
  return (f"{ERROR}{objective} makes no example from the {task}: {reason}; {objective} needs "
          f"{tasks.OBJECTIVES[objective].requirement.needs}")


@pytest.mark.parametrize("run, objective, text, reason", [
    (BERT_RUN, "bert_mlm_nsp", "One short line",  # no newline at its end
     "its 1 document(s), 1 different, hold at most 1 sentence(s) and 4 token(s)"),
    (BART_RUN, "bart_denoising", " \n\t\n\n   \n",  # whitespace only ended in OutOfRangeError's traceback
     "it holds no sentence (blank lines only, or nothing the vocabulary makes pieces of)")])
def test_a_train_text_the_objective_makes_no_example_of_stops_with_one_line(tmp_path, capsys, demo_paths, run,
                                                                             objective, text, reason):
  (tmp_path / "train.txt").write_text(text)
  code, last = run_train(capsys, tmp_path / "run", run, f"--gin.TRAIN_FILES='{tmp_path}/train.txt'",
                         f"--gin.VOCAB_MODEL='{demo_paths['vocab_model']}'")
  assert code == 1 and last == no_example(
      objective, f"train text of text_{objective} ('{tmp_path}/train.txt', 1 file(s))", reason), last


def test_a_held_out_split_is_checked_at_the_start_not_at_the_first_eval(tmp_path, capsys, demo_paths):
  (tmp_path / "held_out.txt").write_text("A\n\nB\n")  # one token each: fairseq's BART drops such blocks
  code, last = run_train(capsys, tmp_path / "run", BART_RUN, f"--gin.TRAIN_FILES='{demo_paths['validation']}'",
                         f"--gin.VALIDATION_FILES='{tmp_path}/held_out.txt'",
                         f"--gin.VOCAB_MODEL='{demo_paths['vocab_model']}'")
  assert code == 1 and last.startswith(
      f"{ERROR}bart_denoising makes no example from the validation text of text_bart_denoising "
      f"('{tmp_path}/held_out.txt', 1 file(s)): its 2 document(s), 2 different, hold at most 1 sentence(s) and 1 "
      "token(s)"), last


def test_a_mixture_names_its_task_that_makes_no_example(tmp_path, demo_paths):
  (tmp_path / "one.txt").write_text("Just one sentence.\n")
  good = tasks.text_task("albert_mlm_sop", train_files=demo_paths["validation"], vocab_model=demo_paths["vocab_model"],
                         corpus="good")
  bad = tasks.text_task("albert_mlm_sop", train_files=str(tmp_path / "one.txt"),
                        vocab_model=demo_paths["vocab_model"], corpus="bad")
  mixture = tasks.mixture("good_and_bad", [good, bad])
  with pytest.raises(ValueError, match=re.escape(f"albert_mlm_sop makes no example from the train text of {bad} (")):
    tasks.check_examples(tasks.get_task_or_mixture(mixture), "train")


def test_each_process_checks_its_data_shards_and_a_time_bound_stops_a_long_pass(tmp_path, demo_paths):
  """Two documents, four data shards of one file: shards 2 and 3 get no document. And a pass that takes
  longer than the bound stops at the bound, saying what it read."""
  (tmp_path / "two.txt").write_text("First document opens.\nIt closes.\n\nSecond document opens.\nIt closes.\n")
  name = tasks.text_task("bert_mlm_nsp", train_files=str(tmp_path / "two.txt"), vocab_model=demo_paths["vocab_model"])
  task = tasks.get_task_or_mixture(name)
  for shard in range(2):
    tasks.check_examples(task, "train", seqio.ShardInfo(shard, 4))
  with pytest.raises(ValueError, match=re.escape("data shard 3 of 4 (its share of the documents): it holds no")):
    tasks.check_examples(task, "train", seqio.ShardInfo(3, 4))
  (tmp_path / "same.txt").write_text("The same line.\n\n" * 50)
  same = tasks.text_task("bert_mlm_nsp", train_files=str(tmp_path / "same.txt"),
                         vocab_model=demo_paths["vocab_model"], corpus="same")
  with pytest.raises(ValueError, match=re.escape(f"from the train text of {same} ('{tmp_path}/same.txt', 1 file(s)) "
                                                 "in its first 0 s of text: its 1 document(s), 1 different")):
    tasks.check_examples(tasks.get_task_or_mixture(same), "train", seconds=0)


def test_preview_stops_with_one_line(tmp_path, demo_paths):
  from data_pipelines import preview
  (tmp_path / "blank.txt").write_text("\n \n")
  name = tasks.text_task("t5_span_corruption", train_files=str(tmp_path / "blank.txt"),
                         vocab_model=demo_paths["vocab_model"])
  with pytest.raises(ValueError, match=re.escape(f"t5_span_corruption makes no example from the train text of {name} "
                                                 f"('{tmp_path}/blank.txt', 1 file(s)): it holds no sentence")):
    preview.print_examples(name, "train", 1, "jsonl", 0)


@pytest.mark.parametrize("program, flag", [("data_pipelines.vocab", "--output"),
                                           ("data_pipelines.tokenize", "--output"),
                                           ("data_pipelines.split_text", "--output_dir")])
def test_a_data_program_names_the_output_it_cannot_write(program, flag, tmp_path, demo_paths):
  """The output's place is a file, then a directory that refuses writes (immutable: root's too)."""
  inputs = {"data_pipelines.vocab": [f"--input={demo_paths['train']}", "--vocab_size=300"],
            "data_pipelines.tokenize": ["--task=demo_xlnet_plm"],
            "data_pipelines.split_text": [f"--input={demo_paths['train']}", "--num_files=2"]}[program]
  name = program.split(".")[1]
  (tmp_path / "a_file").write_text("not a directory\n")
  done = run_here(program, *inputs, f"{flag}={tmp_path}/a_file/out")
  assert done.returncode == 1 and "Traceback" not in done.stderr
  [line] = done.stderr.strip().splitlines()
  assert line.startswith(f"{name}: error: ") and f"{tmp_path}/a_file" in line
  locked = tmp_path / "locked"
  locked.mkdir()
  subprocess.run(["chattr", "+i", str(locked)], check=True, capture_output=True)
  try:
    done = run_here(program, *inputs, f"{flag}={locked}/out")
  finally:
    subprocess.run(["chattr", "-i", str(locked)], check=True, capture_output=True)
  assert done.returncode == 1 and "Traceback" not in done.stderr
  [line] = done.stderr.strip().splitlines()
  assert line.startswith(f"{name}: error: ") and f"{locked}/out" in line
  assert list(locked.iterdir()) == []
