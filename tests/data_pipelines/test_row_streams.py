"""Token files and XLNet's row streams: the corpus tokenized once, every row reading its own stream of
it, batches made from the step number alone (so the data position does not depend on the number of
processes), bi_data rows reading their partner's text backwards.

Real sentencepiece (the demo vocabulary), real text files, real token files on disk."""
import os

import numpy as np
import pytest

from data_pipelines import tasks, token_files
from data_pipelines.input_pipeline import InputPipeline
from helpers import run_here

SEQ, REUSE, PREDICT = 64, 16, 6
LENGTHS = {"input_ids": SEQ, "target_ids": PREDICT, "reuse_len": REUSE}
FEATURES = {"input_ids": ((SEQ,), "int32"), "segment_ids": ((SEQ,), "int32"), "perm_mask": ((SEQ, SEQ), "float32"),
            "target_mapping": ((PREDICT, SEQ), "float32"), "target_ids": ((PREDICT,), "int32"),
            "target_weights": ((PREDICT,), "float32"), "input_q": ((SEQ,), "float32")}


@pytest.fixture(scope="module")
def corpus_task(tmp_path_factory, demo_paths):
  """An XLNet task over three small text files (the demo text cut in three), and its token directory."""
  root = tmp_path_factory.mktemp("row_streams")
  documents = open(demo_paths["train"], encoding="utf-8").read().split("\n\n")[:600]
  for index in range(3):
    (root / f"part{index}.txt").write_text("\n\n".join(documents[index::3]) + "\n", encoding="utf-8")
  name = tasks.text_task("xlnet_plm", str(root / "part*.txt"), vocab_model=demo_paths["vocab_model"],
                         corpus="row_streams", token_dir=str(root / "tokens"))
  task = tasks.get_task_or_mixture(name)
  token_files.write(task, "train", str(root / "tokens" / "train"), progress=False)
  return task


def pipeline(task_name, batch_size, process_index=0, process_count=1, bi_data=True, seed=0):
  return InputPipeline(task_name, LENGTHS, batch_size, FEATURES, bi_data=bi_data, seed=seed,
                       process_index=process_index, process_count=process_count)


def test_token_files_hold_the_tokenized_sentences_and_an_interrupted_write_continues(corpus_task, tmp_path):
  directory = tmp_path / "tokens"
  token_files.write(corpus_task, "train", str(directory), progress=False)
  expected_ids, expected_starts = [], []
  for shard in range(3):  # the task's own tokenization, file by file
    import seqio
    docs = corpus_task.source.get_dataset("train", shuffle=False, shard_info=seqio.ShardInfo(shard, 3))
    for doc in corpus_task.preprocess_precache(docs).as_numpy_iterator():
      for sentence in doc["sentences"]:
        expected_ids += list(sentence)
        expected_starts += [True] + [False] * (len(sentence) - 1)
  tokens = token_files.TokenFile(str(directory))
  ids, starts = tokens.read_text(0, tokens.size)
  assert tokens.size == len(expected_ids)
  np.testing.assert_array_equal(ids, expected_ids)
  np.testing.assert_array_equal(starts, expected_starts)

  # Interrupted: info.json and the last part never written. Writing again adds them, keeping the rest.
  parts = sorted(p for p in os.listdir(directory) if p.startswith("tokens-"))
  kept = {p: (directory / p).stat().st_mtime_ns for p in parts[:-1]}
  (directory / parts[-1]).unlink()
  (directory / token_files.INFO_FILE).unlink()
  with pytest.raises(FileNotFoundError, match="not a finished token directory"):
    token_files.TokenFile(str(directory))
  token_files.write(corpus_task, "train", str(directory), progress=False)
  assert {p: (directory / p).stat().st_mtime_ns for p in parts[:-1]} == kept
  np.testing.assert_array_equal(token_files.TokenFile(str(directory)).read_text(0, tokens.size)[0], expected_ids)


