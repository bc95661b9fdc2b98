"""ALBERT <-> transformers `AlbertForPreTraining`.

HF ALBERT expresses sharing as layer groups; this mapping covers the paper's default, one group of
one layer serving every layer (share='all'). The ablation modes have no HF equivalent.
"""
from models import layers
from models.albert import AlbertConfig
from pretrain.errors import ConfigError
from pretrain.hf_mappings.bert import attention_dropout_from_hf, encoder_layer_rules, pretraining_head_rules
from pretrain.hf_mappings.common import Rule, dense_rules, norm_rules

HF_CLASS = "AlbertForPreTraining"
HF_SHARED_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"
GELU_NAMES = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # HF name -> approximate_gelu


def _require_full_sharing(share: str) -> None:
  if share != "all":
    raise ConfigError(f"share={share!r}: HuggingFace ALBERT only holds fully shared layers (share='all')")


def rules(config: AlbertConfig) -> list:
  _require_full_sharing(config.share)
  out = [Rule("encoder/embeddings/word/embedding", "albert.embeddings.word_embeddings.weight"),
         Rule("encoder/embeddings/position/embedding", "albert.embeddings.position_embeddings.weight"),
         Rule("encoder/embeddings/token_type/embedding", "albert.embeddings.token_type_embeddings.weight")]
  out += norm_rules("encoder/embeddings/norm", "albert.embeddings.LayerNorm")
  out += dense_rules("encoder/embedding_projection", "albert.encoder.embedding_hidden_mapping_in")
  ours = f"encoder/{layers.SHARED_LAYER}"  # the same whether scanned or not
  out += encoder_layer_rules(ours, query_key_value=f"{HF_SHARED_LAYER}.attention",
                             attention_output=f"{HF_SHARED_LAYER}.attention.dense",
                             attention_norm=f"{HF_SHARED_LAYER}.attention.LayerNorm",
                             intermediate=f"{HF_SHARED_LAYER}.ffn", output=f"{HF_SHARED_LAYER}.ffn_output",
                             output_norm=f"{HF_SHARED_LAYER}.full_layer_layer_norm")
  out += pretraining_head_rules("sop", pooler="albert.pooler", pair="sop_classifier.classifier",
                                transform="predictions.dense", transform_norm="predictions.LayerNorm",
                                output_bias="predictions.bias")
  return out


def hf_config(config: AlbertConfig) -> dict:
  _require_full_sharing(config.share)
  return dict(
      model_type="albert", architectures=[HF_CLASS], vocab_size=config.vocab_size,
      embedding_size=config.embedding_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
      num_hidden_groups=1, inner_group_num=1, num_attention_heads=config.num_heads,
      intermediate_size=config.mlp_dim, hidden_act="gelu_new" if config.approximate_gelu else "gelu",
      hidden_dropout_prob=config.dropout_rate, attention_probs_dropout_prob=config.attention_dropout_rate,
      max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
      layer_norm_eps=config.layer_norm_eps, pad_token_id=0, tie_word_embeddings=True)


def config_from_hf(hf: dict) -> AlbertConfig:
  if hf.get("num_hidden_groups", 1) != 1 or hf.get("inner_group_num", 1) != 1:
    raise ConfigError(f"num_hidden_groups={hf.get('num_hidden_groups')}, inner_group_num={hf.get('inner_group_num')}: "
                      "only one shared layer (1, 1) is supported")
  act = hf.get("hidden_act", "gelu_new")
  if act not in GELU_NAMES:
    raise ConfigError(f"hidden_act={act!r}: expected one of {sorted(GELU_NAMES)}")
  return AlbertConfig(
      vocab_size=hf["vocab_size"], embedding_size=hf["embedding_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"], mlp_dim=hf["intermediate_size"],
      max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
      dropout_rate=hf["hidden_dropout_prob"], attention_dropout=attention_dropout_from_hf(hf),
      layer_norm_eps=hf["layer_norm_eps"], share="all",
      approximate_gelu=GELU_NAMES[act])
