"""Which weights AdamW and LAMB decay: matrices and embeddings, never a bias or a LayerNorm scale. XLNet's
attention biases are decayed, as the reference decays them (`include_in_weight_decay=["r_s_bias",
"r_r_bias", "r_w_bias"]` in zihangdai/xlnet's model_utils.py), where transformers' usual recipe, which
excludes every name containing "bias", would not."""
import numpy as np

from models.xlnet import BIAS_NAMES, XLNetConfig
from pretrain import optimizers, registry
from pretrain.hf_mappings import common


def test_xlnet_decays_matrices_embeddings_and_attention_biases_not_biases_or_norms():
  config = XLNetConfig(vocab_size=100, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=4)
  shapes = registry.get("xlnet").param_shapes(config)
  mask = common.flatten_params(optimizers.decay_mask(common.unflatten_params(
      {path: np.zeros(shape) for path, shape in shapes.items()})))
  not_decayed = {path for path, decayed in mask.items() if not decayed}
  assert not_decayed == {path for path in shapes if path.endswith(("/bias", "/scale"))}
  assert {"word_embedding/embedding", "mask_emb", "layer_0/rel_attn/q", "layer_0/rel_attn/seg_embed",
          "layer_1/ff/mlp/intermediate/kernel"} | {f"layer_0/rel_attn/{name}" for name in BIAS_NAMES} <= (
              set(mask) - not_decayed)
