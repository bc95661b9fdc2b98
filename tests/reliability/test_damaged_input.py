"""Input damaged on disk under a run: the token ids it reads are checked against the vocabulary, and a batch
that cannot be made stops the run with one line naming the file and the token, after saving the step it
reached; once the file is mended the same command goes on exactly as a run that never met the damage.

Real token files written by data_pipelines.tokenize, a real bit flipped on disk, real orbax checkpoints."""
import json
from pathlib import Path
import re
import threading
import time

import gin
import pytest

from data_pipelines import tasks, token_files
from data_pipelines.row_streams import RowStreams
from helpers import SMALL_BERT, flip_a_bit, logged_losses, run_here, run_train, train
from pretrain import cli, trainer
from pretrain.errors import TrainingStopped, one_line
from pretrain import train as train_program

BINDINGS = [
    "xlnet.XLNetConfig.d_model = 32", "xlnet.XLNetConfig.d_head = 16", "xlnet.XLNetConfig.d_inner = 64",
    "xlnet.XLNetConfig.scan_layers = True", "SEQ_LEN = 32", "MEM_LEN = 16", "REUSE_LEN = 16", "NUM_PREDICT = 6",
    "BATCH_SIZE = 4", "WARMUP_STEPS = 2", "LOG_EVERY_STEPS = 1", "CHECKPOINT_EVERY_STEPS = 2",
    "EVAL_EVERY_STEPS = 0", "VALIDATION_FILES = None", "optimizers.warmup_linear_decay.total_steps = 6"]
DAMAGED_STEP = 5  # the first step whose batch reads the damaged token
TEXT_STEPS = 200  # more than the text run takes to open a file after its files are removed


def first_read_at(data_step, corpus_bindings) -> int:
  """A token that row 0 first reads in the batch of `data_step` (0-based), as the run's row streams read."""
  gin.clear_config()
  cli.parse_gin(["gin_configs/runs/xlnet_tiny_demo.gin"], [*BINDINGS, *corpus_bindings])
  arguments = cli.bound_arguments(trainer.train)
  task = tasks.get_task_or_mixture(arguments["mixture_or_task_name"])
  reading = tasks.stream_reading(task, arguments["task_feature_lengths"])
  streams = RowStreams(tasks.token_file(task, "train"), num_rows=arguments["batch_size"], bi_data=True,
                       step_len=reading.step_len, window_len=reading.window_len, seed=arguments["seed"])
  start, backward = streams.position(0, data_step)
  previous, _ = streams.position(0, data_step - 1)
  assert not backward and start > previous  # row 0 reads forwards: its last token of this window is new
  return start + reading.window_len - 1


def test_a_token_damaged_mid_run_saves_the_step_reached_and_the_mended_file_resumes_exactly(tmp_path, capsys,
                                                                                            demo_paths):
  tokenized = run_here("data_pipelines.tokenize", f"--train_files={demo_paths['train']}",
                       f"--vocab_model={demo_paths['vocab_model']}", f"--output={tmp_path}/tokens")
  assert tokenized.returncode == 0, tokenized.stderr
  corpus = [f"TRAIN_FILES = '{demo_paths['train']}'", f"VOCAB_MODEL = '{demo_paths['vocab_model']}'",
            f"TOKEN_DIR = '{tmp_path}/tokens'", f"COMPILATION_CACHE_DIR = '{tmp_path}/cache'"]
  part = tmp_path / "tokens" / "train" / token_files.part_name(0, 1)
  intact = part.read_bytes()
  position = first_read_at(DAMAGED_STEP - 1, corpus)
  damaged = bytearray(intact)
  damaged[4 * position + 3] ^= 0x10  # the id's high byte (little-endian): 2**28 more, far past the vocabulary
  part.write_bytes(bytes(damaged))

  gin.clear_config()
  argv = ["pretrain.train", "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin",
          *[f"--gin_bindings={b}" for b in BINDINGS + corpus], f"--gin.MODEL_DIR='{tmp_path}/run'",
          "--gin.TRAIN_STEPS=6"]
  with pytest.raises(SystemExit) as exited:
    cli.run("pretrain.train", lambda: train_program.main(argv))
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert exited.value.code == 1
  stored = int.from_bytes(damaged[4 * position:4 * position + 4], "little", signed=True)
  assert last.startswith(f"pretrain.train: error: the train input failed to make the batch of step {DAMAGED_STEP} "
                         f"(InvalidArgumentError: {part} is damaged: its token {position} reads as id {stored}, "
                         "outside the vocabulary of "), last
  assert last.endswith(f"saved step {DAMAGED_STEP - 1} in {tmp_path}/run/checkpoints. Mend the input, then resume")
  checkpoint_dir = tmp_path / "run" / "checkpoints"
  assert sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit()) == [2, DAMAGED_STEP - 1]
  assert json.loads((checkpoint_dir / str(DAMAGED_STEP - 1) / "data_iterator" / "batches_taken.json").read_text()) == {
      "batches_taken": DAMAGED_STEP - 1}

  part.write_bytes(intact)
  train("xlnet_tiny_demo", tmp_path / "run", 6, BINDINGS + corpus)
  train("xlnet_tiny_demo", tmp_path / "never_damaged", 6, BINDINGS + corpus)
  resumed, whole = logged_losses(tmp_path / "run"), logged_losses(tmp_path / "never_damaged")
  assert sorted(resumed) == list(range(1, 7))
  assert resumed == whole


