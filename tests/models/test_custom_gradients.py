"""The layers with a gradient of their own compute what autodiff would.

The attention softmax keeps only its output for the backward pass: in fp32 its value and gradient are
jax.nn.softmax's; in bf16 its value is jax.nn.softmax's rounded, its gradient within bf16 rounding.
The LM heads' bias add sums its gradient's rows as a product with ones: the same sums."""
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_value_and_gradient_are_jax_softmaxs(dtype):
  scores, upstream = scores_and_upstream()
  probs, vjp = jax.vjp(lambda s: layers.softmax(s, dtype), scores)
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
