"""Splits a text corpus into N files of whole documents, so that N data shards each read only their own.

  python -m data_pipelines.split_text --input='/data/text/*.txt' --output_dir=/data/split --num_files=8192

Text sources shard by file: with fewer files than data shards (XLNet has one per batch row, 8192
at batch 8192) every shard reads the whole corpus and keeps its share. This writes
OUTPUT_DIR/part-<i>-of-<N>.txt (local or gs://): consecutive documents in input order, about
1/N of the bytes each, cut only between documents (a blank line ends a document, as everywhere). A split
that stops part way (an error, Ctrl-C) removes the parts it wrote: the directory is then ready for a rerun.
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import contextlib

from absl import flags
from etils import epath
from tqdm import tqdm

from data_pipelines import storage

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "Glob of text files (one sentence per line, blank line between documents).")
flags.DEFINE_string("output_dir", None, "Directory to write the parts to (created if missing).")
flags.DEFINE_integer("num_files", None, "How many files to write.")


def part_path(output_dir: str, index: int, num_files: int) -> str:
  return f"{output_dir}/part-{index:05d}-of-{num_files:05d}.txt"


def documents(paths):
  """(lines, bytes read so far) per document: its lines as bytes (copied as they are, valid UTF-8 or
  not), each ending in a newline, file after file."""
  read = 0
  for path in paths:
    lines = []
    with storage.open_file(path, "rb") as f:
      for line in f:
        read += len(line)
        if line.strip():
          lines.append(line if line.endswith(b"\n") else line + b"\n")
        elif lines:
          yield lines, read
          lines = []
    if lines:
      yield lines, read


def split_text(pattern: str, output_dir: str, num_files: int) -> int:
  """Writes the parts; returns how many it wrote (fewer than num_files only if documents run out, and then
  their names count the parts written)."""
  if num_files < 1:
    raise ValueError(f"--num_files={num_files}: must be >= 1")
  paths = sorted(storage.glob(pattern))
  if not paths:
    raise FileNotFoundError(f"--input={pattern!r} matches no files")
  total = sum(storage.stat(p).length for p in paths)
  if storage.exists(output_dir) and storage.listdir(output_dir):
    raise ValueError(f"--output_dir={output_dir!r} is not empty: parts of another split would mix with these")
  storage.makedirs(output_dir)
  index, out, read_before = 0, None, 0
  bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"split_text -> {num_files} files")
  try:
    for lines, read in documents(paths):
      bar.update(read - read_before)
      # The next part starts once the input read so far covers this part's share (cumulative, so errors don't
      # add up).
      if out is None or (read_before >= total * (index + 1) / num_files and index + 1 < num_files):
        if out is not None:
          out.close()
          index += 1
        out = storage.open_file(part_path(output_dir, index, num_files), "wb")
      else:
        out.write(b"\n")
      out.write(b"".join(lines))
      read_before = read
    if out is None:
      return 0
    out.close()
  except BaseException:  # an error or a stop (Ctrl-C): the parts written so far would make a rerun refuse the directory
    if out is not None:
      with contextlib.suppress(Exception):  # the error may be the file's own
        out.close()
      for i in range(index + 1):
        epath.Path(part_path(output_dir, i, num_files)).unlink(missing_ok=True)
    raise
  finally:
    bar.close()
  written = index + 1
  if written < num_files:  # documents ran out: the names say how many parts there are
    for i in range(written):
      storage.rename(part_path(output_dir, i, num_files), part_path(output_dir, i, written))
  return written


def main():
  for name in ("input", "output_dir", "num_files"):
    if FLAGS[name].value is None:
      raise ValueError(f"--{name} is required")
  parts = split_text(FLAGS.input, FLAGS.output_dir, FLAGS.num_files)
  if parts < FLAGS.num_files:
    print(f"warning: the corpus has too few documents for {FLAGS.num_files} files: wrote {parts}")
  print(f"wrote {parts} files to {FLAGS.output_dir}")


if __name__ == "__main__":
  startup.run_program(main, "split_text", interrupted="the parts written are removed")