def test_text_files_lost_mid_run_stop_it_and_the_checkpoints_that_hold_the_failed_read_are_set_aside(
    tmp_path, capsys, demo_paths):
  """A text input's tf.data iterator moves past a file that fails to read (and the batch it was making), so the
  step reached is not saved; and the positions its iterators saved a few batches before the failure surfaced may
  hold it (tf.data keeps its read-ahead, errors included). Once the files are back, the resume that meets the
  failure again sets those checkpoints aside, and the next goes on exactly as a run that never lost them. The files
  are really removed mid-run."""
  documents = Path(demo_paths["train"]).read_text().split("\n\n")[:480]
  corpus, kept = tmp_path / "text", tmp_path / "kept"
  corpus.mkdir()
  kept.mkdir()
  for index in range(16):  # many small files, so that the input opens one every few steps
    (corpus / f"part-{index:02d}.txt").write_text("\n\n".join(documents[index::16]) + "\n")
  # Every checkpoint kept: step 3's, saved before the files went, must be there however late the failure surfaces.
  bindings = [*SMALL_BERT, "LOG_EVERY_STEPS = 1", "CHECKPOINT_EVERY_STEPS = 3", "KEEP_CHECKPOINTS = None",
              f"TRAIN_FILES = '{corpus}/*.txt'",
              f"VOCAB_MODEL = '{demo_paths['vocab_model']}'", "VALIDATION_FILES = None",
              f"COMPILATION_CACHE_DIR = '{tmp_path}/cache'",
              f"optimizers.warmup_linear_decay.total_steps = {TEXT_STEPS}"]
  run = tmp_path / "run"
  checkpoint_dir = run / "checkpoints"

  def saved_steps():
    return sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit())

  def remove_the_files_once_step_3_is_saved():  # its metrics are written after its save, once step 4 is under way
    while not (run / "metrics.jsonl").exists() or max(logged_losses(run), default=0) < 3:
      if stopped.is_set():
        return
      time.sleep(0.05)
    for part in corpus.iterdir():
      part.rename(kept / part.name)

  stopped = threading.Event()
  remover = threading.Thread(target=remove_the_files_once_step_3_is_saved)
  remover.start()
  try:
    code, last = run_train(capsys, run, "--gin_file=gin_configs/runs/bert_tiny_demo.gin",
                           *[f"--gin_bindings={b}" for b in bindings], f"--gin.TRAIN_STEPS={TEXT_STEPS}")
  finally:
    stopped.set()
    remover.join()
  assert code == 1 and not list(corpus.iterdir()), last
  failed = int(re.search(r"failed to make the batch of step (\d+) \(NotFoundError: .*part-\d\d\.txt", last).group(1))
  newest = (failed - 1) // 3 * 3  # the step reached is never saved, unless a checkpoint was due there
  assert 3 < failed < TEXT_STEPS - 2, last
  assert saved_steps()[-1] == newest, last
  assert last.endswith(f"the newest checkpoint is step {newest} in {checkpoint_dir} (tf.data saves the batches a text "
                       "input has read ahead with its position, a failed read among them: a resume that meets it "
                       "again once the input is mended sets aside the checkpoints that hold it). Mend the input, "
                       "then resume"), last

  for part in kept.iterdir():
    part.rename(corpus / part.name)
  end = failed + 1
  before = saved_steps()
  with pytest.raises(TrainingStopped) as replayed:  # from checkpoint `newest`, which holds the failed read
    train("bert_tiny_demo", run, end, bindings)
  said = re.search(rf"failed to make the batch of step {failed} \(NotFoundError: .*; (\S+part-\d\d\.txt) reads now, "
                   rf"but checkpoint\(s\) ([\d, ]+) in {checkpoint_dir} hold the failed read \(tf.data saved it with "
                   rf"their data position\): set aside in {run}/replayed. The same command resumes from step (\d+)$",
                   str(replayed.value))
  assert said and Path(said.group(1)).parent == corpus, str(replayed.value)
  holding, resume_at = [int(s) for s in said.group(2).split(", ")], int(said.group(3))
  assert holding[0] == newest and resume_at >= 3 and holding == sorted(s for s in before if s > resume_at)[::-1]
  assert saved_steps() == [s for s in before if s <= resume_at]
  assert sorted(int(p.name) for p in (run / "replayed").iterdir()) == sorted(holding)
  print(f"failed at step {failed}; checkpoint(s) {holding} set aside; resumed from step {resume_at}")

  train("bert_tiny_demo", run, end, bindings)
  train("bert_tiny_demo", tmp_path / "never_lost", end, bindings)
  resumed, whole = logged_losses(run), logged_losses(tmp_path / "never_lost")
  assert [resumed[s] for s in range(resume_at + 1, end + 1)] == [whole[s] for s in range(resume_at + 1, end + 1)]


def test_a_corrupted_record_read_by_tf_data_is_told_in_one_line(tmp_path):
  """TensorFlow's own message for a record whose checksum fails, a real bit flipped on disk, without its wrapping."""
  import tensorflow as tf
  path = str(tmp_path / "records.tfrecord")
  with tf.io.TFRecordWriter(path) as writer:
    for index in range(100):
      writer.write(f"record {index} ".encode() * 20)
  flip_a_bit(tmp_path / "records.tfrecord")
  with pytest.raises(tf.errors.DataLossError) as failed:
    for _ in tf.data.TFRecordDataset([path]).batch(4).prefetch(2):
      pass
  assert re.fullmatch(r"corrupted record at \d+", one_line(failed.value)), str(failed.value)
