"""The token cross-entropy every family's loss takes: optax's values and gradients, without its scatter."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import ad_checkpoint

from pretrain.families import base


def _problem(dtype, vocab=1000):
  logits_key, targets_key, weights_key = jax.random.split(jax.random.PRNGKey(0), 3)
  logits = (4.0 * jax.random.normal(logits_key, (4, 16, vocab))).astype(dtype)
  targets = jax.random.randint(targets_key, (4, 16), 0, vocab)
  weights = (jax.random.uniform(weights_key, (4, 16)) > 0.3).astype(jnp.float32)
  return logits, targets, weights


def _losses(targets, weights):
  """(ours, optax's) weighted mean cross-entropy as functions of the logits."""
  def optaxs(logits):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return (losses * weights).sum() / weights.sum()
  return lambda logits: base.weighted_cross_entropy(logits, targets, weights)[0], optaxs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_loss_and_its_gradient_are_optaxs(dtype):
  logits, targets, weights = _problem(dtype)
  ours, reference = _losses(targets, weights)
  np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
  ours_grad, reference_grad = jax.grad(ours)(logits), jax.grad(reference)(logits)
  assert ours_grad.dtype == dtype
  # bf16: both round the same fp32 gradient once; fp32: they differ in the last bits of the softmax.
  np.testing.assert_allclose(np.asarray(ours_grad, np.float32), np.asarray(reference_grad, np.float32),
                             rtol=1e-5 if dtype == jnp.float32 else 0, atol=1e-8)


def test_the_backward_pass_keeps_the_logits_as_they_are_and_scatters_nothing(capsys):
  logits, targets, weights = _problem(jnp.bfloat16)

  def kept_of_logits_size(loss) -> list:
    ad_checkpoint.print_saved_residuals(loss, logits)
    return [line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "[4,16,1000]" in line]

  def scatters(loss) -> bool:
    return "stablehlo.scatter" in jax.jit(jax.grad(loss)).lower(logits).as_text()

  ours, reference = _losses(targets, weights)
  assert kept_of_logits_size(ours) == ["bf16[4,16,1000]"]  # the argument, nothing computed from it
  assert kept_of_logits_size(reference) == ["f32[4,16,1000]"]  # the softmax's exp, in fp32
  assert not scatters(ours)
  assert scatters(reference)  # the target logit's gradient
