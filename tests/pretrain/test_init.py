"""A fresh state's params (`steps.initial_params`): drawn as the model's own `init` draws them, per kind of
parameter; every layer its own draw; the same weights whether the layers run scanned or unrolled."""
import dataclasses
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from models.albert import AlbertConfig
from models.xlnet import XLNetConfig
from pretrain import run_files, steps
from pretrain.families.albert import AlbertFamily
from pretrain.families.xlnet import XLNetFamily

# XLNet has every kind of initializer the models use: truncated normal kernels (2-D, per-head 3-D), embeddings
# and biases, zero biases and unit norm scales. Wide enough that most kinds pool thousands of draws.
XLNET = XLNetFamily(XLNetConfig(vocab_size=300, d_model=64, n_layer=3, n_head=4, d_head=16, d_inner=128,
                                reuse_len=4, mem_len=4))
LENGTHS = {"input_ids": 8, "target_ids": 2, "reuse_len": 4}
SIGMAS = 5  # every tolerance below is this many standard errors of the statistic it bounds


def with_config(family, **changes):
  return dataclasses.replace(family, config=dataclasses.replace(family.config, **changes))


def rngs(seed: int) -> dict:
  params, dropout = jax.random.split(jax.random.PRNGKey(seed))
  return {"params": params, "dropout": dropout}


@pytest.fixture(scope="module")
def unrolled_and_scanned():
  """XLNet's initial params for seed 0 with unrolled layers and with scanned ones (one program: XLA computes
  the draws they share once)."""
  shapes = XLNET.feature_shapes(2, LENGTHS)
  init = lambda family: nn.unbox(steps.initial_params(family, shapes, rngs(0)))
  return jax.device_get(jax.jit(lambda: (init(XLNET), init(with_config(XLNET, scan_layers=True))))())


def by_kind(params) -> dict:
  """Parameter kind (its path without the layer number) -> {layer number or None: values}."""
  kinds = {}
  for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    layer = re.search(r"'layer_(\d+)'", name)
    kinds.setdefault(re.sub(r"'layer_\d+'", "'layer_*'", name), {})[int(layer.group(1)) if layer else None] = value
  return kinds


def test_each_kind_of_parameter_has_the_distribution_of_the_models_own_init(unrolled_and_scanned):
  """Each kind's mean, standard deviation and kurtosis (truncated normal: 2.36, normal: 3), pooled over
  layers, match the model's own `init` (a one-layer model, another seed); constant kinds (zero biases, unit
  norm scales) match exactly."""
  example = steps.example_batch(XLNET, XLNET.feature_shapes(2, LENGTHS))
  one_layer = with_config(XLNET, n_layer=1).make_model()
  reference = by_kind(jax.device_get(nn.unbox(jax.jit(lambda: one_layer.init(rngs(1), example))()["params"])))
  ours = by_kind(unrolled_and_scanned[0])
  assert ours.keys() == reference.keys()
  random_kinds = 0
  for kind in reference:
    x, y = (np.concatenate([v.ravel() for v in kinds[kind].values()]) for kinds in (ours, reference))
    if np.all(y == y[0]):
      np.testing.assert_array_equal(x, np.full_like(x, y[0]), err_msg=kind)
      continue
    random_kinds += 1
    # Standard errors of a difference between the two samples: of means, of relative standard deviations
    # (kurtosis at most a normal's 3), of kurtoses (each at most a normal's sqrt(24 / n)).
    spread = np.sqrt(1 / x.size + 1 / y.size)
    assert abs(x.mean() - y.mean()) < SIGMAS * y.std() * spread, kind
    assert abs(x.std() / y.std() - 1) < SIGMAS * spread / np.sqrt(2), (kind, x.std(), y.std())
    kurtosis = lambda v: np.mean((v - v.mean()) ** 4) / v.var() ** 2
    assert abs(kurtosis(x) - kurtosis(y)) < SIGMAS * np.sqrt(24) * spread, (kind, kurtosis(x), kurtosis(y))
  assert random_kinds >= 10


def test_every_layer_draws_its_own_weights(unrolled_and_scanned):
  """No two layers' weights of one kind are correlated beyond chance (let alone equal)."""
  checked = 0
  for kind, layers in by_kind(unrolled_and_scanned[0]).items():
    if None in layers or np.all(layers[0] == layers[0].flat[0]):
      continue  # outside the stack, or constant
    for i in layers:
      for j in range(i):
        a, b = layers[i].ravel(), layers[j].ravel()
        assert abs(np.corrcoef(a, b)[0, 1]) < SIGMAS / np.sqrt(a.size), (kind, i, j)
        checked += 1
  assert checked >= 9 * 3  # q, k, v, o, r, seg_embed, 3 relative biases (ffn kernels too) × 3 pairs of layers


def test_a_seed_gives_the_same_weights_scanned_or_unrolled(unrolled_and_scanned):
  unrolled, scanned = unrolled_and_scanned
  jax.tree.map(np.testing.assert_array_equal, run_files.in_layout(unrolled, scan_layers=True), scanned)


def test_a_model_that_cannot_scan_initialises_unrolled():
  """ALBERT sharing only attention cannot scan: its params are laid out as the model's own init lays them."""
  family = AlbertFamily(AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_layers=2, num_heads=2,
                                     mlp_dim=32, share="attention"))
  lengths = {"input_ids": 8, "masked_positions": 2}
  shapes = family.feature_shapes(2, lengths)
  ours = jax.eval_shape(lambda: steps.initial_params(family, shapes, rngs(0)))
  own = jax.eval_shape(lambda: family.make_model().init(rngs(0), steps.example_batch(family, shapes))["params"])
  assert ours == own
