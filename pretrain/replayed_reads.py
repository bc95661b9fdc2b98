"""Which checkpoints hold a text input's failed read, so that every resume from them fails the same way.

tf.data saves a text input's position with what its pipeline has read ahead (documents, examples, batches), a
read that failed among them. When a text file goes missing mid-run, the run stops where the failure surfaces,
but the checkpoints saved in the batches before may already hold the failed read: once the file is back, a resume
from one of them meets the same failure at the same step. Which ones hold it is found by reading: each one's
saved position, newest first, is restored into a new iterator and read up to the batch that failed.
"""
from typing import Callable, List, Optional, Tuple

from pretrain import checkpoints

SET_ASIDE = "replayed"  # MODEL_DIR/replayed/<step>: checkpoints set aside for holding a failed read
# A checkpoint saved this many batches or more before the failed one is not read: tf.data reads far less ahead.
READ_AHEAD_BATCHES = 64


def holding_the_failure(model_dir: str, new_iterator: Callable[[], object], failed_step: int,
                        file: str) -> Tuple[List[int], Optional[int]]:
  """(the checkpoints whose saved position meets the failed read of `file` again at the batch of `failed_step`,
  newest first; the newest checkpoint that does not, or None where none is left)."""
  holding = []
  for step in reversed(checkpoints.saved_steps(checkpoints.checkpoint_dir(model_dir))):
    if failed_step - step >= READ_AHEAD_BATCHES or not _meets_it_again(model_dir, step, new_iterator(),
                                                                         failed_step, file):
      return holding, step
    holding.append(step)
  return holding, None


def _meets_it_again(model_dir: str, step: int, iterator, failed_step: int, file: str) -> bool:
  try:
    if checkpoints.restore_data_position(model_dir, step, iterator):  # a position that does not fit this input
      return False
    for _ in range(failed_step - step):
      next(iterator)
  except Exception as e:  # whatever tf.data raises, classified by the file it names (not so a damaged checkpoint's)
    return file in str(e)
  return False
