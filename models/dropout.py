"""Dropout, with three ways of drawing its masks (`DROPOUT_MASKS`), chosen per chip like attention.

- 'bernoulli': flax's nn.Dropout (jax.random.bernoulli): one threefry2x32 hash per element, which spends the
  hash's 64 random bits on one decision. XLA fuses the hash into each use of the mask, so no mask reaches
  memory: on a TPU that costs only vector-unit work, which the step's matrix products and HBM traffic hide.
- 'packed': four 16-bit decisions from each hash (`keep_mask`), a quarter of the hashes. XLA then writes the
  random words out and reads them back, 2 bytes an element: on a TPU slower by plan (XLNet-Large's one-layer
  step on a v3-8: 8% more HBM traffic, and the masks copied to another layout; its compile twice as fast).
- 'hashed': each decision from a hash of the element's index under a seed drawn from the key (`hashed_keeps`:
  two rounds of MurmurHash3's 32-bit finaliser, about a fifth of threefry's integer operations per decision).
  XLA fuses it into each use of the mask, as it does bernoulli's. The fastest on the CPU (BERT, XLNet and BART
  small: 15%, 21% and 7% faster steps than bernoulli, 5%, 10% and 4% than packed; benchmarks/README.md); on a
  TPU the same HBM traffic as bernoulli by plan, but XLNet's one-layer step compiled in 71 s against 38 s.
  models/flash_dropout.py's GPU kernels make the same decisions inside the attention.
On GPUs none is measured yet: `benchmarks/train_step.py --device=gpu --dropout_masks=bernoulli,packed,hashed`.
"""
import math
from typing import List, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

DROPOUT_MASKS = ("auto", "bernoulli", "packed", "hashed")
DECISION_BITS = 16  # random bits per keep-or-drop decision of a packed mask


def masks_for_device(device) -> str:
  """'hashed' on CPUs, where the hashes are what a mask costs; 'bernoulli' on TPUs and GPUs (above)."""
  return "hashed" if device.platform == "cpu" else "bernoulli"


