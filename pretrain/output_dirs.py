"""Output directories written whole or not at all (exports, imports): local or gs://."""
import contextlib
import os
import tempfile

from etils import epath

from pretrain.errors import ConfigError


def check_output_dir(output_dir: str, overwrite: bool) -> epath.Path:
  out = epath.Path(output_dir)
  if out.exists() and not overwrite:
    if not out.is_dir():
      raise ConfigError(f"output directory {output_dir} is a file; pass --overwrite to replace it")
    if any(out.iterdir()):
      raise ConfigError(f"output directory {output_dir} is not empty; pass --overwrite to replace it")
  return out


@contextlib.contextmanager
def staged_directory(output_dir: epath.Path):
  """Yields a local directory to write into; it takes output_dir's place only if the block succeeds.

  Locally it is a sibling of output_dir; for gs:// it is written locally, copied to a sibling there.
  """
  name = f".{output_dir.name}.partial-{os.getpid()}"
  local = epath.Path(tempfile.gettempdir() if "://" in str(output_dir) else output_dir.parent) / name
  sibling = output_dir.parent / name
  for path in {local, sibling}:
    if path.exists():
      path.rmtree()
  local.mkdir(parents=True)
  try:
    yield str(local)
    if sibling != local:
      for root, _, files in os.walk(local):  # a local tree (epath has no recursive glob)
        for name in files:
          path = epath.Path(root) / name
          (sibling / path.relative_to(local)).parent.mkdir(parents=True, exist_ok=True)
          path.copy(sibling / path.relative_to(local))
    if output_dir.exists():
      output_dir.rmtree()
    sibling.rename(output_dir)
  finally:
    for path in {local, sibling}:
      if path.exists():
        path.rmtree()
