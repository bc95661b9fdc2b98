"""ALBERT family: masked LM at gathered positions plus sentence-order prediction."""
import dataclasses

from models.albert import AlbertConfig, AlbertForPreTraining
from pretrain.families.base import Family
from pretrain.families.bert import mlm_and_sentence_loss


@dataclasses.dataclass(frozen=True)
class AlbertFamily(Family):
  config: AlbertConfig = AlbertConfig()
  name: str = "albert"
  objectives: tuple = ("albert_mlm_sop",)
  layer_count_fields: tuple = ("num_layers",)

  def make_model(self):
    return AlbertForPreTraining(self.config)

  def loss_and_metrics(self, outputs, batch, weight_totals=None):
    return mlm_and_sentence_loss(outputs, batch, weight_totals, "sop")
