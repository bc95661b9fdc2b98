"""Optimizers from optax: AdamW (BERT, XLNet, BART recipes) or LAMB (ALBERT, large-batch BERT),
linear warmup then linear decay, global-norm clipping, no weight decay on biases and LayerNorm."""
import jax
import optax


def warmup_linear_decay(peak_learning_rate: float, warmup_steps: int, total_steps: int,
                        end_learning_rate: float = 0.0) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, peak_learning_rate, max(warmup_steps, 1))
  decay = optax.linear_schedule(peak_learning_rate, end_learning_rate, max(total_steps - warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params):
  """True for matrices and embeddings; biases and LayerNorm scales are not decayed (reference BERT)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) not in ("bias", "scale"), params)


def make_optimizer(schedule: optax.Schedule, name: str = "adamw", weight_decay: float = 0.01, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-6, clip_norm: float = 1.0) -> optax.GradientTransformation:
  if name == "adamw":
    update = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
  elif name == "lamb":
    update = optax.lamb(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
  else:
    raise ValueError(f"optimizers.make_optimizer.name={name!r}: expected 'adamw' or 'lamb'")
  return optax.chain(optax.clip_by_global_norm(clip_norm), update) if clip_norm else update
