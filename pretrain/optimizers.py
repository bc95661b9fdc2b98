"""Optimizers from optax: AdamW (BERT, XLNet, BART recipes) or LAMB (ALBERT, large-batch BERT),
linear warmup then linear decay, global-norm clipping, no weight decay on biases and LayerNorm.

Every optimizer skips an update whose gradients are not finite (`skip_if_not_finite`, with
optax.apply_if_finite's state), so params never become NaN; the train loop counts the skips and stops
a run that keeps making them. Optionally (`skip_loss_spikes_above`) it also skips an update whose loss
jumps above a multiple of its running mean, as MaxText's skip_step_on_spikes does.
"""
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from models import layers


def warmup_linear_decay(peak_learning_rate: float, warmup_steps: int, total_steps: int,
                        end_learning_rate: float = 0.0) -> optax.Schedule:
  layers.check_at_least(0, LEARNING_RATE=peak_learning_rate, WARMUP_STEPS=warmup_steps)
  warmup = optax.linear_schedule(0.0, peak_learning_rate, max(warmup_steps, 1))
  decay = optax.linear_schedule(peak_learning_rate, end_learning_rate, max(total_steps - warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [warmup_steps])


def _is_matrix_or_embedding(path) -> bool:
  # Only leaves named "bias" are biases: XLNet's attention biases (r_w_bias, r_r_bias, r_s_bias) are
  # decayed, as the reference's include_in_weight_decay does (zihangdai/xlnet model_utils.py).
  return getattr(path[-1], "key", None) not in ("bias", "scale")


def decay_mask(params):
  """True for matrices and embeddings; biases and LayerNorm scales are not decayed (reference BERT)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _is_matrix_or_embedding(path), params)


def scale_by_layerwise_trust_ratio() -> optax.GradientTransformation:
  """LAMB's trust ratio ||w|| / ||update|| for each weight matrix and embedding of each layer.

  A scanned stack holds all its layers' weights in one array (leading axis), so norms are taken per
  slice there: the same ratios as unrolled layers. Biases and LayerNorm params keep ratio 1, as in
  the reference LAMB of google-research/bert and albert (exclude_from_layer_adaptation).
  """
  def scale(path, update, param):
    if not _is_matrix_or_embedding(path):
      return update
    stacked = any(getattr(key, "key", None) == layers.SCANNED_STACK for key in path)
    axes = tuple(range(1, param.ndim)) if stacked else None
    param_norm = jnp.sqrt(jnp.sum(jnp.square(param), axis=axes, keepdims=True))
    update_norm = jnp.sqrt(jnp.sum(jnp.square(update), axis=axes, keepdims=True))
    ratio = jnp.where((param_norm == 0) | (update_norm == 0), 1.0, param_norm / update_norm)
    return update * ratio.astype(update.dtype)

  def update_fn(updates, state, params):
    return jax.tree_util.tree_map_with_path(scale, updates, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def skip_if_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner`, except that an update whose gradients hold an inf or NaN is skipped (zero updates, `inner`'s
  state kept) and counted, in optax.apply_if_finite's state (a checkpoint of either restores with the other),
  and never given up on: the loop decides when to stop (trainer.train's max_skipped_steps).

  The check is the gradients' global norm, which is not finite exactly when an element is not (or the sum of
  squares overflows fp32: no update to apply either). Clipping computes the same norm, so XLA computes it
  once. apply_if_finite checks leaf by leaf, then chooses through lax.cond: on an H200 its per-leaf checks
  and the norm inside the cond were ~800 of BERT-Large's 1,564 kernels per step, 2.4 of its 107 ms."""

  def init(params):
    return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
                                    total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update(updates, state, params=None, **extra_args):
    finite = jnp.isfinite(optax.global_norm(updates))
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    skipped = (~finite).astype(jnp.int32)
    return (jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates),
            optax.ApplyIfFiniteState(
                notfinite_count=(state.notfinite_count + 1) * skipped, last_finite=finite,
                total_notfinite=state.total_notfinite + skipped,
                inner_state=jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state)))

  return optax.GradientTransformationExtraArgs(init, update)


