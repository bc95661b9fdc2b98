"""The small interface through which the trainer knows a model family.

A family says which Flax module to build, which features a batch carries (names, shapes, dtypes),
what state it carries from one step to the next (XLNet's memory; nothing for the others), and how
model outputs and a batch become a loss and metrics. The trainer's core never names a family.
"""
import abc
import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

Batch = Mapping[str, jax.Array]
Metrics = Dict[str, jax.Array]


class Family(abc.ABC):
  """Subclasses hold their model config in `self.config` (a frozen dataclass with `vocab_size`)."""

  name: str
  config: Any

  def with_vocab_size(self, vocab_size: int) -> "Family":
    """Fits the model to the run's vocabulary: fills an unset size, rejects one too small."""
    size = self.config.vocab_size
    if size is None:
      return dataclasses.replace(self, config=dataclasses.replace(self.config, vocab_size=vocab_size))
    if size < vocab_size:
      raise ValueError(f"{self.name} vocab_size={size} is smaller than the vocabulary ({vocab_size} pieces)")
    return self

  @abc.abstractmethod
  def make_model(self) -> nn.Module:
    """The Flax module; `module.apply(variables, features, deterministic=..., **carry)`."""

  @abc.abstractmethod
  def feature_shapes(self, batch_size: int, feature_lengths: Mapping[str, int]) -> Dict[str, jax.ShapeDtypeStruct]:
    """Every feature of a batch as the feature converter emits it."""

  def initial_carry(self, batch_size: int) -> Dict[str, jax.Array]:
    """State carried across steps (e.g. XLNet memory). Empty for stateless families."""
    del batch_size
    return {}

  def data_shards(self, batch_size: int) -> Optional[int]:
    """Families whose rows carry state across steps read one data shard per row, so that the state
    carried for a row continues that row's text; the others leave it to DATA_SHARDS (None)."""
    return batch_size if self.carry_axes() else None

  def reverse_odd_rows(self) -> bool:
    """Whether odd batch rows read the reversed text of the row before (XLNet's bi_data)."""
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


def weighted_cross_entropy(logits, targets, weights, total=None):
  """Token cross-entropy and accuracy summed over weighted positions, divided by `total`
  (default: the sum of `weights`, i.e. the mean over predicted positions)."""
  weights = weights.astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  denominator = jnp.maximum(weights.sum() if total is None else total, 1e-9)  # no weights: loss 0, not NaN
  loss = (losses * weights).sum() / denominator
  accuracy = ((jnp.argmax(logits, -1) == targets) * weights).sum() / denominator
  return loss, accuracy
