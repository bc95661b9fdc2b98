"""models/dropout.py: packed masks keep each element with the configured probability, independently of
the elements that share their random hash; hashed masks keep it with that probability independently of their
neighbours along every axis; the module scales what it keeps so that the mean is unchanged, and its 'bernoulli'
masks are flax's own."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import dropout

KEYS = {"threefry key": lambda seed: jax.random.key(seed),
        "raw threefry key": lambda seed: jax.random.PRNGKey(seed),  # what the trainer passes
        "rbg key": lambda seed: jax.random.key(seed, impl="rbg")}  # two decisions per 32-bit word


def masks(make_key, rate, shape, count):
  return np.stack([np.asarray(dropout.keep_mask(make_key(seed), rate, shape)) for seed in range(count)])


def within_sigmas(measured, p, n, sigmas=5.0):
  return abs(measured - p) <= sigmas * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("key_kind", KEYS)
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_a_packed_mask_keeps_the_configured_fraction(key_kind, rate):
  shape = (16, 8, 130)  # a last axis that four decisions per hash do not divide
  kept = masks(KEYS[key_kind], rate, shape, count=8)
  assert kept.shape == (8, *shape) and kept.dtype == bool
  p = dropout.kept_fraction(rate)
  assert abs(p - (1 - rate)) <= 2**-(dropout.DECISION_BITS + 1)  # the rate, rounded to the decisions' bits
  assert within_sigmas(kept.mean(), p, kept.size), (kept.mean(), p)
  # Every position of the last axis, the padded tail included, keeps at the same rate.
  by_position = kept.mean(axis=(0, 1, 2))
  assert all(within_sigmas(m, p, kept.size // shape[-1]) for m in by_position), by_position


@pytest.mark.parametrize("key_kind", KEYS)
def test_decisions_drawn_from_one_hash_are_independent(key_kind):
  # Neighbours in groups of four share a hash (threefry) or a word (rbg): each pair of them, and all four,
  # must be kept together as often as independent draws would be.
  kept = masks(KEYS[key_kind], 0.5, (256, 1024), count=2).reshape(-1, 4)
  n = len(kept)
  for i in range(4):
    for j in range(i + 1, 4):
      assert within_sigmas((kept[:, i] & kept[:, j]).mean(), 0.25, n), (i, j)
  assert within_sigmas(kept.all(axis=1).mean(), 1 / 16, n)
  assert within_sigmas((kept[:-1, 3] & kept[1:, 0]).mean(), 0.25, n - 1)  # across neighbouring hashes


def test_masks_differ_by_key_and_repeat_for_the_same_key():
  first, again, other = (np.asarray(dropout.keep_mask(jax.random.key(seed), 0.5, (64, 64))) for seed in (1, 1, 2))
  np.testing.assert_array_equal(first, again)
  assert within_sigmas((first == other).mean(), 0.5, first.size)  # unrelated, not shifted copies


def hashed(seed, rate, shape, row_axes):
  return np.asarray(dropout.hashed_keep_mask(jax.random.bits(jax.random.key(seed), (2,), jnp.uint32), rate, shape,
                                             row_axes))


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_a_hashed_mask_keeps_the_configured_fraction_independently_along_every_axis(rate):
  shape = (4, 8, 128, 128)  # 524,288 decisions, as the attention kernels draw them: a row per (batch, head)
  kept = hashed(0, rate, shape, row_axes=2)
  assert within_sigmas(kept.mean(), 1 - rate, kept.size)
  # Neighbours along each axis (keys, queries, heads, batch rows) are dropped together as often as
  # independent draws are: rate**2.
  dropped = ~kept
  for axis in range(4):
    first, second = (np.take(dropped, range(start, shape[axis] - 1 + start), axis=axis) for start in (0, 1))
    assert within_sigmas((first & second).mean(), rate**2, first.size), axis
  per_row = kept.reshape(shape[0] * shape[1], -1).mean(axis=1)  # no row is stuck
  assert all(within_sigmas(m, 1 - rate, shape[2] * shape[3]) for m in per_row)


def test_hashed_masks_differ_by_seed_and_repeat_for_the_same_seed():
  rate, shape = 0.1, (64, 4096)
  first, again, other = (hashed(seed, rate, shape, row_axes=1) for seed in (0, 0, 1))
  np.testing.assert_array_equal(first, again)
  agree = (1 - rate) ** 2 + rate**2  # two independent decisions agree this often
  assert within_sigmas((first == other).mean(), agree, first.size)
  with pytest.raises(ValueError, match="rows of 2\\*\\*32"):
    dropout.hashed_keep_mask(jnp.zeros(2, jnp.uint32), rate, (2, 2**16, 2**16), row_axes=1)


def apply(module, x, seed=0, deterministic=False):
  return module.apply({}, x, deterministic=deterministic, rngs={"dropout": jax.random.PRNGKey(seed)})


def test_the_module_keeps_the_mean_and_drops_nothing_when_deterministic():
  x = jax.random.normal(jax.random.key(0), (64, 32, 128))
  for masks in ("bernoulli", "packed", "hashed"):
    module = dropout.Dropout(0.25, masks)
    np.testing.assert_array_equal(apply(module, x, deterministic=True), x)
    y = np.asarray(apply(module, x))
    kept = y != 0
    p = dropout.kept_fraction(0.25) if masks == "packed" else 0.75
    assert within_sigmas(kept.mean(), p, kept.size)
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / p, rtol=1e-6)  # the expectation is x
    assert not np.array_equal(y, apply(module, x, seed=1))
  ones = jnp.ones((256, 256), jnp.bfloat16)  # the mean of many kept-and-scaled ones is one
  for masks in ("packed", "hashed"):
    assert abs(float(apply(dropout.Dropout(0.1, masks), ones).astype(jnp.float32).mean()) - 1) < 0.01


def test_bernoulli_masks_are_flax_dropouts_own():
  # What TPUs and GPUs train with: the masks of runs before packed masks existed, bit for bit.
  x = jax.random.normal(jax.random.key(0), (8, 16, 64))
  for seed in range(3):
    np.testing.assert_array_equal(apply(dropout.Dropout(0.1, "bernoulli"), x, seed), apply(nn.Dropout(0.1), x, seed))
  assert not np.array_equal(apply(dropout.Dropout(0.1, "packed"), x), apply(nn.Dropout(0.1), x))


def test_auto_draws_the_default_devices_masks_and_unknown_names_are_refused():
  x = jax.random.normal(jax.random.key(0), (8, 64))
  expected = dropout.masks_for_device(jax.devices()[0])
  np.testing.assert_array_equal(apply(dropout.Dropout(0.5, "auto"), x), apply(dropout.Dropout(0.5, expected), x))
  with pytest.raises(ValueError, match="dropout_masks='philox'"):
    apply(dropout.Dropout(0.5, "philox"), x)
