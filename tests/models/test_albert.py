"""ALBERT against transformers' AlbertForPreTraining (fp32, eval mode), its weight mapping's round trip,
cross-layer sharing, and the family adapter's loss."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers import (assert_bf16_close, assert_round_trip, build_hf, random_batch, random_ids, random_params,
                     target_log_probs)
from models.albert import AlbertConfig, AlbertForPreTraining
from pretrain.families.albert import AlbertFamily
from pretrain.hf_mappings import albert as albert_mapping

ALBERT = AlbertConfig(vocab_size=97, embedding_size=16, hidden_size=32, num_layers=3, num_heads=4, mlp_dim=64,
                      max_position_embeddings=24, dropout_rate=0.0)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def albert_case():
  rng = np.random.default_rng(0)
  lengths = [12, 8]
  ids = random_ids(rng, (2, 12), lengths, ALBERT.vocab_size)
  segments = (np.arange(12)[None] >= np.array([[5], [4]])).astype(np.int32) * (ids > 0)
  features = {"input_ids": jnp.asarray(ids), "segment_ids": jnp.asarray(segments)}
  model = AlbertForPreTraining(ALBERT)
  params = random_params(model, features)
  hf_model, missing = build_hf(albert_mapping, ALBERT, params)
  with torch.no_grad():
    hf_out = hf_model(input_ids=torch.from_numpy(ids).long(), token_type_ids=torch.from_numpy(segments).long(),
                      attention_mask=torch.from_numpy(ids > 0).long())
  return dict(features=features, model=model, params=params, hf_model=hf_model, missing=missing, lengths=lengths,
              hf_mlm=hf_out.prediction_logits.numpy(), hf_sop=hf_out.sop_logits.numpy())


def test_albert_matches_hf(albert_case):
  case = albert_case
  assert case["missing"] == {"predictions.decoder.weight", "predictions.decoder.bias"}  # tied to embedding, bias
  out = case["model"].apply({"params": case["params"]}, case["features"])
  mlm = np.asarray(out["mlm_logits"])
  mlm_diff = max(np.abs(mlm[row, :length] - case["hf_mlm"][row, :length]).max()  # HF leaves pad queries unmasked:
                 for row, length in enumerate(case["lengths"]))                    # only real positions count
  assert mlm_diff < TOLERANCE, mlm_diff
  sop_diff = np.abs(np.asarray(out["sop_logits"]) - case["hf_sop"]).max()
  assert sop_diff < TOLERANCE, sop_diff
  print(f"ALBERT max |diff|: mlm {mlm_diff:.2e}, sop {sop_diff:.2e}")


def test_albert_masked_positions_gather_the_full_logits(albert_case):
  case = albert_case
  positions = np.array([[0, 3, 11], [1, 7, 2]], np.int32)
  out = case["model"].apply({"params": case["params"]}, {**case["features"], "masked_positions": positions})
  expected = np.take_along_axis(case["hf_mlm"], positions[..., None], axis=1)
  assert out["mlm_logits"].shape == (2, 3, ALBERT.vocab_size)
  assert np.abs(np.asarray(out["mlm_logits"]) - expected).max() < TOLERANCE


def test_albert_round_trip_through_hf(albert_case):
  assert_round_trip(albert_mapping, ALBERT, albert_case["params"], albert_case["hf_model"].state_dict())


def test_albert_remat_keeps_shared_layer_outputs(albert_case):
  case = albert_case
  remat_model = AlbertForPreTraining(dataclasses.replace(ALBERT, remat_policy="full"))
  reference = case["model"].apply({"params": case["params"]}, case["features"])
  out = remat_model.apply({"params": case["params"]}, case["features"])
  np.testing.assert_allclose(out["mlm_logits"], reference["mlm_logits"], atol=1e-6)


def albert_param_count(share, num_layers):
  config = dataclasses.replace(ALBERT, share=share, num_layers=num_layers)
  features = {"input_ids": jnp.ones((1, 4), jnp.int32), "segment_ids": jnp.zeros((1, 4), jnp.int32)}
  shapes = jax.eval_shape(AlbertForPreTraining(config).init, jax.random.PRNGKey(0), features)["params"]
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nn.unbox(shapes)))


def test_albert_sharing_sets_param_count():
  h, f = ALBERT.hidden_size, ALBERT.mlp_dim
  attention = 4 * (h * h + h) + 2 * h  # q, k, v, o and the LayerNorm after them
  ffn = (h * f + f) + (f * h + h) + 2 * h
  assert albert_param_count("all", 1) == albert_param_count("all", 6)
  assert albert_param_count("none", 6) - albert_param_count("none", 1) == 5 * (attention + ffn)
  assert albert_param_count("attention", 6) - albert_param_count("attention", 1) == 5 * ffn
  assert albert_param_count("ffn", 6) - albert_param_count("ffn", 1) == 5 * attention


def test_albert_config_checks():
  with pytest.raises(ValueError, match="share='none'"):
    albert_mapping.rules(dataclasses.replace(ALBERT, share="none"))
  with pytest.raises(ValueError, match="share='layers'"):
    AlbertConfig(share="layers")
  hf = transformers.AlbertConfig(**{k: v for k, v in albert_mapping.hf_config(ALBERT).items() if k != "model_type"})
  assert albert_mapping.config_from_hf(hf.to_dict()) == ALBERT


def test_albert_family_runs_mlm_and_sop(albert_case):
  family = AlbertFamily(ALBERT)
  batch = random_batch(family, {"input_ids": 12, "masked_positions": 3}, np.random.default_rng(4))
  outputs, _ = family.forward(family.make_model(), albert_case["params"], batch, {}, rngs={}, deterministic=True)
  assert outputs["mlm_logits"].shape == (2, 3, ALBERT.vocab_size)
  batch["masked_weights"] = batch["masked_weights"].at[1, -1].set(0.0)
  loss, metrics = family.loss_and_metrics(outputs, batch)
  assert set(metrics) == {"mlm_loss", "mlm_accuracy", "sop_loss", "sop_accuracy"}
  # The reference's sum: MLM averaged over weighted positions, SOP over the batch.
  weights = np.asarray(batch["masked_weights"])
  mlm = -(target_log_probs(outputs["mlm_logits"], batch["masked_ids"]) * weights).sum() / weights.sum()
  sop = -target_log_probs(outputs["sop_logits"], batch["sop_label"]).mean()
  np.testing.assert_allclose([loss, metrics["mlm_loss"], metrics["sop_loss"]], [mlm + sop, mlm, sop], rtol=1e-5)


def test_bf16_compute_with_padding_stays_finite_and_close(albert_case):
  assert_bf16_close(albert_case)
