"""XLNet family: permutation LM on the query stream at target_mapping positions, with memory carried across steps."""
import dataclasses

import jax
import jax.numpy as jnp

from models.xlnet import MEMORY_AXES, XLNetConfig, XLNetLMHeadModel
from pretrain.families.base import Family, weighted_cross_entropy


@dataclasses.dataclass(frozen=True)
class XLNetFamily(Family):
  config: XLNetConfig = XLNetConfig()
  name: str = "xlnet"

  def make_model(self):
    return XLNetLMHeadModel(self.config)

  def feature_shapes(self, batch_size, feature_lengths):
    length, predictions = feature_lengths["input_ids"], feature_lengths["target_ids"]
    i32, f32 = jnp.int32, jnp.float32
    return {
        "input_ids": jax.ShapeDtypeStruct((batch_size, length), i32),
        "segment_ids": jax.ShapeDtypeStruct((batch_size, length), i32),
        "perm_mask": jax.ShapeDtypeStruct((batch_size, length, length), f32),
        "target_mapping": jax.ShapeDtypeStruct((batch_size, predictions, length), f32),
        "target_ids": jax.ShapeDtypeStruct((batch_size, predictions), i32),
        "target_weights": jax.ShapeDtypeStruct((batch_size, predictions), f32),
    }

  def initial_carry(self, batch_size):
    # Batch leads, as in every carry: the trainer splits carries by rows for gradient accumulation.
    cfg = self.config
    return {"mems": jnp.zeros((batch_size, cfg.n_layer, cfg.mem_len, cfg.d_model), jnp.float32)}

  def reverse_odd_rows(self):
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