class LossSpikeState(NamedTuple):
  inner: Any
  loss_mean: jax.Array  # running mean of the losses of applied updates
  applied: jax.Array  # updates applied so far: the mean is trusted after `warmup` of them
  total_spikes: jax.Array


def skip_loss_spikes(inner: optax.GradientTransformation, factor: float, warmup: int = 100,
                     decay: float = 0.99) -> optax.GradientTransformationExtraArgs:
  """`inner`, except that an update whose `loss` (an extra argument of update) is above `factor` times
  the running mean of the applied updates' losses is skipped: params and `inner`'s state stay as they
  were. The mean decays by `decay` per applied update (about the last 1 / (1 - decay) of them) and is
  trusted only after `warmup` of them."""

  def init(params):
    return LossSpikeState(inner.init(params), jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32),
                          jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, loss, **extra_args):
    del extra_args
    loss = jnp.asarray(loss, jnp.float32)
    spike = (state.applied >= warmup) & (loss > factor * state.loss_mean)
    new_updates, new_inner = inner.update(updates, state.inner, params)
    keep_old = lambda new, old: jnp.where(spike, old, new)  # noqa: E731
    counted = jnp.isfinite(loss) & ~spike
    mean = jnp.where(state.applied == 0, loss, decay * state.loss_mean + (1 - decay) * loss)
    return (jax.tree.map(lambda u: jnp.where(spike, jnp.zeros_like(u), u), new_updates),
            LossSpikeState(jax.tree.map(keep_old, new_inner, state.inner),
                           jnp.where(counted, mean, state.loss_mean), state.applied + counted.astype(jnp.int32),
                           state.total_spikes + spike.astype(jnp.int32)))

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(schedule: optax.Schedule, name: str = "adamw", weight_decay: float = 0.01, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-6, clip_norm: float = 1.0,
                   skip_loss_spikes_above: Optional[float] = None) -> optax.GradientTransformationExtraArgs:
  """Its update takes the step's loss as an extra argument (`loss=`), used if `skip_loss_spikes_above`."""
  layers.check_at_least(0, WEIGHT_DECAY=weight_decay, ADAM_EPSILON=eps, CLIP_NORM=clip_norm)
  layers.check_fractions(ADAM_B1=b1, ADAM_B2=b2)
  if name == "adamw":
    update = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
  elif name == "lamb":
    update = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
                         optax.add_decayed_weights(weight_decay, mask=decay_mask),
                         scale_by_layerwise_trust_ratio(), optax.scale_by_learning_rate(schedule))
  else:
    raise ValueError(f"optimizers.make_optimizer.name={name!r}: expected 'adamw' or 'lamb'")
  clipped = optax.chain(optax.clip_by_global_norm(clip_norm), update) if clip_norm else update
  finite = skip_if_not_finite(clipped)
  if skip_loss_spikes_above is None:
    return optax.with_extra_args_support(finite)
  if skip_loss_spikes_above <= 1:
    raise ValueError(f"SKIP_LOSS_SPIKES_ABOVE={skip_loss_spikes_above}: expected a factor above 1 (e.g. 3), or None")
  return skip_loss_spikes(finite, skip_loss_spikes_above)


def skipped_updates(opt_state) -> dict:
  """How many updates were skipped for non-finite gradients (in all, and in a row up to now) and, when
  loss spikes are skipped, for those."""
  counts = {"skipped_steps": optax.tree_utils.tree_get(opt_state, "total_notfinite"),
            "skipped_in_a_row": optax.tree_utils.tree_get(opt_state, "notfinite_count")}
  spikes = optax.tree_utils.tree_get(opt_state, "total_spikes")
  return counts if spikes is None else {**counts, "skipped_spikes": spikes}
