"""Dropout, with two ways of drawing its masks (`DROPOUT_MASKS`), chosen per chip like attention.

- 'bernoulli': flax's nn.Dropout (jax.random.bernoulli): one threefry2x32 hash per element, which spends the
  hash's 64 random bits on one decision. XLA fuses the hash into each use of the mask, so no mask reaches
  memory: on a TPU that costs only vector-unit work, which the step's matrix products and HBM traffic hide.
- 'packed': four 16-bit decisions from each hash (`keep_mask`), a quarter of the hashes. XLA then writes the
  random words out and reads them back, 2 bytes an element: on the CPU the step is faster for it (BERT and
  XLNet small, benchmarks/README.md), on a TPU slower by plan (XLNet-Large's one-layer step on a v3-8: 8% more
  HBM traffic, and the masks copied to another layout; its compile twice as fast). On GPUs it is not measured
  yet: `benchmarks/train_step.py --device=gpu --dropout_masks=bernoulli,packed` times both.
"""
import math
from typing import List, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

DROPOUT_MASKS = ("auto", "bernoulli", "packed")
DECISION_BITS = 16  # random bits per keep-or-drop decision of a packed mask


def masks_for_device(device) -> str:
  """'packed' on CPUs, where the hashes are what a mask costs; 'bernoulli' on TPUs and GPUs (above)."""
  return "packed" if device.platform == "cpu" else "bernoulli"


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
  split = len(shape)
  while split > 0 and math.prod(shape[split - 1:]) < 2**32:
    split -= 1
  if math.prod(shape[:split]) >= 2**32:
    raise ValueError(f"a dropout mask of shape {tuple(shape)} has more elements than threefry's 64-bit counter")
  counters = [_flat_index(shape, axes) for axes in (range(split), range(split, len(shape)))]
  return list(threefry2x32_p.bind(key_data[0], key_data[1], *counters))


def _flat_index(shape: Sequence[int], axes: Sequence[int]) -> jax.Array:
  """Each element's row-major index over `axes` of `shape` (uint32; 0 over no axes), from iotas."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(axes):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
    stride *= shape[axis]
  return index


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
    else:  # as nn.Dropout draws it, at the same module path: the same masks
      keep, kept = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.rate, x.shape), 1.0 - self.rate
    return jax.lax.select(keep, x / kept, jnp.zeros_like(x))

  def kernel_seed(self) -> jax.Array:
    """Two uint32 words from this module's 'dropout' rng, for a kernel that draws its own masks
    (models/flash_dropout.py)."""
    return jax.random.bits(self.make_rng("dropout"), (2,), jnp.uint32)
