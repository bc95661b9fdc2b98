"""Which TFRecord file a corrupted record is in: tf.data's DataLossError says only 'corrupted record at
OFFSET', which, with a dataset of hundreds of files read in an interleave, names no file to mend.

A TFRecord file is a run of records, each: its length (8 bytes, little-endian), the length's masked CRC-32C,
the data, and the data's masked CRC-32C. TensorFlow gives the offset of the data whose checksum failed, so
only the damaged file has a record whose length checks out 12 bytes before OFFSET and whose data does not; in
the others that is a record that checks out, or no record at all. (A damaged length is told at the record's
own start, where nothing checks out in any file: no file is named then.)
"""
import struct
from typing import Iterable, Optional

from data_pipelines import storage

_HEADER_BYTES = 12  # the length and its checksum


def damaged_at(path: str, offset: int) -> bool:
  """True if `path` holds a record whose data at `offset` fails its checksum while its length checks out."""
  # TFRecord's own checksum, as tensorboard writes it; imported here, only after a failure (35 ms at every start)
  from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
  start = offset - _HEADER_BYTES
  if start < 0 or storage.stat(path).length < offset:
    return False
  with storage.open_file(path, "rb") as f:
    f.seek(start)
    header = f.read(_HEADER_BYTES)
    length_bytes, length_crc = header[:8], struct.unpack("<I", header[8:])[0]
    if masked_crc32c(length_bytes) != length_crc:
      return False  # no record starts here
    data = f.read(struct.unpack("<Q", length_bytes)[0] + 4)
  return len(data) < 4 or masked_crc32c(data[:-4]) != struct.unpack("<I", data[-4:])[0]


def corrupted_record_file(paths: Iterable[str], offset: int) -> Optional[str]:
  """The first of `paths` whose record data at `offset` is damaged, or None: one record read per file."""
  return next((path for path in paths if damaged_at(path, offset)), None)
