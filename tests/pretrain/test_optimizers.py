"""The optimizer's skips: non-finite gradients, and a loss spike above the configured multiple of the running
mean, leave params and optimizer state as they were and are counted; without the setting, no loss is ever a
spike."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pretrain import optimizers

FACTOR, WARMUP = 3.0, 100  # WARMUP: make_optimizer's default for skip_loss_spikes


def run(optimizer, losses):
  """Applies one update per loss, each from the gradient 1 on every weight; returns the weights after
  each update and the last optimizer state."""
  params = {"w": jnp.zeros(4)}
  state = optimizer.init(params)
  update = jax.jit(lambda params, state, loss: optimizer.update({"w": jnp.ones(4)}, state, params, loss=loss))
  history = []
  for loss in losses:
    updates, state = update(params, state, loss)
    params = jax.tree.map(jnp.add, params, updates)
    history.append(float(params["w"][0]))
  return history, state


def test_a_loss_spike_is_skipped_and_counted_once_the_mean_is_trusted():
  rng = np.random.default_rng(0)
  steady = list(1.0 + 0.1 * rng.random(WARMUP))  # losses around 1.05
  losses = steady + [FACTOR * 1.2, 1.0, FACTOR * 0.9]  # a spike, then a high but ordinary loss
  optimizer = optimizers.make_optimizer(lambda step: 0.1, clip_norm=0.0, weight_decay=0.0,
                                        skip_loss_spikes_above=FACTOR)
  weights, state = run(optimizer, losses)
  moved = np.diff([0.0] + weights) != 0
  spike = len(steady)
  assert moved[:spike].all() and not moved[spike] and moved[spike + 1:].all()
  assert optimizers.skipped_updates(state)["skipped_spikes"] == 1
  # Adam's moments skipped the spike too: the update after it equals the update of a run without it.
  without, _ = run(optimizer, losses[:spike] + losses[spike + 1:spike + 2])
  np.testing.assert_allclose(weights[spike + 1], without[-1], rtol=1e-6)


def test_before_warmup_updates_the_mean_is_not_trusted():
  import optax
  weights, state = run(optimizers.skip_loss_spikes(optax.sgd(1.0), FACTOR, warmup=3), [1.0, 1.0, 50.0, 1.0, 50.0])
  assert np.all(np.diff([0.0] + weights)[:4] != 0) and weights[4] == weights[3]
  assert int(state.total_spikes) == 1


def test_without_the_setting_no_loss_is_a_spike():
  optimizer = optimizers.make_optimizer(lambda step: 0.1, clip_norm=0.0, weight_decay=0.0)
  weights, state = run(optimizer, [1.0] * (WARMUP + 5) + [1e6])
  assert weights[-1] != weights[-2]
  assert "skipped_spikes" not in optimizers.skipped_updates(state)


def test_a_factor_of_one_or_less_is_refused():
  with pytest.raises(ValueError, match=r"SKIP_LOSS_SPIKES_ABOVE=1: expected a factor above 1"):
    optimizers.make_optimizer(lambda step: 0.1, skip_loss_spikes_above=1)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_skipped_and_counted_in_apply_if_finites_state(bad):
  """As optax.apply_if_finite skips (its state, so checkpoints of either restore), never giving up; a finite
  update after them resets the count in a row and is applied as if they had not happened."""
  schedule = optimizers.warmup_linear_decay(1e-2, 0, 100)
  ours = optimizers.make_optimizer(schedule)
  params = {"w": jnp.arange(4.0), "bias": jnp.ones(2)}
  state = ours.init(params)
  as_before = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, eps=1e-6, weight_decay=0.01,
                                                                      mask=optimizers.decay_mask))
  reference = optax.apply_if_finite(as_before, 3).init(params)  # the optimizer of earlier checkpoints
  assert jax.tree.structure(state) == jax.tree.structure(reference)
  good = {"w": jnp.full(4, 0.5), "bias": jnp.full(2, -0.5)}
  broken = {"w": good["w"].at[2].set(bad), "bias": good["bias"]}
  update = jax.jit(lambda grads, state: ours.update(grads, state, params, loss=1.0))
  for count in range(1, 6):  # past apply_if_finite's own limits: ours never applies them
    updates, state = update(broken, state)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert optimizers.skipped_updates(state) == {"skipped_steps": count, "skipped_in_a_row": count}
  fresh = ours.init(params)
  jax.tree.map(np.testing.assert_array_equal, state.inner_state, fresh.inner_state)  # as if never updated
  updates, state = update(good, state)
  expected, _ = update(good, fresh)
  jax.tree.map(np.testing.assert_array_equal, updates, expected)
  assert optimizers.skipped_updates(state) == {"skipped_steps": 5, "skipped_in_a_row": 0}
