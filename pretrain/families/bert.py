"""BERT family: masked LM at gathered positions plus next-sentence prediction."""
import dataclasses

import jax
import jax.numpy as jnp
import optax

from models.bert import BertConfig, BertForPreTraining
from pretrain.families.base import Family, weighted_cross_entropy


def mlm_and_sentence_features(batch_size, feature_lengths, sentence_label: str):
  """Feature shapes shared by BERT (NSP) and ALBERT (SOP)."""
  length, predictions = feature_lengths["input_ids"], feature_lengths["masked_positions"]
  i32 = jnp.int32
  return {
      "input_ids": jax.ShapeDtypeStruct((batch_size, length), i32),
      "segment_ids": jax.ShapeDtypeStruct((batch_size, length), i32),
      "masked_positions": jax.ShapeDtypeStruct((batch_size, predictions), i32),
      "masked_ids": jax.ShapeDtypeStruct((batch_size, predictions), i32),
      "masked_weights": jax.ShapeDtypeStruct((batch_size, predictions), jnp.float32),
      sentence_label: jax.ShapeDtypeStruct((batch_size,), i32),
  }


def mlm_and_sentence_loss(outputs, batch, weight_totals, sentence_label: str, sentence_logits: str):
  """MLM cross-entropy plus the sentence-pair task's cross-entropy, unweighted sum as in the reference."""
  total = (weight_totals or {}).get("masked_weights")
  mlm_loss, mlm_accuracy = weighted_cross_entropy(outputs["mlm_logits"], batch["masked_ids"], batch["masked_weights"],
                                                  total)
  logits = outputs[sentence_logits]
  labels = batch[sentence_label]
  pair_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  pair_accuracy = (jnp.argmax(logits, -1) == labels).mean()
  name = sentence_label.removesuffix("_label")
  return mlm_loss + pair_loss, {"mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy,
                                f"{name}_loss": pair_loss, f"{name}_accuracy": pair_accuracy}


@dataclasses.dataclass(frozen=True)
class BertFamily(Family):
  config: BertConfig = BertConfig()
  name: str = "bert"

  def make_model(self):
    return BertForPreTraining(self.config)

  def feature_shapes(self, batch_size, feature_lengths):
    return mlm_and_sentence_features(batch_size, feature_lengths, "nsp_label")

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    return mlm_and_sentence_loss(outputs, batch, weight_totals, "nsp_label", "nsp_logits")
