"""The model families by name: one table that export, import and their tests share.

A row names a family's trainer adapter, its model config, the module that maps its weights to
HuggingFace (`pretrain/hf_mappings/<name>.py`: HF_CLASS, rules, hf_config, config_from_hf), how an
exported tokenizer frames text (the layout the family was pretrained on), and a small batch on which
our model and the transformers one must agree. Adding a family adds a row.
"""
import dataclasses
from types import ModuleType
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import flax
import flax.linen as nn
import jax
import numpy as np

from data_pipelines.pieces import FIRST_NORMAL_ID  # ids below are special pieces: check batches avoid them
from models.albert import AlbertConfig
from models.bart import BartConfig
from models.bert import BertConfig
from models.xlnet import XLNetConfig
from pretrain.errors import ConfigError
from pretrain.families.albert import AlbertFamily
from pretrain.families.bart import BartFamily
from pretrain.families.bert import BertFamily
from pretrain.families.xlnet import XLNetFamily
from pretrain.hf_mappings import albert as albert_mapping
from pretrain.hf_mappings import bart as bart_mapping
from pretrain.hf_mappings import bert as bert_mapping
from pretrain.hf_mappings import xlnet as xlnet_mapping


@dataclasses.dataclass(frozen=True)
class CheckBatch:
  """One forward pass of both models, and which outputs must agree at which positions."""
  features: Dict[str, np.ndarray]  # our model's input features
  hf_inputs: Dict[str, np.ndarray]  # keyword arguments of the transformers model
  outputs: Tuple[Tuple[str, str, np.ndarray], ...]  # (our output key, HF output attribute, bool mask)


@dataclasses.dataclass(frozen=True)
class TokenizerLayout:
  """Special tokens added around text by default (tokenizers TemplateProcessing syntax)."""
  single: str
  pair: str
  padding_side: str = "right"
  input_names: Tuple[str, ...] = ("input_ids", "token_type_ids", "attention_mask")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
  """One row: everything export and import need to know about a family."""
  name: str
  family_cls: type
  config_cls: type
  mapping: ModuleType
  hf_model_type: str
  layout: TokenizerLayout
  check_batch: Callable[[object], CheckBatch]  # model config -> CheckBatch
  finetune_overrides: Tuple[Tuple[str, object], ...] = ()  # config fields exports set for fine-tuning

  @property
  def hf_class(self) -> str:
    return self.mapping.HF_CLASS

  def finetune_config(self, config):
    return dataclasses.replace(config, **dict(self.finetune_overrides))

  def param_shapes(self, config) -> Dict[str, tuple]:
    """{flax path: shape} of every parameter of the family's model with this config."""
    model = self.family_cls(config=config).make_model()
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), self.check_batch(config).features))
    flat = flax.traverse_util.flatten_dict(nn.unbox(abstract["params"]), sep="/")
    return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def _ids(rng, shape, vocab_size: int, lengths: Optional[Sequence[int]] = None) -> np.ndarray:
  """Random ordinary pieces; positions past each row's length are padding (0)."""
  ids = rng.integers(FIRST_NORMAL_ID, vocab_size, shape).astype(np.int32)
  if lengths is not None:
    ids[np.arange(shape[1])[None, :] >= np.asarray(lengths)[:, None]] = 0
  return ids


def _sentence_pair_check(sentence_output: str, hf_sentence_output: str):
  """BERT/ALBERT: MLM logits at real positions and the sentence-pair logits, second row padded."""
  def check_batch(config) -> CheckBatch:
    ids = _ids(np.random.default_rng(0), (2, 16), config.vocab_size, lengths=(16, 11))
    segments = np.zeros_like(ids)
    segments[:, 8:] = 1
    real = ids > 0
    return CheckBatch(
        features={"input_ids": ids, "segment_ids": segments},
        hf_inputs={"input_ids": ids, "token_type_ids": segments, "attention_mask": real.astype(np.int32)},
        outputs=(("mlm_logits", "prediction_logits", real),
                 (sentence_output, hf_sentence_output, np.ones((2,), bool))))
  return check_batch


