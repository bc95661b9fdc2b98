"""BERT is the same network as transformers' BertForPreTraining, given the same weights."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.bert import BertConfig, BertForPreTraining
from pretrain.hf_mappings import bert as bert_mapping
from pretrain.hf_mappings import common


def test_logits_match_huggingface_and_mapping_round_trips():
  config = BertConfig(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
                      max_position_embeddings=64, dropout_rate=0.0)
  model = BertForPreTraining(config)
  rng = np.random.RandomState(0)
  ids = rng.randint(1, 99, size=(2, 16))
  ids[1, 10:] = 0  # padding
  segments = np.zeros_like(ids)
  segments[:, 8:] = 1
  features = {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(segments)}
  params = nn.unbox(model.init(jax.random.PRNGKey(0), features)["params"])
  ours = model.apply({"params": params}, features)

  hf = transformers.BertForPreTraining(transformers.BertConfig(**bert_mapping.hf_config(config))).eval()
  state = common.to_hf(params, bert_mapping.rules(config))
  missing, unexpected = hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
  assert not unexpected and all(k.startswith("cls.predictions.decoder") for k in missing)  # tied weights
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(segments),
                attention_mask=torch.tensor(ids > 0).long())
  real = ids > 0
  np.testing.assert_allclose(np.asarray(ours["mlm_logits"])[real], theirs.prediction_logits.numpy()[real], atol=1e-4)
  np.testing.assert_allclose(np.asarray(ours["nsp_logits"]), theirs.seq_relationship_logits.numpy(), atol=1e-4)

  shapes = {k: v.shape for k, v in common.flatten_params(params).items()}
  back = common.from_hf(state, bert_mapping.rules(config), shapes)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_masked_positions_gather_the_same_logits():
  config = BertConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32, dropout_rate=0.0)
  model = BertForPreTraining(config)
  ids = jnp.asarray(np.random.RandomState(1).randint(1, 50, size=(2, 12)))
  features = {"input_ids": ids, "segment_ids": jnp.zeros_like(ids)}
  params = model.init(jax.random.PRNGKey(0), features)["params"]
  full = model.apply({"params": params}, features)["mlm_logits"]
  positions = jnp.asarray([[1, 5, 7], [0, 2, 11]])
  gathered = model.apply({"params": params}, {**features, "masked_positions": positions})["mlm_logits"]
  np.testing.assert_allclose(gathered, jnp.take_along_axis(full, positions[..., None], axis=1), atol=1e-5)


def test_a_sequence_longer_than_the_position_table_is_an_error():
  # The lookup past the table would not fail by itself: it yields NaN logits.
  model = BertForPreTraining(BertConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32,
                                        max_position_embeddings=8))
  ids = np.full((1, 12), 9, np.int32)
  with pytest.raises(ValueError, match="sequence length 12 exceeds max_position_embeddings=8"):
    model.init(jax.random.PRNGKey(0), {"input_ids": ids, "segment_ids": np.zeros_like(ids)})
