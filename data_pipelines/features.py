"""The features each objective emits, stated once: names, shapes in terms of the run's lengths, dtypes.

TASK_FEATURE_LENGTHS names the lengths (the keys of `Schema.lengths`); every feature's shape is
made of them. The tasks' objectives emit these features, the feature converter checks them, the
model families shape their batches from them and `data_pipelines.preview` shows them. A length need
not belong to a feature: XLNet's `reuse_len` is how many tokens of each window continue the
previous one (the model caches exactly that many). Imports no TensorFlow.
"""
import dataclasses
from typing import Dict, Mapping, Tuple

import numpy as np

INPUT_TOKENS, TARGET_TOKENS = "input tokens", "target tokens"  # features that hold vocabulary ids


@dataclasses.dataclass(frozen=True)
class Feature:
  dims: Tuple[str, ...]  # the length (a TASK_FEATURE_LENGTHS key) of each dimension; () for a scalar
  dtype: str = "int32"
  tokens: str = ""  # INPUT_TOKENS (the task's seqio output features), TARGET_TOKENS, or neither


@dataclasses.dataclass(frozen=True)
class Schema:
  lengths: Tuple[str, ...]  # the keys TASK_FEATURE_LENGTHS must have
  features: Mapping[str, Feature]
  default_lengths: Mapping[str, int]  # small lengths for looking at examples
  # Features the objective also emits for people and tests, which no model reads (the batch drops them).
  diagnostics: Tuple[str, ...] = ()

  def check_lengths(self, objective: str, lengths: Mapping[str, int]) -> None:
    if set(lengths) != set(self.lengths):
      raise ValueError(f"TASK_FEATURE_LENGTHS={dict(lengths)}: the {objective} objective takes the lengths "
                       f"{list(self.lengths)}")

  def token_features(self, kind: str) -> Tuple[str, ...]:
    return tuple(name for name, f in self.features.items() if f.tokens == kind)

  def shapes(self, lengths: Mapping[str, int]) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """name -> (per-example shape, dtype)."""
    return {name: (tuple(lengths[d] for d in f.dims), np.dtype(f.dtype)) for name, f in self.features.items()}


def _sentence_pair_mlm(label: str) -> Schema:
  return Schema(
      lengths=("input_ids", "masked_positions"),
      features={"input_ids": Feature(("input_ids",), tokens=INPUT_TOKENS), "segment_ids": Feature(("input_ids",)),
                "masked_positions": Feature(("masked_positions",)),
                "masked_ids": Feature(("masked_positions",), tokens=TARGET_TOKENS),
                "masked_weights": Feature(("masked_positions",), "float32"), label: Feature(())},
      default_lengths={"input_ids": 128, "masked_positions": 20})


def _encoder_decoder(default_decoder_length: int) -> Schema:
  return Schema(
      lengths=("encoder_input_ids", "decoder_input_ids"),
      features={"encoder_input_ids": Feature(("encoder_input_ids",), tokens=INPUT_TOKENS),
                "decoder_input_ids": Feature(("decoder_input_ids",), tokens=INPUT_TOKENS),
                "decoder_target_ids": Feature(("decoder_input_ids",), tokens=TARGET_TOKENS),
                "decoder_weights": Feature(("decoder_input_ids",), "float32")},
      default_lengths={"encoder_input_ids": 128, "decoder_input_ids": default_decoder_length})


_PERMUTATION_LM = Schema(
    lengths=("input_ids", "target_ids", "reuse_len"),
    features={"input_ids": Feature(("input_ids",), tokens=INPUT_TOKENS), "segment_ids": Feature(("input_ids",)),
              "perm_mask": Feature(("input_ids", "input_ids"), "float32"),
              "target_mapping": Feature(("target_ids", "input_ids"), "float32"),
              "target_ids": Feature(("target_ids",), tokens=TARGET_TOKENS),
              "target_weights": Feature(("target_ids",), "float32")},
    default_lengths={"input_ids": 128, "target_ids": 21, "reuse_len": 64},
    diagnostics=("input_q",))  # the reference's name: 1.0 at the target positions

SCHEMAS: Mapping[str, Schema] = {
    "bert_mlm_nsp": _sentence_pair_mlm("nsp_label"),
    "albert_mlm_sop": _sentence_pair_mlm("sop_label"),
    "bart_denoising": _encoder_decoder(128),
    "t5_span_corruption": _encoder_decoder(32),
    "xlnet_plm": _PERMUTATION_LM,
}


def schema(objective: str) -> Schema:
  if objective not in SCHEMAS:
    raise ValueError(f"objective={objective!r}: expected one of {sorted(SCHEMAS)}")
  return SCHEMAS[objective]
