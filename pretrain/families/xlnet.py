"""XLNet family: permutation LM on the query stream at target_mapping positions, with memory carried across steps."""
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from models.xlnet import (ATTENTION_IMPLEMENTATIONS, MEMORY_AXES, PROBS_KEPT, XLNetConfig, XLNetLMHeadModel,
                          probs_kept_for_device)
from pretrain.errors import ConfigError
from pretrain.families.base import DEVICE_CHOICES, Family, weighted_cross_entropy


@dataclasses.dataclass(frozen=True)
class XLNetFamily(Family):
  config: XLNetConfig = XLNetConfig()
  name: str = "xlnet"
  objectives: tuple = ("xlnet_plm",)
  layer_count_fields: tuple = ("n_layer",)
  # Its relative attention: XLA's on every chip until the Triton kernel with a bias is measured on a GPU.
  device_choices: ClassVar[dict] = {**DEVICE_CHOICES,
                                    "attention_implementation": (ATTENTION_IMPLEMENTATIONS, lambda device: "xla"),
                                    "attention_probs_kept": (PROBS_KEPT, probs_kept_for_device)}

  def make_model(self):
    return XLNetLMHeadModel(self.config)

  def _fit_lengths(self, feature_lengths):
    """The model caches exactly the tokens each data window shares with the next: the data's reuse_len."""
    reuse_len = feature_lengths["reuse_len"]
    if self.config.reuse_len not in (None, reuse_len):
      raise ConfigError(f"xlnet.XLNetConfig.reuse_len={self.config.reuse_len} differs from the data's "
                        f"TASK_FEATURE_LENGTHS reuse_len={reuse_len}: the model must cache the tokens the next window "
                        "continues; set only REUSE_LEN (TASK_FEATURE_LENGTHS)")
    return dataclasses.replace(self, config=dataclasses.replace(self.config, reuse_len=reuse_len))

  def example_rows(self):
    return 2 if self.config.bi_data else 1  # a forward and a backward row

  def check_microbatch_rows(self, rows):
    if self.config.bi_data and rows % 2:
      raise ConfigError(f"bi_data pairs forward and backward rows, but the batch gives {rows} rows per data-parallel "
                        "group per microbatch: make it even (BATCH_SIZE, MICROBATCHES)")

  def initial_carry(self, batch_size):
    # Batch leads, as in every carry: the trainer splits carries by rows for gradient accumulation.
    cfg = self.config
    return {"mems": jnp.zeros((batch_size, cfg.n_layer, cfg.mem_len, cfg.d_model), cfg.dtype)}

  def bi_data(self):
    return self.config.bi_data

  def carry_axes(self):
    return {"mems": MEMORY_AXES}

  def forward(self, model, params, batch, carry, *, rngs, deterministic):
    outputs = model.apply({"params": params}, batch, deterministic=deterministic, rngs=rngs, mems=carry["mems"])
    return {"logits": outputs["logits"]}, {"mems": outputs["new_mems"]}

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    loss, accuracy = weighted_cross_entropy(outputs["logits"], batch["target_ids"], batch["target_weights"],
                                            (weight_totals or {}).get("target_weights"))
    return loss, {"plm_loss": loss, "plm_accuracy": accuracy}
