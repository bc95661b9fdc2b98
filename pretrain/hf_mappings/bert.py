"""BERT <-> transformers `BertForPreTraining`."""
from models.bert import BertConfig
from pretrain.hf_mappings.common import Linear, Rule, Same

HF_CLASS = "BertForPreTraining"


def attention_rules(flax_prefix: str, hf_prefix: str) -> list:
  """q/k/v/o projections of `layers.MultiHeadAttention` against HF's separate Linear layers."""
  rules = []
  for name in ("query", "key", "value"):
    rules += [Rule(f"{flax_prefix}/{name}/kernel", f"{hf_prefix}.{name}.weight", Linear(1)),
              Rule(f"{flax_prefix}/{name}/bias", f"{hf_prefix}.{name}.bias", Same(flatten=True))]
  return rules


def dense_rules(flax_prefix: str, hf_prefix: str, num_in_dims: int = 1) -> list:
  return [Rule(f"{flax_prefix}/kernel", f"{hf_prefix}.weight", Linear(num_in_dims)),
          Rule(f"{flax_prefix}/bias", f"{hf_prefix}.bias")]


def norm_rules(flax_prefix: str, hf_prefix: str) -> list:
  return [Rule(f"{flax_prefix}/scale", f"{hf_prefix}.weight"), Rule(f"{flax_prefix}/bias", f"{hf_prefix}.bias")]


def encoder_layer_rules(flax_prefix: str, hf_prefix: str) -> list:
  """`layers.PostLNEncoderLayer` against HF's BertLayer / AlbertLayer-style naming."""
  return (attention_rules(f"{flax_prefix}/attention", f"{hf_prefix}.attention.self")
          + dense_rules(f"{flax_prefix}/attention/output", f"{hf_prefix}.attention.output.dense", num_in_dims=2)
          + norm_rules(f"{flax_prefix}/attention_norm", f"{hf_prefix}.attention.output.LayerNorm")
          + dense_rules(f"{flax_prefix}/ffn/intermediate", f"{hf_prefix}.intermediate.dense")
          + dense_rules(f"{flax_prefix}/ffn/output", f"{hf_prefix}.output.dense")
          + norm_rules(f"{flax_prefix}/ffn_norm", f"{hf_prefix}.output.LayerNorm"))


def pretraining_head_rules(pair_task: str, *, pooler: str, pair: str, transform: str, transform_norm: str,
                           output_bias: str) -> list:
  """`models.bert.pretraining_heads` (BERT and ALBERT) against HF's names for the same layers."""
  return (dense_rules("pooler", pooler) + dense_rules(pair_task, pair) + dense_rules("mlm/transform", transform)
          + norm_rules("mlm/norm", transform_norm) + [Rule("mlm/output/bias", output_bias)])


def rules(config: BertConfig) -> list:
  out = [Rule("encoder/embeddings/word/embedding", "bert.embeddings.word_embeddings.weight"),
         Rule("encoder/embeddings/position/embedding", "bert.embeddings.position_embeddings.weight"),
         Rule("encoder/embeddings/token_type/embedding", "bert.embeddings.token_type_embeddings.weight")]
  out += norm_rules("encoder/embeddings/norm", "bert.embeddings.LayerNorm")
  for i in range(config.num_layers):
    out += encoder_layer_rules(f"encoder/layer_{i}", f"bert.encoder.layer.{i}")
  out += pretraining_head_rules("nsp", pooler="bert.pooler.dense", pair="cls.seq_relationship",
                                transform="cls.predictions.transform.dense",
                                transform_norm="cls.predictions.transform.LayerNorm", output_bias="cls.predictions.bias")
  return out


def hf_config(config: BertConfig) -> dict:
  return dict(
      model_type="bert", architectures=[HF_CLASS], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
      intermediate_size=config.mlp_dim, hidden_act="gelu", hidden_dropout_prob=config.dropout_rate,
      attention_probs_dropout_prob=config.dropout_rate, max_position_embeddings=config.max_position_embeddings,
      type_vocab_size=config.type_vocab_size, layer_norm_eps=config.layer_norm_eps, pad_token_id=0,
      tie_word_embeddings=True)


def config_from_hf(hf: dict) -> BertConfig:
  return BertConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"], mlp_dim=hf["intermediate_size"],
      max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
      dropout_rate=hf["hidden_dropout_prob"], layer_norm_eps=hf["layer_norm_eps"])
