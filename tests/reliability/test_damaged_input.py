"""Input damaged on disk under a run: the token ids it reads are checked against the vocabulary, and a batch
that cannot be made stops the run with one line naming the file and the token, after saving the step it
reached; once the file is mended the same command goes on exactly as a run that never met the damage.

Real token files written by data_pipelines.tokenize, a real bit flipped on disk, real orbax checkpoints."""
import json

import gin
import pytest

from data_pipelines import tasks, token_files
from data_pipelines.row_streams import RowStreams
from helpers import logged_losses, run_here, train
from pretrain import cli, trainer
from pretrain import train as train_program

BINDINGS = [
    "xlnet.XLNetConfig.d_model = 32", "xlnet.XLNetConfig.d_head = 16", "xlnet.XLNetConfig.d_inner = 64",
    "xlnet.XLNetConfig.scan_layers = True", "SEQ_LEN = 32", "MEM_LEN = 16", "REUSE_LEN = 16", "NUM_PREDICT = 6",
    "BATCH_SIZE = 4", "WARMUP_STEPS = 2", "LOG_EVERY_STEPS = 1", "CHECKPOINT_EVERY_STEPS = 2",
    "EVAL_EVERY_STEPS = 0", "VALIDATION_FILES = None", "optimizers.warmup_linear_decay.total_steps = 6"]
DAMAGED_STEP = 5  # the first step whose batch reads the damaged token


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
