"""Which library reads and writes a path: the one place that decides, for local and gs:// paths alike.

On a TPU VM (and anywhere without an emulator) every path goes through TensorFlow's filesystem:
tf.io.gfile, tf.data, tf.summary, tf.train.Checkpoint, with the machine's default credentials.

TensorFlow's Cloud Storage client has its endpoint compiled in (https://www.googleapis.com/storage/v1/;
no variable moves it), so it cannot reach a local Cloud Storage server. With
STORAGE_EMULATOR_HOST=http://HOST:PORT set (as the tests do, against fake-gcs-server), gs:// paths go
through gcsfs instead, and `use_emulator` points the other libraries at the same server: etils.epath
(EPATH_USE_TF=false makes it use gcsfs) and tensorstore, which writes orbax's arrays
(TENSORSTORE_GCS_HTTP_URL, with a dummy GOOGLE_AUTH_TOKEN_FOR_TESTING). Work that only TensorFlow can
do on such a path is staged on the local disk: `tf_readable` gives a local copy to read (text files in
tf.data, the vocabulary, a data-iterator checkpoint), `StagedDirectory` a local directory that is
copied up on `sync` (TensorBoard events, profiles, a data-iterator checkpoint).
"""
import glob as local_glob
import hashlib
import os
import shutil
import tempfile
from typing import IO, List, NamedTuple, Optional

import seqio
import tensorflow as tf
from etils import epath

EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"


def use_emulator(url: str) -> None:
  """gs:// paths go to the Cloud Storage server at `url` (http://HOST:PORT), for this process and its children.

  etils.epath picks its gs:// backend the first time it meets any path, so EPATH_USE_TF must be set
  before then (a process that set STORAGE_EMULATOR_HOST before starting gets this at import)."""
  os.environ[EMULATOR_VARIABLE] = url
  os.environ["EPATH_USE_TF"] = "false"
  os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # a local server checks no credentials
  os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs asks Google's API about each bucket
  import fsspec
  # No credentials to look for; no cached listings, as tensorstore and other processes write beside gcsfs.
  fsspec.config.conf.setdefault("gs", {}).update(token="anon", use_listings_cache=False)


def emulated(path) -> bool:
  """True for a gs:// path while STORAGE_EMULATOR_HOST is set: TensorFlow cannot reach it."""
  return str(path).startswith("gs://") and bool(os.environ.get(EMULATOR_VARIABLE))


def _gcs():
  import fsspec
  try:
    return fsspec.filesystem("gs")
  except ImportError as e:
    raise ImportError(f"{EMULATOR_VARIABLE} is set: gs:// paths need gcsfs (pip install -e '.[test]')") from e


# ----------------------------------------------------------------------------- files, either library


def open_file(path: str, mode: str = "r") -> IO:
  """A file object: tf.io.gfile.GFile, or gcsfs's for an emulated gs:// path (seekable when read)."""
  return _gcs().open(path, mode) if emulated(path) else tf.io.gfile.GFile(path, mode)


def exists(path: str) -> bool:
  return _gcs().exists(path) if emulated(path) else tf.io.gfile.exists(path)


class FileStatistics(NamedTuple):
  """tf.io.gfile.stat's fields, for a Cloud Storage object: the generation stands for the mtime."""
  length: int
  mtime_nsec: int
  is_directory: bool


def stat(path: str):
  """tf.io.gfile.stat's FileStatistics (length, mtime_nsec, is_directory); NotFoundError if there is none."""
  if not emulated(path):
    return tf.io.gfile.stat(path)
  try:
    info = _gcs().info(path)
  except FileNotFoundError:
    raise tf.errors.NotFoundError(None, None, f"{path}: no such file") from None
  return FileStatistics(int(info["size"]), int(info.get("generation") or 0), info["type"] == "directory")


def makedirs(path: str) -> None:
  if not emulated(path):  # Cloud Storage has no directories: an object's name makes its own
    tf.io.gfile.makedirs(path)


def listdir(path: str) -> List[str]:
  if emulated(path):
    return [os.path.basename(p.rstrip("/")) for p in _gcs().ls(path, detail=False)]
  return [name.rstrip("/") for name in tf.io.gfile.listdir(path)]


def rename(source: str, target: str, overwrite: bool = False) -> None:
  if emulated(source):
    if not overwrite and _gcs().exists(target):
      raise FileExistsError(target)
    _gcs().mv(source, target)
  else:
    tf.io.gfile.rename(source, target, overwrite=overwrite)


def glob(pattern: str) -> List[str]:
  """The existing paths that match a glob pattern."""
  return ["gs://" + p for p in _gcs().glob(pattern)] if emulated(pattern) else tf.io.gfile.glob(pattern)


def list_files(pattern: str) -> List[str]:
  """Sorted paths matching a glob pattern, as seqio lists them (a pattern without wildcards is itself)."""
  if not emulated(pattern):
    return seqio.utils.list_files(pattern)
  return sorted(glob(pattern)) if local_glob.has_magic(pattern) else [pattern]


def append_text(path: str, text: str) -> None:
  """Adds `text` at the end of the file. Cloud Storage objects are immutable: TensorFlow's filesystem
  (epath's backend for gs:// without an emulator) reads and rewrites the object; gcsfs would silently
  overwrite it in mode 'a', so that is done here."""
  if not emulated(path):
    with epath.Path(path).open("a") as f:
      f.write(text)
    return
  old = _gcs().cat_file(path).decode() if _gcs().exists(path) else ""
  _gcs().pipe_file(path, (old + text).encode())


# ----------------------------------------------------------------------------- staging for TensorFlow


def tf_readable(path: str) -> str:
  """A path TensorFlow can read with the file's bytes: `path` itself, or for an emulated gs:// path a
  local copy (made once per content, in the system temp dir)."""
  if not emulated(path):
    return path
  copy_name = hashlib.sha1(f"{path} {stat(path).mtime_nsec}".encode()).hexdigest()[:16]
  local = os.path.join(tempfile.gettempdir(), "pod_pretrain_gs_copies", copy_name, os.path.basename(path))
  if not os.path.exists(local):
    os.makedirs(os.path.dirname(local), exist_ok=True)
    partial = f"{local}.partial-{os.getpid()}"
    _gcs().get_file(path, partial)
    os.replace(partial, local)  # whole or not at all: concurrent readers share the copy
  return local


class StagedDirectory:
  """A directory for TensorFlow to write into: `path` itself, or for an emulated gs:// directory a local
  one whose files `sync` copies up (all of them, each time: the files TensorFlow keeps writing to, such
  as event files, grow)."""

  def __init__(self, directory: str):
    self.target = str(directory)
    self._local: Optional[str] = tempfile.mkdtemp(prefix="pod_pretrain_staged_") if emulated(self.target) else None
    self.path = self._local or self.target

  def sync(self) -> None:
    if self._local is None:
      return
    for root, _, files in os.walk(self._local):
      for name in files:
        source = os.path.join(root, name)
        _gcs().put_file(source, f"{self.target.rstrip('/')}/{os.path.relpath(source, self._local)}")

  def download(self) -> None:
    """Copies the target's files (all, at any depth) into the local directory, for TensorFlow to read."""
    if self._local is not None:
      for remote in _gcs().find(self.target):  # bucket/path names, without gs://
        local = os.path.join(self._local, os.path.relpath(remote, self.target.removeprefix("gs://")))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        _gcs().get_file(remote, local)

  def close(self) -> None:
    if self._local is not None:
      shutil.rmtree(self._local, ignore_errors=True)


if os.environ.get(EMULATOR_VARIABLE):
  use_emulator(os.environ[EMULATOR_VARIABLE])