def test_reads_wrap_around_and_backward_reads_are_the_text_right_to_left(corpus_task):
  tokens = tasks.token_file(corpus_task, "train")
  ids, starts = tokens.read_text(0, tokens.size)
  around = tokens.read_text(tokens.size - 5, 12)[0]
  np.testing.assert_array_equal(around, np.concatenate([ids[-5:], ids[:7]]))
  backward_ids, backward_starts = tokens.read_text(0, tokens.size, backward=True)
  np.testing.assert_array_equal(backward_ids, ids[::-1])
  # A sentence read right to left starts at its last token: where the next sentence (or the text) starts.
  ends = np.roll(starts, -1)
  np.testing.assert_array_equal(backward_starts, ends[::-1])


def test_every_row_continues_its_own_stream_and_bi_data_rows_read_their_partners_text_backwards(corpus_task):
  """Reassembles each row's reuse parts over 12 steps: forward rows read from the start of their quarter
  of the corpus (four streams for 8 rows), backward rows the same quarter right to left from its end; each window's A
  continues its reuse part, and the next window's reuse part is the text right after this one's."""
  tokens = tasks.token_file(corpus_task, "train")
  ids = tokens.read_text(0, tokens.size)[0]
  batches = pipeline(corpus_task.name, 8).iterator()
  steps = 12
  rows = [[] for _ in range(8)]
  for _ in range(steps):
    batch = next(batches)
    for row in range(8):
      input_ids, segment_ids = batch["input_ids"][row], batch["segment_ids"][row]
      len_a = int(np.sum(segment_ids == 0)) - REUSE - 1
      rows[row].append((input_ids[:REUSE], input_ids[REUSE:REUSE + len_a]))
  for stream in range(4):
    start = stream * tokens.size // 4
    end = (stream + 1) * tokens.size // 4
    forward = np.concatenate([reuse for reuse, _ in rows[2 * stream]])
    np.testing.assert_array_equal(forward, ids[start:start + steps * REUSE])
    backward = np.concatenate([reuse for reuse, _ in rows[2 * stream + 1]])
    np.testing.assert_array_equal(backward, ids[end - steps * REUSE:end][::-1])
    for row in (2 * stream, 2 * stream + 1):
      text = forward if row % 2 == 0 else backward
      for step, (_, a) in enumerate(rows[row][:-1]):
        after_reuse = text[(step + 1) * REUSE:(step + 1) * REUSE + len(a)]
        np.testing.assert_array_equal(a[:len(after_reuse)], after_reuse)


def test_batches_and_the_saved_position_do_not_depend_on_the_number_of_processes(corpus_task, tmp_path):
  """Two processes' halves of each batch are one process's batch; a position saved by two processes
  continues on one with the batch an uninterrupted run reads next."""
  one = pipeline(corpus_task.name, 8).iterator()
  halves = [pipeline(corpus_task.name, 8, index, 2).iterator() for index in range(2)]
  for _ in range(3):
    whole, parts = next(one), [next(h) for h in halves]
    for key in whole:
      np.testing.assert_array_equal(whole[key], np.concatenate([p[key] for p in parts]))
  for half in halves:
    half.save(tmp_path)  # process 0 writes the position, process 1 nothing
  resumed = pipeline(corpus_task.name, 8).iterator()
  assert resumed.restore(tmp_path) is None
  continued, uninterrupted = next(resumed), next(one)
  for key in uninterrupted:
    np.testing.assert_array_equal(continued[key], uninterrupted[key])


def test_tokenize_command_writes_every_split_and_names_bad_flags(demo_paths, tmp_path):
  output = tmp_path / "tokens"
  result = run_here("data_pipelines.tokenize", f"--train_files={demo_paths['validation']}",
                    f"--validation_files={demo_paths['validation']}", f"--vocab_model={demo_paths['vocab_model']}",
                    f"--output={output}")
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"train with TOKEN_DIR='{output}'" in result.stdout
  train, validation = (token_files.TokenFile(str(output / split)) for split in ("train", "validation"))
  assert train.size == validation.size > 1000 and train.info["vocab_size"] == 2000
  missing = run_here("data_pipelines.tokenize", "--train_files=/nonexistent/*.txt", f"--output={output}")
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines()[-1] == (
      "tokenize: error: TRAIN_FILES='/nonexistent/*.txt' matches no files")
