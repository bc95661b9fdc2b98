"""Shared test setup: JAX on the CPU, and one demo corpus + sentencepiece model for every session.

The cache lives in the system temp dir (not a per-session dir) so the ~15 s build happens once per
machine; the builder writes atomically, so concurrent sessions are safe. Set at import time so
subprocesses started by tests inherit it.
"""
import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("POD_PRETRAIN_CACHE", os.path.join(tempfile.gettempdir(), "pod_pretrain_test_cache"))


@pytest.fixture(scope="session")
def demo_paths() -> dict:
  """{'train', 'validation', 'vocab_model'}: paths of the demo corpus and its vocabulary."""
  from data_pipelines import demo_corpus  # imported lazily: tests that need no data stay free of TF
  return demo_corpus.ensure_demo_corpus()


@pytest.fixture(scope="session")
def demo_vocab(demo_paths):
  """The demo seqio.SentencePieceVocabulary."""
  from data_pipelines import vocab
  return vocab.load_vocabulary(demo_paths["vocab_model"])
