"""Stateless random helpers the objectives share; `seed` is an int tensor of shape [2] throughout."""
import tensorflow as tf


def split_seed(seed, num: int):
  """`num` independent stateless seeds derived from `seed`."""
  return tf.unstack(tf.random.experimental.stateless_split(seed, num))


def randint(seed, low, high):
  """Uniform int32 in [low, high] inclusive."""
  return tf.random.stateless_uniform([], seed, minval=low, maxval=high + 1, dtype=tf.int32)