def keep_mask(key: jax.Array, rate: float, shape: Sequence[int]) -> jax.Array:
  """True where a packed mask keeps an element of `shape`: with probability `kept_fraction(rate)`, 1 - rate
  rounded to a multiple of 2**-16 (0.1 -> 0.100006). Four decisions from each threefry2x32 hash; with other
  key implementations (rbg), two from each 32-bit word of jax.random.bits."""
  *lead, length = shape
  per_word = 32 // DECISION_BITS
  if str(jax.random.key_impl(key)) == "threefry2x32":
    words = _threefry_words((*lead, -(-length // (2 * per_word))), jax.random.key_data(key))
  else:
    words = [jax.random.bits(key, (*lead, -(-length // per_word)), jnp.uint32)]
  fields = [(word >> (DECISION_BITS * i)) & (2**DECISION_BITS - 1) for word in words for i in range(per_word)]
  # A hash's decisions go to neighbouring elements of the last axis, so each device of a sharded mask draws
  # only its own block (the counters are elementwise too).
  decisions = jnp.stack(fields, axis=-1).reshape(*lead, -1)[..., :length]
  return decisions >= _dropped_values(rate)


def kept_fraction(rate: float) -> float:
  """The probability with which `keep_mask` keeps an element."""
  return 1.0 - _dropped_values(rate) / 2**DECISION_BITS


def _dropped_values(rate: float) -> int:
  """How many of a decision's 2**DECISION_BITS values drop the element: the rate, rounded."""
  return round(rate * 2**DECISION_BITS)


def _threefry_words(shape: Sequence[int], key_data: jax.Array) -> List[jax.Array]:
  """Both 32-bit outputs of threefry2x32 under the key, over one counter pair per element of `shape`: its
  row-major index over the leading axes and over the rest (split where each fits in 32 bits)."""
  split = fewest_row_axes(shape)
  if math.prod(shape[:split]) >= 2**32:
    raise ValueError(f"a dropout mask of shape {tuple(shape)} has more elements than threefry's 64-bit counter")
  counters = [_flat_index(shape, axes) for axes in (range(split), range(split, len(shape)))]
  return list(threefry2x32_p.bind(key_data[0], key_data[1], *counters))


def fewest_row_axes(shape: Sequence[int]) -> int:
  """How many leading axes of `shape` index rows so that a row's elements have a 32-bit index: the fewest."""
  return next(axes for axes in range(len(shape) + 1) if math.prod(shape[axes:]) < 2**32)


def _flat_index(shape: Sequence[int], axes: Sequence[int]) -> jax.Array:
  """Each element's row-major index over `axes` of `shape` (uint32; 0 over no axes), from iotas."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(axes):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
    stride *= shape[axis]
  return index


SPREAD = np.uint32(0x9E3779B9)  # odd: multiplying by it sends consecutive integers far apart before hashing


def mix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser (uint32): every input bit flips each output bit with probability about 1/2."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def row_salt(seed, row: jax.Array) -> jax.Array:
  """The 32-bit salt of a row of decisions (uint32 index) under a seed of two uint32 words (array or Pallas ref)."""
  return mix32(seed[0] ^ mix32(row.astype(jnp.uint32) * SPREAD + seed[1]))


def hashed_keeps(salt: jax.Array, index: jax.Array, rate: float) -> jax.Array:
  """Keep-or-drop decisions of the elements at `index` (uint32) of the salt's row: True with probability
  1 - rate, rounded to a multiple of 2**-32."""
  bits = mix32(mix32(index.astype(jnp.uint32) ^ salt) + salt)
  return bits >= np.uint32(min(round(rate * 2**32), 2**32 - 1))


def hashed_keep_mask(seed: jax.Array, rate: float, shape: Sequence[int], row_axes: int) -> jax.Array:
  """`hashed_keeps` over `shape`: a row per index of the leading `row_axes` axes, the element's row-major
  index over the others within it (fewer than 2**32 elements)."""
  if math.prod(shape[row_axes:]) >= 2**32:
    raise ValueError(f"a hashed mask of shape {tuple(shape)} has rows of 2**32 elements or more")
  rows, index = (_flat_index(shape, axes) for axes in (range(row_axes), range(row_axes, len(shape))))
  return hashed_keeps(row_salt(seed, rows), index, rate)


class Dropout(nn.Module):
  """nn.Dropout (the 'dropout' rng; kept elements scaled up by the kept fraction), its masks drawn as `masks`
  says; 'auto' (a model used outside a run's setup, which resolves it for the mesh's chip) by the default
  device."""
  rate: float
  masks: str = "auto"

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    masks = masks_for_device(jax.devices()[0]) if self.masks == "auto" else self.masks
    if masks not in DROPOUT_MASKS:
      raise ValueError(f"dropout_masks={self.masks!r}: expected one of {DROPOUT_MASKS}")
    if deterministic or self.rate == 0.0:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    if masks == "packed":
      keep, kept = keep_mask(self.make_rng("dropout"), self.rate, x.shape), kept_fraction(self.rate)
    elif masks == "hashed":
      keep = hashed_keep_mask(self.hash_seed(), self.rate, x.shape, fewest_row_axes(x.shape))
      kept = 1.0 - self.rate
    else:  # as nn.Dropout draws it, at the same module path: the same masks
      keep, kept = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.rate, x.shape), 1.0 - self.rate
    return jax.lax.select(keep, x / kept, jnp.zeros_like(x))

  def hash_seed(self) -> jax.Array:
    """Two uint32 words from this module's 'dropout' rng: the seed of hashed masks, drawn here or inside a kernel
    (models/flash_dropout.py)."""
    return jax.random.bits(self.make_rng("dropout"), (2,), jnp.uint32)
