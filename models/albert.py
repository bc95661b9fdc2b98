"""ALBERT (Lan et al. 2019): BERT with a factorized embedding, cross-layer sharing and SOP.

The word/position/token-type embeddings live in a small space E and are projected to the hidden
size H; the MLM head maps back to E and scores against the same (tied) word embedding.
"""
import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from models import layers
from models.bert import BertEmbeddings, EncoderForPreTraining

# Which sublayers one module serves for every layer ("all" is the paper's default; the others are
# its Table 4 ablations).
SHARE_MODES = ("all", "attention", "ffn", "none")
WHOLE_LAYER_SHARE_MODES = ("all", "none")  # a whole layer is the unit: these stacks may be scanned


@dataclasses.dataclass(frozen=True)
class AlbertConfig:
  vocab_size: Optional[int] = 30000  # None: the run's vocabulary size
  embedding_size: int = 128
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.0  # ALBERT pretrains without dropout
  attention_dropout: Optional[float] = None  # of the attention probabilities; None: dropout_rate, as the reference
  layer_norm_eps: float = 1e-12
  share: str = "all"
  approximate_gelu: bool = True  # google-research/albert's tanh GELU (HF "gelu_new")
  dtype: Any = jnp.float32  # compute dtype; parameters are always fp32
  remat_policy: str = "none"
  scan_layers: bool = False  # one nn.scan over the layers (see layers.layer_stack)
  attention_implementation: str = "auto"  # layers.ATTENTION_IMPLEMENTATIONS; 'auto': the chip's fastest exact one
  dropout_masks: str = "auto"  # dropout.DROPOUT_MASKS; 'auto': the chip's cheaper one
  gelu_gradient: str = "formula"  # layers.GELU_GRADIENTS: what the GELU's backward pass keeps

  def __post_init__(self):
    if self.share not in SHARE_MODES:
      raise ValueError(f"share={self.share!r}: expected one of {SHARE_MODES}")
    if self.scan_layers and self.share not in WHOLE_LAYER_SHARE_MODES:
      raise ValueError(f"scan_layers=True needs share in {WHOLE_LAYER_SHARE_MODES}, got share={self.share!r} "
                       "(sharing one sublayer mixes shared and per-layer weights in a layer)")
    layers.check_at_least(1, vocab_size=self.vocab_size, embedding_size=self.embedding_size,
                          hidden_size=self.hidden_size, num_layers=self.num_layers, mlp_dim=self.mlp_dim,
                          max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size)
    layers.check_fractions(dropout_rate=self.dropout_rate, attention_dropout=self.attention_dropout)
    layers.check_heads_divide("hidden_size", self.hidden_size, self.num_heads)

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def attention_dropout_rate(self) -> float:
    return self.dropout_rate if self.attention_dropout is None else self.attention_dropout


def attention_block(cfg: AlbertConfig, name: str, block_cls=layers.PostLNAttentionBlock) -> nn.Module:
  return block_cls(cfg.num_heads, cfg.head_dim, cfg.dropout_rate, cfg.attention_dropout_rate, cfg.layer_norm_eps,
                   cfg.dtype, cfg.attention_implementation, cfg.dropout_masks, name=name)


def ffn_block(cfg: AlbertConfig, name: str, block_cls=layers.PostLNFeedForwardBlock) -> nn.Module:
  return block_cls(cfg.mlp_dim, cfg.dropout_rate, 0.0, cfg.layer_norm_eps, cfg.dtype, cfg.approximate_gelu,
                   cfg.dropout_masks, cfg.gelu_gradient, name=name)


class AlbertEncoder(nn.Module):
  """Embeddings (E), projection E -> H and the layer stack; returns hidden states and the word embedding.

  share='all' applies one encoder layer (`shared_layer`) at every depth, 'none' one per depth; both
  may be scanned. The ablations that share a single sublayer build the stack from sublayers instead
  (`shared_attention` or `shared_ffn` plus `layer_<i>_ffn` or `layer_<i>_attention`), unrolled.
  """
  config: AlbertConfig

  @nn.compact
  def __call__(self, input_ids, segment_ids, deterministic: bool):
    cfg = self.config
    x, word = BertEmbeddings(cfg.vocab_size, cfg.embedding_size, cfg.max_position_embeddings, cfg.type_vocab_size,
                             cfg.dropout_rate, cfg.layer_norm_eps, cfg.dtype, cfg.dropout_masks, name="embeddings")(
                                 input_ids, segment_ids, deterministic)
    # E -> H. E is small and stays whole ("hidden" is never sharded); H is the "embed" of every layer.
    x = layers.dense(cfg.hidden_size, ("hidden",), ("embed",), dtype=cfg.dtype, name="embedding_projection")(x)
    x = layers.constrain(x, layers.BATCH_LENGTH_EMBED)
    mask = layers.AttentionMask(query_valid=input_ids > 0, key_valid=input_ids > 0)
    if cfg.share in WHOLE_LAYER_SHARE_MODES:
      x, _ = layers.layer_stack(
          layers.PostLNEncoderLayer, cfg.num_layers, x, mask, deterministic=deterministic, scan=cfg.scan_layers,
          remat_policy=cfg.remat_policy, shared=cfg.share == "all", num_heads=cfg.num_heads, head_dim=cfg.head_dim,
          mlp_dim=cfg.mlp_dim, dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
          layer_norm_eps=cfg.layer_norm_eps, dtype=cfg.dtype, approximate_gelu=cfg.approximate_gelu,
          attention_implementation=cfg.attention_implementation, dropout_masks=cfg.dropout_masks,
          gelu_gradient=cfg.gelu_gradient)
      return x, word

    def sublayers(make, block_cls, name: str, shared: bool) -> list:
      if shared:
        return [make(cfg, f"shared_{name}", block_cls)] * cfg.num_layers
      return [make(cfg, f"layer_{i}_{name}", block_cls) for i in range(cfg.num_layers)]

    # Counting self, `deterministic` is argument 4 of an attention block and 2 of an FFN block.
    attention_cls = layers.maybe_remat(layers.PostLNAttentionBlock, cfg.remat_policy, static_argnums=(4,))
    ffn_cls = layers.maybe_remat(layers.PostLNFeedForwardBlock, cfg.remat_policy, static_argnums=(2,))
    attentions = sublayers(attention_block, attention_cls, "attention", cfg.share == "attention")
    ffns = sublayers(ffn_block, ffn_cls, "ffn", cfg.share == "ffn")
    for attention, ffn in zip(attentions, ffns):
      x = ffn(attention(x, x, mask, deterministic), deterministic)
    return x, word


class AlbertForPreTraining(EncoderForPreTraining):
  """`EncoderForPreTraining` with AlbertEncoder and SOP (sop_logits); the MLM head maps back to E."""
  config: AlbertConfig
  encoder_cls = AlbertEncoder
  pair_task = "sop"

  def mlm_head_options(self) -> dict:
    return {"features": self.config.embedding_size, "approximate_gelu": self.config.approximate_gelu}
