"""The small interface through which the trainer knows a model family.

A family says which Flax module to build, which objectives' examples it trains on (their features
are stated in `data_pipelines.features`), what state it carries from one step to the next (XLNet's
memory; nothing for the others), and how model outputs and a batch become a loss and metrics. The
trainer's core never names a family.
"""
import abc
import dataclasses
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from data_pipelines import features
from models import dropout, layers
from pretrain.errors import ConfigError, user_settings

# Model settings whose 'auto' is resolved for the chip a run compiles for: name -> (values, chooser).
DEVICE_CHOICES = {"attention_implementation": (layers.ATTENTION_IMPLEMENTATIONS, layers.attention_for_device),
                  "dropout_masks": (dropout.DROPOUT_MASKS, dropout.masks_for_device)}
# Model settings that choose between ways of computing the same step, whatever the chip: name -> values.
COMPUTE_CHOICES = {"gelu_gradient": layers.GELU_GRADIENTS}

Batch = Mapping[str, jax.Array]
Metrics = Dict[str, jax.Array]


class Family(abc.ABC):
  """Subclasses hold their model config in `self.config` (a frozen dataclass with `vocab_size`)."""

  name: str
  config: Any
  objectives: Tuple[str, ...]  # the objectives (`data_pipelines.features.SCHEMAS`) whose examples it takes
  layer_count_fields: Tuple[str, ...]  # config fields that set the depth of each layer stack
  # Model config fields whose 'auto' is the chip's: name -> (the values it takes, the chip's value).
  device_choices: ClassVar[Mapping[str, Tuple[Tuple[str, ...], Callable[[Any], str]]]] = DEVICE_CHOICES

  def fit_to_data(self, vocab_size: int, objective: str, feature_lengths: Mapping[str, int]) -> "Family":
    """The family with its model fitted to the run's data: an unset vocab_size becomes the vocabulary's
    (one too small is an error), and the objective must be one it trains on, at lengths it takes."""
    if objective not in self.objectives:
      raise ConfigError(f"the {self.name} family trains on {' or '.join(self.objectives)} examples, the task "
                        f"gives {objective} examples: pair the model and objective gin files of one family")
    from data_pipelines import tasks  # here: it imports TensorFlow, which a family used without data does not need
    with user_settings():
      tasks.check_lengths(objective, feature_lengths)
    return self.fitted(vocab_size, feature_lengths)

  def fitted(self, vocab_size: int, feature_lengths: Mapping[str, int]) -> "Family":
    """`fit_to_data` without checking the objective's lengths against its data pipeline (which loads
    TensorFlow): for batches made otherwise, as the benchmarks make them."""
    with_lengths = self._fit_lengths(feature_lengths)
    size = with_lengths.config.vocab_size
    if size is None:
      return dataclasses.replace(with_lengths, config=dataclasses.replace(with_lengths.config, vocab_size=vocab_size))
    if size < vocab_size:
      raise ConfigError(f"{self.name} vocab_size={size} is smaller than the vocabulary ({vocab_size} pieces)")
    return with_lengths

  def for_device(self, device) -> "Family":
    """The family as it compiles for `device`'s chip: a model's attention and dropout masks of 'auto' become
    the chip's (`layers.attention_for_device`, `dropout.masks_for_device`), and every such choice is checked."""
    known_values = {**COMPUTE_CHOICES, **{name: known for name, (known, _) in self.device_choices.items()}}
    for name, known in known_values.items():
      value = getattr(self.config, name, None)
      if value is not None and value not in known:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(known)}")
    chosen = {name: for_device(device) for name, (_, for_device) in self.device_choices.items()
              if getattr(self.config, name, None) == "auto"}
    attention = chosen.get("attention_implementation", getattr(self.config, "attention_implementation", None))
    refusal = attention and layers.attention_refusal(attention, device)
    if refusal:
      raise ConfigError(f"attention_implementation={attention!r} {refusal}")
    return dataclasses.replace(self, config=dataclasses.replace(self.config, **chosen)) if chosen else self

  def _fit_lengths(self, feature_lengths: Mapping[str, int]) -> "Family":
    """Model settings that follow from TASK_FEATURE_LENGTHS (XLNet's reuse_len); none by default."""
    del feature_lengths
    return self

  @abc.abstractmethod
  def make_model(self) -> nn.Module:
    """The Flax module; `module.apply(variables, features, deterministic=..., **carry)`."""

  def feature_shapes(self, batch_size: int, feature_lengths: Mapping[str, int]) -> Dict[str, jax.ShapeDtypeStruct]:
    """Every feature of a batch of `batch_size` rows, as the feature converter emits it."""
    shapes = features.schema(self.objectives[0]).shapes(feature_lengths)  # a family's objectives share one schema
    return {name: jax.ShapeDtypeStruct((batch_size,) + shape, dtype) for name, (shape, dtype) in shapes.items()}

  def example_rows(self) -> int:
    """Rows of the dummy batch that initialises the params."""
    return 1

  def check_microbatch_rows(self, rows: int) -> None:
    """Refuses a layout the family cannot run: `rows` per data-parallel group per microbatch."""
    del rows

  def initial_carry(self, batch_size: int) -> Dict[str, jax.Array]:
    """State carried across steps (e.g. XLNet memory). Empty for stateless families."""
    del batch_size
    return {}

  def bi_data(self) -> bool:
    """Whether odd batch rows read the text of the row before backwards (XLNet's bi_data)."""
    return False

  def carry_axes(self) -> Dict[str, Tuple[str, ...]]:
    """Logical axis names of each carry leaf, for sharding."""
    return {}

  def forward(self, model: nn.Module, params, batch: Batch, carry, *, rngs, deterministic: bool):
    """Returns (outputs, new_carry); stateless families pass the carry through unchanged."""
    return model.apply({"params": params}, batch, deterministic=deterministic, rngs=rngs), carry

  @abc.abstractmethod
  def loss_and_metrics(self, outputs, batch: Batch, weight_totals: Optional[Mapping[str, jax.Array]] = None
                       ) -> Tuple[jax.Array, Metrics]:
    """Scalar loss and per-batch scalar metrics (accuracies, per-objective losses).

    Weighted terms divide by `weight_totals[<name>_weights]` (default: this batch's sums), so that
    gradient accumulation can normalise every microbatch by the whole batch's weights.
    """


