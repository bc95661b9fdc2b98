"""BERT (Devlin et al. 2018): post-LN Transformer encoder with tied MLM head and NSP head."""
import dataclasses
from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import layers


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: Optional[int] = 32000  # None: the run's vocabulary size
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.1
  attention_dropout: Optional[float] = None  # of the attention probabilities; None: dropout_rate, as the reference
  layer_norm_eps: float = 1e-12
  dtype: Any = jnp.float32  # compute dtype; parameters are always fp32
  remat_policy: str = "none"
  scan_layers: bool = False  # one nn.scan over the layers (see layers.layer_stack)
  attention_implementation: str = "auto"  # layers.ATTENTION_IMPLEMENTATIONS; 'auto': the chip's fastest exact one
  dropout_masks: str = "auto"  # dropout.DROPOUT_MASKS; 'auto': the chip's cheaper one
  gelu_gradient: str = "formula"  # layers.GELU_GRADIENTS: what the GELU's backward pass keeps

  def __post_init__(self):
    layers.check_at_least(1, vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                          mlp_dim=self.mlp_dim, max_position_embeddings=self.max_position_embeddings,
                          type_vocab_size=self.type_vocab_size)
    layers.check_fractions(dropout_rate=self.dropout_rate, attention_dropout=self.attention_dropout)
    layers.check_heads_divide("hidden_size", self.hidden_size, self.num_heads)

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def attention_dropout_rate(self) -> float:
    return self.dropout_rate if self.attention_dropout is None else self.attention_dropout


class BertEmbeddings(nn.Module):
  """Word + position + token-type embeddings, then LayerNorm and dropout."""
  vocab_size: int
  features: int
  max_position_embeddings: int
  type_vocab_size: int
  dropout_rate: float
  layer_norm_eps: float
  dtype: Any
  dropout_masks: str = "auto"

  @nn.compact
  def __call__(self, input_ids, segment_ids, deterministic: bool):
    layers.check_sequence_length(input_ids.shape[1], self.max_position_embeddings)
    word = layers.embedding(self.vocab_size, self.features, ("vocab", "embed"), self.dtype, "word")
    position = layers.embedding(self.max_position_embeddings, self.features, ("position", "embed"), self.dtype,
                                "position")
    token_type = layers.embedding(self.type_vocab_size, self.features, ("token_type", "embed"), self.dtype,
                                  "token_type", one_hot=True)  # every position's gradient goes to one of its rows
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = word(input_ids) + position(positions) + token_type(segment_ids)
    x = layers.layer_norm(self.layer_norm_eps, self.dtype, "norm")(x)
    x = layers.Dropout(self.dropout_rate, self.dropout_masks)(x, deterministic=deterministic)
    return layers.constrain(x, layers.BATCH_LENGTH_EMBED), word


def gather_positions(hidden: jax.Array, positions: jax.Array) -> jax.Array:
  """hidden [b, l, d], positions [b, p] -> [b, p, d]: only predicted positions reach the LM head."""
  return jnp.take_along_axis(hidden, positions[..., None], axis=1)


def pretraining_heads(hidden, word_embedding, features, mlm_head, *, pair_task: str, dtype) -> dict:
  """The heads BERT and ALBERT share: a tanh pooler on [CLS] with a 2-way sentence-pair classifier
  named `pair_task` ('nsp' or 'sop'), and `mlm_head` at masked_positions (all positions without them).

  Call it inside a compact method: the layers it makes are the caller's (pooler, <pair_task>, mlm).
  """
  pooled = jnp.tanh(layers.dense(hidden.shape[-1], ("embed",), ("hidden",), dtype=dtype, name="pooler")(hidden[:, 0]))
  pair_logits = layers.dense(2, ("hidden",), (None,), dtype=dtype, name=pair_task)(pooled)
  if "masked_positions" in features:
    hidden = gather_positions(hidden, features["masked_positions"])
  mlm_logits = mlm_head(hidden, word_embedding)
  return {"mlm_logits": mlm_logits.astype(jnp.float32), f"{pair_task}_logits": pair_logits.astype(jnp.float32)}


class BertEncoder(nn.Module):
  """Embeddings and the layer stack; returns the final hidden states and the word embedding."""
  config: BertConfig

  @nn.compact
  def __call__(self, input_ids, segment_ids, deterministic: bool):
    cfg = self.config
    x, word = BertEmbeddings(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings, cfg.type_vocab_size,
                             cfg.dropout_rate, cfg.layer_norm_eps, cfg.dtype, cfg.dropout_masks, name="embeddings")(
                                 input_ids, segment_ids, deterministic)
    mask = layers.AttentionMask(query_valid=input_ids > 0, key_valid=input_ids > 0)
    x, _ = layers.layer_stack(
        layers.PostLNEncoderLayer, cfg.num_layers, x, mask, deterministic=deterministic, scan=cfg.scan_layers,
        remat_policy=cfg.remat_policy, num_heads=cfg.num_heads, head_dim=cfg.head_dim, mlp_dim=cfg.mlp_dim,
        dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
        layer_norm_eps=cfg.layer_norm_eps, dtype=cfg.dtype, attention_implementation=cfg.attention_implementation,
        dropout_masks=cfg.dropout_masks, gelu_gradient=cfg.gelu_gradient)
    return x, word


class EncoderForPreTraining(nn.Module):
  """BERT and ALBERT pretraining: `encoder_cls` ("encoder"), a MaskedLMHead ("mlm") and `pretraining_heads`.

  Inputs: input_ids, segment_ids [b, l] and optionally masked_positions [b, p]. Returns mlm_logits
  ([b, p, vocab] at masked_positions, else [b, l, vocab]) and <pair_task>_logits [b, 2].
  A subclass sets the encoder, the pair task and any MaskedLMHead options its config needs.
  """
  config: Any
  encoder_cls: ClassVar[type]
  pair_task: ClassVar[str]

  def mlm_head_options(self) -> dict:
    """Keyword arguments of the MaskedLMHead beyond vocab size, LayerNorm epsilon and dtype."""
    return {}

  @nn.compact
  def __call__(self, features, deterministic: bool = True):
    cfg = self.config
    hidden, word = self.encoder_cls(cfg, name="encoder")(features["input_ids"], features["segment_ids"], deterministic)
    mlm_head = layers.MaskedLMHead(cfg.vocab_size, cfg.layer_norm_eps, cfg.dtype, gelu_gradient=cfg.gelu_gradient,
                                   name="mlm", **self.mlm_head_options())
    return pretraining_heads(hidden, word, features, mlm_head, pair_task=self.pair_task, dtype=cfg.dtype)


class BertForPreTraining(EncoderForPreTraining):
  """`EncoderForPreTraining` with BertEncoder and NSP (nsp_logits)."""
  config: BertConfig
  encoder_cls = BertEncoder
  pair_task = "nsp"
