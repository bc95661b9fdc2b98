"""The layers with a gradient of their own compute what autodiff would.

The attention softmax keeps only its output for the backward pass: in fp32 its value and gradient are
jax.nn.softmax's; in bf16 its value is jax.nn.softmax's rounded, its gradient within bf16 rounding.
The LM heads' bias add sums its gradient's rows as a product with ones: the same sums. A one-hot embedding
(token types) gives nn.Embed's bf16 rows, its gradient a product summed in fp32, not a scatter-add."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers


def scores_and_upstream(seed=0):
  rng = np.random.default_rng(seed)
  scores = rng.normal(scale=3.0, size=(2, 3, 16, 24)).astype(np.float32)
  scores[0, 0, :, 5:] -= 1e9  # masked keys, as the families' bias masks them
  scores[1, 2, 3] -= 1e9  # a fully masked row (padding): uniform, not NaN
  return jnp.asarray(scores), jnp.asarray(rng.normal(size=scores.shape).astype(np.float32))


def reference(scores, upstream, dtype):
  probs, vjp = jax.vjp(lambda s: jax.nn.softmax(s, axis=-1), scores)
  return probs.astype(dtype), vjp(upstream.astype(dtype).astype(jnp.float32))[0]


@pytest.mark.parametrize("keep_output_as_written", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_value_and_gradient_are_jax_softmaxs(dtype, keep_output_as_written):
  scores, upstream = scores_and_upstream()
  probs, vjp = jax.jit(lambda s: jax.vjp(lambda s: layers.softmax(s, dtype, keep_output_as_written), s))(scores)
  gradient, = vjp(upstream.astype(dtype))
  expected_probs, expected_gradient = reference(scores, upstream, dtype)
  assert probs.dtype == dtype and gradient.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(probs, np.float32), np.asarray(expected_probs, np.float32))
  assert np.isfinite(gradient).all()
  if dtype == jnp.float32:
    np.testing.assert_allclose(gradient, expected_gradient, rtol=1e-5, atol=1e-7)
  else:  # probs rounded to 8 bits of mantissa: relative error 2^-8 on each term of p * (g - <g, p>)
    scale = np.abs(np.asarray(expected_probs, np.float32)) * (np.abs(upstream) + np.abs(upstream).max())
    assert (np.abs(gradient - expected_gradient) <= 2 ** -7 * scale + 1e-6).all()
    assert np.abs(gradient - expected_gradient).max() > 0  # the bf16 residual is really what it uses


def test_row_bias_gradient_is_the_sum_over_rows():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 5, 7)).astype(np.float32))
  bias = jnp.asarray(rng.normal(size=(7,)).astype(np.float32))
  upstream = jnp.asarray(rng.normal(size=(3, 5, 7)).astype(np.float32))
  out, vjp = jax.vjp(layers.add_row_bias, x, bias)
  np.testing.assert_array_equal(out, x + bias)
  grad_x, grad_bias = vjp(upstream)
  np.testing.assert_array_equal(grad_x, upstream)
  np.testing.assert_allclose(grad_bias, upstream.sum(axis=(0, 1)), rtol=1e-5, atol=1e-6)


def test_one_hot_embedding_rows_are_the_tables_in_bf16_and_their_gradient_sums_in_fp32():
  """4096 positions over 2 rows, as BERT's token types: each row's gradient is a sum of about 2048 terms. In
  bf16 (nn.Embed's lookup) that sum keeps 8 bits; ours is the fp32 sum of the same bf16 terms."""
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(0, 2, size=(8, 512)))
  upstream = jnp.asarray(rng.normal(size=(8, 512, 16)), jnp.bfloat16)
  ours = layers.embedding(2, 16, ("token_type", "embed"), jnp.bfloat16, "token_type", one_hot=True)
  flax_embed = nn.Embed(2, 16, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  params = flax_embed.init(jax.random.PRNGKey(0), ids)
  rows, vjp = jax.vjp(lambda p: ours.apply(p, ids), params)
  flax_rows, flax_vjp = jax.vjp(lambda p: flax_embed.apply(p, ids), params)
  assert rows.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(flax_rows, np.float32))
  exact = np.stack([np.asarray(upstream, np.float64)[np.asarray(ids) == row].sum(axis=0) for row in (0, 1)])
  error = np.abs(np.asarray(vjp(upstream)[0]["params"]["embedding"], np.float64) - exact).max()
  flax_error = np.abs(np.asarray(flax_vjp(upstream)[0]["params"]["embedding"], np.float64) - exact).max()
  # fp32 sums of ~2048 terms of size ~1; bf16 ones are off by ~0.1
  assert error < 1e-3 < flax_error, (error, flax_error)


def test_a_one_hot_embeddings_gradient_is_a_product_not_a_scatter():
  """Every position's gradient lands in one of a few rows: as a scatter-add on a GPU those updates contend."""
  ids = jnp.zeros((4, 64), jnp.int32)
  for one_hot, scatters in ((True, False), (False, True)):
    module = layers.embedding(2, 8, ("token_type", "embed"), jnp.bfloat16, "token_type", one_hot=one_hot)
    params = module.init(jax.random.PRNGKey(0), ids)
    gradient = jax.grad(lambda p: module.apply(p, ids).astype(jnp.float32).sum())
    assert ("scatter" in jax.jit(gradient).lower(params).as_text()) == scatters
