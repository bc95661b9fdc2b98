"""A demo corpus built offline from the docstrings of the Python standard library.

Docstrings are read with `ast` (no module is imported, so nothing runs), each becomes a document,
split into one sentence per line with a blank line between documents: the BERT reference format.
Every 20th document goes to the validation file. A sentencepiece vocabulary is trained on the
training file. All of it is cached under $POD_PRETRAIN_CACHE (default ~/.cache/pod_pretrain).
"""
import ast
import os
import re
import sysconfig
from pathlib import Path

from data_pipelines import vocab

DEMO_VOCAB_SIZE = 2000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")
_MIN_WORDS = 3


def cache_root() -> Path:
  """Where built data is kept: the demo corpus, and token files tokenized on first use."""
  return Path(os.environ.get("POD_PRETRAIN_CACHE", Path.home() / ".cache" / "pod_pretrain"))


def cache_dir() -> Path:
  return cache_root() / "demo"


def _docstrings(source_file: Path):
  try:
    tree = ast.parse(source_file.read_text(encoding="utf-8"))
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node)
      if doc:
        yield doc


def _sentences(docstring: str):
  """Prose paragraphs only: code examples (>>>), tables and indented blocks carry little language."""
  for paragraph in re.split(r"\n\s*\n", docstring):
    lines = paragraph.splitlines()
    if any(line.startswith((" ", "\t", ">>>", "...")) or "|" in line for line in lines):
      continue
    text = " ".join(line.strip() for line in lines)
    for sentence in _SENTENCE_END.split(text):
      if len(sentence.split()) >= _MIN_WORDS:
        yield sentence


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources():
  """The standard library's source files the corpus reads, in a fixed order (tests and site-packages left out)."""
  for source_file in sorted(stdlib_root().rglob("*.py")):
    if "site-packages" in source_file.parts or "test" in source_file.parts or "tests" in source_file.parts:
      continue
    yield source_file


def documents():
  for source_file in stdlib_sources():
    for doc in _docstrings(source_file):
      sentences = list(_sentences(doc))
      if sentences:
        yield sentences


def ensure_demo_corpus() -> dict:
  """Builds (once) and returns {'train': path, 'validation': path, 'vocab_model': path}."""
  root = cache_dir()
  paths = {"train": root / "train.txt", "validation": root / "validation.txt", "vocab_model": root / "spm.model"}
  if not all(p.exists() for p in paths.values()):
    root.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "validation": []}
    for i, sentences in enumerate(documents()):
      splits["validation" if i % 20 == 0 else "train"].append("\n".join(sentences))
    for split, docs in splits.items():
      tmp = paths[split].with_suffix(".tmp")
      tmp.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
      tmp.replace(paths[split])  # atomic: concurrent builders never see half a file
    tmp_prefix = str(root / "spm.tmp")
    vocab.train_sentencepiece([paths["train"]], DEMO_VOCAB_SIZE, tmp_prefix)
    os.replace(tmp_prefix + ".model", paths["vocab_model"])
  return {k: str(v) for k, v in paths.items()}
