"""BART <-> transformers `BartForConditionalGeneration`.

HF ties `lm_head.weight`, `model.encoder.embed_tokens.weight` and `model.decoder.embed_tokens.weight`
to `model.shared.weight`; only the latter is listed here, so a strict=False load reports exactly those
three keys as missing. Special ids follow data_pipelines/vocab.py (pad 0, not HF BART's 1).
"""
import dataclasses

import numpy as np

from data_pipelines.pieces import BOS_ID, EOS_ID, PAD_ID
from models.bart import BartConfig
from pretrain.errors import ConfigError
from pretrain.hf_mappings.common import Linear, Rule, Same, dense_rules, norm_rules

HF_CLASS = "BartForConditionalGeneration"
HF_LAYER_NORM_EPS = 1e-5  # HF BART's LayerNorms use torch's default epsilon, not a config value


@dataclasses.dataclass(frozen=True)
class LeadingAxis:
  """A [n] Flax vector that HF stores as [1, n] (final_logits_bias)."""

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    return value[None]

  def from_hf(self, value: np.ndarray, shape) -> np.ndarray:
    return value.reshape(shape)


def attention_rules(flax_prefix: str, hf_prefix: str, hf_norm: str) -> list:
  """A `layers.PostLNAttentionBlock` against a BartAttention and the LayerNorm after it."""
  out = []
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
    out += [Rule(f"{flax_prefix}/attention/{ours}/kernel", f"{hf_prefix}.{theirs}.weight", Linear(1)),
            Rule(f"{flax_prefix}/attention/{ours}/bias", f"{hf_prefix}.{theirs}.bias", Same(flatten=True))]
  return (out + dense_rules(f"{flax_prefix}/attention/output", f"{hf_prefix}.out_proj", num_in_dims=2)
          + norm_rules(f"{flax_prefix}/norm", hf_norm))


def ffn_rules(flax_prefix: str, hf_prefix: str) -> list:
  return (dense_rules(f"{flax_prefix}/mlp/intermediate", f"{hf_prefix}.fc1")
          + dense_rules(f"{flax_prefix}/mlp/output", f"{hf_prefix}.fc2")
          + norm_rules(f"{flax_prefix}/norm", f"{hf_prefix}.final_layer_norm"))


def stack_rules(side: str, num_layers: int) -> list:
  """Embedding positions/norm and layers of `encoder` or `decoder`."""
  hf = f"model.{side}"
  out = [Rule(f"{side}/embeddings/position/embedding", f"{hf}.embed_positions.weight")]
  out += norm_rules(f"{side}/embeddings/norm", f"{hf}.layernorm_embedding")
  for i in range(num_layers):
    ours, theirs = f"{side}/layer_{i}", f"{hf}.layers.{i}"
    out += attention_rules(f"{ours}/attention", f"{theirs}.self_attn", f"{theirs}.self_attn_layer_norm")
    if side == "decoder":
      out += attention_rules(f"{ours}/cross_attention", f"{theirs}.encoder_attn", f"{theirs}.encoder_attn_layer_norm")
    out += ffn_rules(f"{ours}/ffn", theirs)
  return out


def rules(config: BartConfig) -> list:
  return ([Rule("shared/embedding", "model.shared.weight"),
           Rule("final_logits_bias/bias", "final_logits_bias", LeadingAxis())]
          + stack_rules("encoder", config.encoder_layers) + stack_rules("decoder", config.decoder_layers))


def hf_config(config: BartConfig) -> dict:
  if config.layer_norm_eps != HF_LAYER_NORM_EPS:
    raise ConfigError(f"layer_norm_eps={config.layer_norm_eps}: HuggingFace BART fixes it at {HF_LAYER_NORM_EPS}")
  return dict(
      model_type="bart", architectures=[HF_CLASS], vocab_size=config.vocab_size, d_model=config.d_model,
      encoder_layers=config.encoder_layers, decoder_layers=config.decoder_layers,
      encoder_attention_heads=config.num_heads, decoder_attention_heads=config.num_heads,
      encoder_ffn_dim=config.ffn_dim, decoder_ffn_dim=config.ffn_dim,
      max_position_embeddings=config.max_position_embeddings, dropout=config.dropout_rate,
      attention_dropout=config.attention_dropout, activation_dropout=config.activation_dropout,
      activation_function="gelu", scale_embedding=config.scale_embedding,
      pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, forced_eos_token_id=EOS_ID,
      decoder_start_token_id=EOS_ID,  # fairseq starts the decoder with </s>
      tie_word_embeddings=True)


def config_from_hf(hf: dict) -> BartConfig:
  for ours, (encoder_key, decoder_key) in {"num_heads": ("encoder_attention_heads", "decoder_attention_heads"),
                                           "ffn_dim": ("encoder_ffn_dim", "decoder_ffn_dim")}.items():
    if hf[encoder_key] != hf[decoder_key]:
      raise ConfigError(f"{encoder_key}={hf[encoder_key]} differs from {decoder_key}={hf[decoder_key]}: "
                        f"BartConfig has one {ours}")
  if hf.get("activation_function", "gelu") != "gelu":
    raise ConfigError(f"activation_function={hf['activation_function']!r}: only 'gelu' is supported")
  return BartConfig(
      vocab_size=hf["vocab_size"], d_model=hf["d_model"], encoder_layers=hf["encoder_layers"],
      decoder_layers=hf["decoder_layers"], num_heads=hf["encoder_attention_heads"], ffn_dim=hf["encoder_ffn_dim"],
      max_position_embeddings=hf["max_position_embeddings"], dropout_rate=hf["dropout"],
      attention_dropout=hf["attention_dropout"], activation_dropout=hf["activation_dropout"],
      layer_norm_eps=HF_LAYER_NORM_EPS, scale_embedding=hf.get("scale_embedding", False))
