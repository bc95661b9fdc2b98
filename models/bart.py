"""BART (Lewis et al. 2019): a post-LN Transformer encoder-decoder trained to reconstruct corrupted text.

As in fairseq: one token embedding shared by encoder, decoder and the output layer (plus a
`final_logits_bias`), learned positions whose table starts 2 rows in, LayerNorm on the embeddings,
GELU, and no final LayerNorm after the stacks.

Padding: this framework's vocabulary has pad id 0 (fairseq/HF BART use 1), so encoder keys are
masked where encoder_input_ids == 0. The decoder uses the causal mask alone: its padding is
trailing, so no real position can attend to it, and the decoder start id may itself be 0.
"""
import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from models import layers

POSITION_OFFSET = 2  # fairseq reserves the first rows of the position table for its padding scheme


@dataclasses.dataclass(frozen=True)
class BartConfig:
  vocab_size: Optional[int] = 32000  # None: the run's vocabulary size
  d_model: int = 768
  encoder_layers: int = 6
  decoder_layers: int = 6
  num_heads: int = 12
  ffn_dim: int = 3072
  max_position_embeddings: int = 1024
  dropout_rate: float = 0.1
  attention_dropout: float = 0.0
  activation_dropout: float = 0.0
  layer_norm_eps: float = 1e-5
  scale_embedding: bool = False  # multiply token embeddings by sqrt(d_model)
  dtype: Any = jnp.float32  # compute dtype; parameters are always fp32
  remat_policy: str = "none"
  scan_layers: bool = False  # one nn.scan per stack (see layers.layer_stack)
  attention_implementation: str = "auto"  # layers.ATTENTION_IMPLEMENTATIONS; 'auto': the chip's fastest exact one
  dropout_masks: str = "auto"  # dropout.DROPOUT_MASKS; 'auto': the chip's cheaper one
  gelu_gradient: str = "formula"  # layers.GELU_GRADIENTS: what the GELU's backward pass keeps

  def __post_init__(self):
    layers.check_at_least(1, vocab_size=self.vocab_size, d_model=self.d_model, encoder_layers=self.encoder_layers,
                          decoder_layers=self.decoder_layers, ffn_dim=self.ffn_dim,
                          max_position_embeddings=self.max_position_embeddings)
    layers.check_fractions(dropout_rate=self.dropout_rate, attention_dropout=self.attention_dropout,
                           activation_dropout=self.activation_dropout)
    layers.check_heads_divide("d_model", self.d_model, self.num_heads)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


class BartEmbeddings(nn.Module):
  """Shared token embedding (optionally scaled) + learned positions, then LayerNorm and dropout."""
  config: BartConfig

  @nn.compact
  def __call__(self, ids, shared: nn.Embed, deterministic: bool):
    cfg = self.config
    length = ids.shape[1]
    layers.check_sequence_length(length, cfg.max_position_embeddings)
    position = layers.embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.d_model, ("position", "embed"),
                                cfg.dtype, "position")
    scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
    x = shared(ids) * scale + position(jnp.arange(length)[None, :] + POSITION_OFFSET)
    x = layers.layer_norm(cfg.layer_norm_eps, cfg.dtype, "norm")(x)
    x = layers.Dropout(cfg.dropout_rate, cfg.dropout_masks)(x, deterministic=deterministic)
    return layers.constrain(x, layers.BATCH_LENGTH_EMBED)


def attention_block(cfg: BartConfig, name: str) -> layers.PostLNAttentionBlock:
  return layers.PostLNAttentionBlock(cfg.num_heads, cfg.head_dim, cfg.dropout_rate, cfg.attention_dropout,
                                     cfg.layer_norm_eps, cfg.dtype, cfg.attention_implementation, cfg.dropout_masks,
                                     name=name)


def ffn_block(cfg: BartConfig) -> layers.PostLNFeedForwardBlock:
  return layers.PostLNFeedForwardBlock(cfg.ffn_dim, cfg.dropout_rate, cfg.activation_dropout, cfg.layer_norm_eps,
                                       cfg.dtype, dropout_masks=cfg.dropout_masks, gelu_gradient=cfg.gelu_gradient,
                                       name="ffn")


class BartDecoderLayer(nn.Module):
  config: BartConfig

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask, deterministic: bool):
    x = attention_block(self.config, "attention")(x, x, self_mask, deterministic)  # named as in the encoder
    x = attention_block(self.config, "cross_attention")(x, encoded, cross_mask, deterministic)
    return ffn_block(self.config)(x, deterministic), None


class BartEncoder(nn.Module):
  config: BartConfig

  @nn.compact
  def __call__(self, ids, shared: nn.Embed, deterministic: bool):
    cfg = self.config
    x = BartEmbeddings(cfg, name="embeddings")(ids, shared, deterministic)
    mask = layers.AttentionMask(query_valid=ids > 0, key_valid=ids > 0)
    x, _ = layers.layer_stack(
        layers.PostLNEncoderLayer, cfg.encoder_layers, x, mask, deterministic=deterministic, scan=cfg.scan_layers,
        remat_policy=cfg.remat_policy, num_heads=cfg.num_heads, head_dim=cfg.head_dim, mlp_dim=cfg.ffn_dim,
        dropout_rate=cfg.dropout_rate, layer_norm_eps=cfg.layer_norm_eps, dtype=cfg.dtype,
        attention_dropout_rate=cfg.attention_dropout, activation_dropout_rate=cfg.activation_dropout,
        attention_implementation=cfg.attention_implementation, dropout_masks=cfg.dropout_masks,
        gelu_gradient=cfg.gelu_gradient)
    return x


class BartDecoder(nn.Module):
  config: BartConfig

  @nn.compact
  def __call__(self, ids, encoded, encoder_ids, shared: nn.Embed, deterministic: bool):
    cfg = self.config
    x = BartEmbeddings(cfg, name="embeddings")(ids, shared, deterministic)
    # The decoder's rows are whole (its padding comes last and is never attended to by a real position).
    self_mask, cross_mask = layers.AttentionMask(causal=True), layers.AttentionMask(key_valid=encoder_ids > 0)
    x, _ = layers.layer_stack(BartDecoderLayer, cfg.decoder_layers, x, encoded, self_mask, cross_mask,
                              deterministic=deterministic, scan=cfg.scan_layers, remat_policy=cfg.remat_policy,
                              config=cfg)
    return x


class BartForConditionalGeneration(nn.Module):
  """Inputs: encoder_input_ids [b, l_enc], decoder_input_ids [b, l_dec] (targets shifted right).

  Returns logits [b, l_dec, vocab] (fp32) for the next target token at every decoder position.
  """
  config: BartConfig

  @nn.compact
  def __call__(self, features, deterministic: bool = True):
    cfg = self.config
    encoder_ids, decoder_ids = features["encoder_input_ids"], features["decoder_input_ids"]
    shared = layers.embedding(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), cfg.dtype, "shared")
    encoded = BartEncoder(cfg, name="encoder")(encoder_ids, shared, deterministic)
    hidden = BartDecoder(cfg, name="decoder")(decoder_ids, encoded, encoder_ids, shared, deterministic)
    logits = layers.TiedLMBias(cfg.vocab_size, name="final_logits_bias")(shared.attend(hidden))
    return {"logits": layers.constrain(logits, layers.BATCH_LENGTH_VOCAB).astype(jnp.float32)}
