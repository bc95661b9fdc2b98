"""Per-example functions whose tf.data graph is traced once per process.

tf.data traces the function of every `map` into a graph each time a pipeline is built: for each data shard a
process reads, each task of a mixture, the held-out split and a resumed run's iterator. An objective's function
is hundreds of ops, so each trace takes from a fraction of a second (MLM) to seconds (XLNet's permutation).
"""
import functools
from typing import Callable

import numpy as np
import tensorflow as tf


def _is_tensor(value) -> bool:
  return any(isinstance(leaf, (tf.Tensor, tf.RaggedTensor)) for leaf in tf.nest.flatten(value))


def _key(value):
  """A setting as part of a dictionary key: a numpy array (a vocabulary's table) by its bytes."""
  return (value.dtype.str, value.shape, value.tobytes()) if isinstance(value, np.ndarray) else value


def traced_once(fn: Callable) -> Callable:
  """`fn(*args, **kwargs)` as a tf.function per distinct settings, kept for the process: a later pipeline calls
  the graph traced by the first. The positional arguments and the keyword arguments that hold tensors (examples,
  seeds) are its inputs; the other keyword arguments, hashable values or numpy arrays, are its settings."""
  graphs = {}

  @functools.wraps(fn)
  @tf.autograph.experimental.do_not_convert
  def call(*args, **kwargs):
    inputs = {name: value for name, value in kwargs.items() if _is_tensor(value)}
    settings = {name: value for name, value in kwargs.items() if name not in inputs}
    key = tuple(sorted((name, _key(value)) for name, value in settings.items()))
    if key not in graphs:
      graphs[key] = tf.function(functools.partial(fn, **settings), autograph=False, reduce_retracing=True)
    return graphs[key](*args, **inputs)

  return call
