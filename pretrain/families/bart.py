"""BART family: reconstruct the original text from its corrupted version (teacher-forced decoder)."""
import dataclasses

from models.bart import BartConfig, BartForConditionalGeneration
from pretrain.families.base import Family, weighted_cross_entropy


@dataclasses.dataclass(frozen=True)
class BartFamily(Family):
  config: BartConfig = BartConfig()
  name: str = "bart"
  objectives: tuple = ("bart_denoising", "t5_span_corruption")
  layer_count_fields: tuple = ("encoder_layers", "decoder_layers")

  def make_model(self):
    return BartForConditionalGeneration(self.config)

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    loss, accuracy = weighted_cross_entropy(outputs["logits"], batch["decoder_target_ids"], batch["decoder_weights"],
                                            (weight_totals or {}).get("decoder_weights"))
    return loss, {"denoising_loss": loss, "denoising_accuracy": accuracy}
