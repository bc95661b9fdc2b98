"""XLNet <-> transformers `XLNetLMHeadModel`.

HF's q/k/v/o/r weights are [d_model, n_head, d_head] einsum weights like ours, so most rules are
plain copies. HF keeps r_w/r_r/r_s biases per layer: a model with shared biases (untie_r=False)
has no HF counterpart. The LM head weight is tied to the word embedding and not listed.
"""
from models.xlnet import BIAS_NAMES, XLNetConfig
from pretrain.errors import ConfigError
from pretrain.hf_mappings.common import Rule, dense_rules, norm_rules

HF_CLASS = "XLNetLMHeadModel"


def layer_rules(flax_prefix: str, hf_prefix: str) -> list:
  attn = f"{hf_prefix}.rel_attn"
  out = [Rule(f"{flax_prefix}/rel_attn/{name}", f"{attn}.{name}")
         for name in ("q", "k", "v", "o", "r", "seg_embed") + BIAS_NAMES]
  out += norm_rules(f"{flax_prefix}/rel_attn/layer_norm", f"{attn}.layer_norm")
  out += dense_rules(f"{flax_prefix}/ff/mlp/intermediate", f"{hf_prefix}.ff.layer_1")
  out += dense_rules(f"{flax_prefix}/ff/mlp/output", f"{hf_prefix}.ff.layer_2")
  out += norm_rules(f"{flax_prefix}/ff/norm", f"{hf_prefix}.ff.layer_norm")
  return out


def rules(config: XLNetConfig) -> list:
  if not config.untie_r:
    raise ConfigError("untie_r=False: HuggingFace XLNet has per-layer attention biases only; use untie_r=True")
  out = [Rule("word_embedding/embedding", "transformer.word_embedding.weight"),
         Rule("mask_emb", "transformer.mask_emb"),
         Rule("lm_loss/bias", "lm_loss.bias")]
  for i in range(config.n_layer):
    out += layer_rules(f"layer_{i}", f"transformer.layer.{i}")
  return out


def hf_config(config: XLNetConfig) -> dict:
  if config.d_head * config.n_head != config.d_model:
    raise ConfigError(f"d_head={config.d_head}: HuggingFace XLNet needs d_head = d_model // n_head "
                      f"({config.d_model} // {config.n_head})")
  return dict(
      model_type="xlnet", architectures=[HF_CLASS], vocab_size=config.vocab_size, d_model=config.d_model,
      n_layer=config.n_layer, n_head=config.n_head, d_head=config.d_head, d_inner=config.d_inner,
      ff_activation="gelu", attn_type=config.attn_type, dropout=config.dropout_rate,
      layer_norm_eps=config.layer_norm_eps, mem_len=config.mem_len, reuse_len=config.reuse_len,
      bi_data=config.bi_data, clamp_len=config.clamp_len, untie_r=config.untie_r, same_length=False,
      tie_word_embeddings=True)


def config_from_hf(hf: dict) -> XLNetConfig:
  if hf.get("ff_activation", "gelu") != "gelu":
    raise ConfigError(f"ff_activation={hf['ff_activation']!r}: only 'gelu' (exact erf GELU) is supported")
  return XLNetConfig(
      vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_layer=hf["n_layer"], n_head=hf["n_head"],
      d_head=hf.get("d_head") or hf["d_model"] // hf["n_head"], d_inner=hf["d_inner"],
      dropout_rate=hf["dropout"], layer_norm_eps=hf["layer_norm_eps"], mem_len=hf.get("mem_len") or 0,
      reuse_len=hf.get("reuse_len") or 0, clamp_len=hf.get("clamp_len", -1), bi_data=hf.get("bi_data", False),
      attn_type=hf.get("attn_type", "bi"), untie_r=True)  # HF weights hold per-layer biases whatever it says
