"""BERT family: masked LM at gathered positions plus next-sentence prediction."""
import dataclasses

import jax.numpy as jnp
import optax

from models.bert import BertConfig, BertForPreTraining
from pretrain.families.base import Family, weighted_cross_entropy


def mlm_and_sentence_loss(outputs, batch, weight_totals, pair_task: str):
  """MLM cross-entropy plus the sentence-pair task's (`nsp` or `sop`) cross-entropy, an unweighted sum
  as in the reference."""
  total = (weight_totals or {}).get("masked_weights")
  mlm_loss, mlm_accuracy = weighted_cross_entropy(outputs["mlm_logits"], batch["masked_ids"], batch["masked_weights"],
                                                  total)
  logits = outputs[f"{pair_task}_logits"]
  labels = batch[f"{pair_task}_label"]
  pair_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  pair_accuracy = (jnp.argmax(logits, -1) == labels).mean()
  return mlm_loss + pair_loss, {"mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy,
                                f"{pair_task}_loss": pair_loss, f"{pair_task}_accuracy": pair_accuracy}


@dataclasses.dataclass(frozen=True)
class BertFamily(Family):
  config: BertConfig = BertConfig()
  name: str = "bert"
  objectives: tuple = ("bert_mlm_nsp",)
  layer_count_fields: tuple = ("num_layers",)

  def make_model(self):
    return BertForPreTraining(self.config)

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    return mlm_and_sentence_loss(outputs, batch, weight_totals, "nsp")