def weight_totals(batch: Batch) -> Dict[str, jax.Array]:
  """The sum of every `*_weights` feature: the denominators of the weighted losses."""
  return {k: v.astype(jnp.float32).sum() for k, v in batch.items() if k.endswith("_weights")}


@jax.custom_vjp
def token_cross_entropy(logits, targets):
  """-log softmax(logits)[target] per position, in fp32 whatever the logits' dtype.

  optax's integer-label cross-entropy takes the target's logit with take_along_axis, whose gradient scatters
  into a zeroed fp32 array of the logits' shape; the softmax's gradient then reads it and the sum is cast back
  to the logits' dtype: three passes over [positions, vocab] in the backward pass. Here the target's logit is
  a select against the vocabulary's iota, which XLA fuses into the reductions over the logits, and the
  gradient, softmax - one_hot, is written in one pass from the logits and their log-normalisers. BART-large at
  16 x 512 positions over 50,265 tokens: 1.5 GB less kept on a GPU and 4% off its planned H200 step.
  """
  return _cross_entropy_forward(logits, targets)[0]


def _cross_entropy_forward(logits, targets):
  upcast = logits.astype(jnp.float32)
  normalisers = jax.nn.logsumexp(upcast, axis=-1)
  label_logits = jnp.where(jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.bool_), upcast, 0.0).sum(-1)
  return normalisers - label_logits, (logits, targets, normalisers)


def _cross_entropy_backward(residuals, upstream):
  logits, targets, normalisers = residuals
  probabilities = jnp.exp(logits.astype(jnp.float32) - normalisers[..., None])
  gradient = (probabilities - jax.nn.one_hot(targets, logits.shape[-1])) * upstream[..., None]
  return gradient.astype(logits.dtype), None


token_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def weighted_cross_entropy(logits, targets, weights, total=None):
  """Token cross-entropy and accuracy summed over weighted positions, divided by `total`
  (default: the sum of `weights`, i.e. the mean over predicted positions)."""
  weights = weights.astype(jnp.float32)
  losses = token_cross_entropy(logits, targets)
  denominator = jnp.maximum(weights.sum() if total is None else total, 1e-9)  # no weights: loss 0, not NaN
  loss = (losses * weights).sum() / denominator
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum() / denominator
  return loss, accuracy
