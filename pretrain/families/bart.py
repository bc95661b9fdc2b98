"""BART family: reconstruct the original text from its corrupted version (teacher-forced decoder)."""
import dataclasses

import jax
import jax.numpy as jnp

from models.bart import BartConfig, BartForConditionalGeneration
from pretrain.families.base import Family, weighted_cross_entropy


@dataclasses.dataclass(frozen=True)
class BartFamily(Family):
  config: BartConfig = BartConfig()
  name: str = "bart"

  def make_model(self):
    return BartForConditionalGeneration(self.config)

  def feature_shapes(self, batch_size, feature_lengths):
    encoder = (batch_size, feature_lengths["encoder_input_ids"])
    decoder = (batch_size, feature_lengths["decoder_input_ids"])
    return {
        "encoder_input_ids": jax.ShapeDtypeStruct(encoder, jnp.int32),
        "decoder_input_ids": jax.ShapeDtypeStruct(decoder, jnp.int32),
        "decoder_target_ids": jax.ShapeDtypeStruct(decoder, jnp.int32),
        "decoder_weights": jax.ShapeDtypeStruct(decoder, jnp.float32),
    }

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    loss, accuracy = weighted_cross_entropy(outputs["logits"], batch["decoder_target_ids"], batch["decoder_weights"],
                                            (weight_totals or {}).get("decoder_weights"))
    return loss, {"denoising_loss": loss, "denoising_accuracy": accuracy}
