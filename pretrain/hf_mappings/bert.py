"""BERT <-> transformers `BertForPreTraining`."""
from models.bert import BertConfig
from pretrain.hf_mappings.common import Linear, Rule, Same, dense_rules, norm_rules

HF_CLASS = "BertForPreTraining"


def attention_rules(flax_prefix: str, hf_prefix: str) -> list:
  """q/k/v/o projections of `layers.MultiHeadAttention` against HF's separate Linear layers."""
  rules = []
  for name in ("query", "key", "value"):
    rules += [Rule(f"{flax_prefix}/{name}/kernel", f"{hf_prefix}.{name}.weight", Linear(1)),
              Rule(f"{flax_prefix}/{name}/bias", f"{hf_prefix}.{name}.bias", Same(flatten=True))]
  return rules


def encoder_layer_rules(ours: str, *, query_key_value: str, attention_output: str, attention_norm: str,
                        intermediate: str, output: str, output_norm: str) -> list:
  """`layers.PostLNEncoderLayer` against the HF names of its parts (BertLayer, AlbertLayer)."""
  return (attention_rules(f"{ours}/attention/attention", query_key_value)
          + dense_rules(f"{ours}/attention/attention/output", attention_output, num_in_dims=2)
          + norm_rules(f"{ours}/attention/norm", attention_norm)
          + dense_rules(f"{ours}/ffn/mlp/intermediate", intermediate)
          + dense_rules(f"{ours}/ffn/mlp/output", output)
          + norm_rules(f"{ours}/ffn/norm", output_norm))


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
    theirs = f"bert.encoder.layer.{i}"
    out += encoder_layer_rules(f"encoder/layer_{i}", query_key_value=f"{theirs}.attention.self",
                               attention_output=f"{theirs}.attention.output.dense",
                               attention_norm=f"{theirs}.attention.output.LayerNorm",
                               intermediate=f"{theirs}.intermediate.dense", output=f"{theirs}.output.dense",
                               output_norm=f"{theirs}.output.LayerNorm")
  out += pretraining_head_rules("nsp", pooler="bert.pooler.dense", pair="cls.seq_relationship",
                                transform="cls.predictions.transform.dense",
                                transform_norm="cls.predictions.transform.LayerNorm",
                                output_bias="cls.predictions.bias")
  return out


def hf_config(config: BertConfig) -> dict:
  return dict(
      model_type="bert", architectures=[HF_CLASS], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
      intermediate_size=config.mlp_dim, hidden_act="gelu", hidden_dropout_prob=config.dropout_rate,
      attention_probs_dropout_prob=config.attention_dropout_rate,
      max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
      layer_norm_eps=config.layer_norm_eps, pad_token_id=0,
      tie_word_embeddings=True)


def config_from_hf(hf: dict) -> BertConfig:
  return BertConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"], mlp_dim=hf["intermediate_size"],
      max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
      dropout_rate=hf["hidden_dropout_prob"], attention_dropout=attention_dropout_from_hf(hf),
      layer_norm_eps=hf["layer_norm_eps"])


def attention_dropout_from_hf(hf: dict):
  """Our `attention_dropout` (BERT's and ALBERT's): None, following dropout_rate, where the two rates agree."""
  rate = hf["attention_probs_dropout_prob"]
  return None if rate == hf["hidden_dropout_prob"] else rate
