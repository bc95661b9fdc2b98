"""A data program stopped by a signal ends at once with one line saying what is left of its output, and
leaves nothing half-written: a real SIGTERM to a real `vocab` process in sentencepiece's native training,
and a real Ctrl-C (SIGINT) to this process while `split_text` writes its parts."""
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

from data_pipelines import split_text
from helpers import start_module


def random_words_text(path, lines: int, seed: int = 0) -> None:
  """Lines of random words: many distinct pieces, so that training a vocabulary on it takes a while."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  words = ["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 9, size=20_000)]
  with open(path, "w") as f:
    for row in rng.integers(0, len(words), size=(lines, 10)):
      f.write(" ".join(words[i] for i in row) + "\n")


def test_sigterm_stops_vocab_training_at_once_and_writes_no_vocabulary(tmp_path):
  # 800,000 lines: sentencepiece reads and trains on them for about 15 s on 2 idle cores, so that 3 s after the
  # line below it has 10 s to go (measured so, with the training in the main thread: the stop took 9.9 s).
  random_words_text(tmp_path / "text.txt", 800_000)
  process = start_module("data_pipelines.vocab", f"--input={tmp_path}/text.txt", "--vocab_size=8000",
                         f"--output={tmp_path}/out/spm")
  assert process.stdout.readline().startswith("training a 8000-piece unigram vocabulary on 1 file(s)")
  time.sleep(3)  # into sentencepiece's native code, which reads the text for seconds before it trains
  process.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  stdout, stderr = process.communicate(timeout=120)
  took = time.monotonic() - sent
  # A handler runs between Python bytecodes: were the main thread in the native training, the stop would wait
  # for the training's end.
  assert took < 3, f"stopped {took:.1f} s after SIGTERM"
  assert process.returncode == 128 + signal.SIGTERM
  assert stderr.strip().splitlines() == ["vocab: stopped by SIGTERM: no vocabulary was written"], stderr
  assert list((tmp_path / "out").iterdir()) == []


def test_ctrl_c_during_split_text_removes_the_parts_written(tmp_path, demo_paths):
  text = open(demo_paths["train"], "rb").read()
  (tmp_path / "corpus.txt").write_bytes(text * max(1, (40 << 20) // len(text)))  # 40 MB: seconds to split
  output = tmp_path / "parts"

  def ctrl_c_once_two_parts_exist():
    while not (output.exists() and len(os.listdir(output)) >= 2):
      time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)

  threading.Thread(target=ctrl_c_once_two_parts_exist, daemon=True).start()
  # Ctrl-C as a process running split_text has it: Python's own handler, whatever an earlier test in this worker
  # left. Python raises KeyboardInterrupt in whatever the main thread runs, and one raised in a garbage
  # collector's callback (JAX registers one) is printed and dropped: no collections meanwhile.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  gc.disable()
  try:
    with pytest.raises(KeyboardInterrupt):
      split_text.split_text(str(tmp_path / "corpus.txt"), str(output), 50)
  finally:
    gc.enable()
    signal.signal(signal.SIGINT, previous)
  assert os.listdir(output) == []
  assert split_text.split_text(str(tmp_path / "corpus.txt"), str(output), 3) == 3  # a rerun finds it empty