def _xlnet_check(config) -> CheckBatch:
  """Two-stream attention as in pretraining: 4 targets in a random factorisation order."""
  rng = np.random.default_rng(0)
  length, num_targets = 16, 4
  ids = _ids(rng, (2, length), config.vocab_size)
  segments = np.tile(np.array([0] * 8 + [1] * 7 + [2], np.int32), (2, 1))
  perm_mask = np.zeros((2, length, length), np.float32)
  target_mapping = np.zeros((2, num_targets, length), np.float32)
  for row in range(2):
    targets = np.sort(rng.choice(length - 1, num_targets, replace=False))
    order = np.full(length, -1)
    order[targets] = rng.permutation(num_targets)
    # i may not see j if j is a target no earlier than i in the order (non-targets see no target).
    perm_mask[row] = (order[:, None] <= order[None, :]) & (order[None, :] >= 0)
    target_mapping[row, np.arange(num_targets), targets] = 1.0
  features = {"input_ids": ids, "segment_ids": segments, "perm_mask": perm_mask, "target_mapping": target_mapping}
  hf_inputs = {"input_ids": ids, "token_type_ids": segments, "perm_mask": perm_mask, "target_mapping": target_mapping}
  return CheckBatch(features, hf_inputs, (("logits", "logits", np.ones((2, num_targets), bool)),))


def _bart_check(config) -> CheckBatch:
  """Teacher-forced decoding from </s> (fairseq's start), second encoder row padded."""
  rng = np.random.default_rng(0)
  encoder_ids = _ids(rng, (2, 12), config.vocab_size, lengths=(12, 8))
  decoder_ids = _ids(rng, (2, 10), config.vocab_size)
  decoder_ids[:, 0] = bart_mapping.EOS_ID
  hf_inputs = {"input_ids": encoder_ids, "attention_mask": (encoder_ids > 0).astype(np.int32),
               "decoder_input_ids": decoder_ids}
  return CheckBatch({"encoder_input_ids": encoder_ids, "decoder_input_ids": decoder_ids}, hf_inputs,
                    (("logits", "logits", np.ones(decoder_ids.shape, bool)),))


# BERT and ALBERT are pretrained on [CLS] A [SEP] B [SEP]; XLNet on A [SEP] B [SEP] [CLS] with segment
# id 2 for [CLS] and left padding (its classifier reads the last position); BART's encoder input is
# <s> text </s>, as fairseq's.
_CLS_SEP = TokenizerLayout("[CLS]:0 $A:0 [SEP]:0", "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1")
FAMILIES: Mapping[str, FamilySpec] = {spec.name: spec for spec in (
    FamilySpec("bert", BertFamily, BertConfig, bert_mapping, "bert", _CLS_SEP,
               _sentence_pair_check("nsp_logits", "seq_relationship_logits")),
    FamilySpec("albert", AlbertFamily, AlbertConfig, albert_mapping, "albert", _CLS_SEP,
               _sentence_pair_check("sop_logits", "sop_logits")),
    # bi_data reads half of every batch backwards (pretraining only) and needs even batches.
    FamilySpec("xlnet", XLNetFamily, XLNetConfig, xlnet_mapping, "xlnet",
               TokenizerLayout("$A:0 [SEP]:0 [CLS]:2", "$A:0 [SEP]:0 $B:1 [SEP]:1 [CLS]:2", padding_side="left"),
               _xlnet_check, finetune_overrides=(("bi_data", False),)),
    FamilySpec("bart", BartFamily, BartConfig, bart_mapping, "bart",
               TokenizerLayout("<s>:0 $A:0 </s>:0", "<s>:0 $A:0 </s>:0 </s>:0 $B:0 </s>:0",
                               input_names=("input_ids", "attention_mask")), _bart_check),
)}


def get(name: str) -> FamilySpec:
  if name not in FAMILIES:
    raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
  return FAMILIES[name]


def from_hf_config(hf_config: Mapping) -> FamilySpec:
  """The family of a HuggingFace config.json, by model_type, else by architectures."""
  model_type, architectures = hf_config.get("model_type"), hf_config.get("architectures") or []
  for spec in FAMILIES.values():
    if model_type == spec.hf_model_type or spec.hf_class in architectures:
      return spec
  raise ConfigError(f"config.json model_type={model_type!r}, architectures={architectures}: not one of "
                    f"{sorted(spec.hf_model_type for spec in FAMILIES.values())}")
