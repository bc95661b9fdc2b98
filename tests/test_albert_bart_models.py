"""ALBERT and BART against transformers' AlbertForPreTraining / BartForConditionalGeneration (fp32, eval mode),
weight-mapping round trips, ALBERT's cross-layer sharing, and the two family adapters."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special
import torch
import transformers

from helpers import assert_round_trip, build_hf
from models.albert import AlbertConfig, AlbertForPreTraining
from models.bart import BartConfig, BartForConditionalGeneration
from pretrain.families.albert import AlbertFamily
from pretrain.families.bart import BartFamily
from pretrain.hf_mappings import albert as albert_mapping
from pretrain.hf_mappings import bart as bart_mapping

ALBERT = AlbertConfig(vocab_size=97, embedding_size=16, hidden_size=32, num_layers=3, num_heads=4, mlp_dim=64,
                      max_position_embeddings=24, dropout_rate=0.0)
BART = BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4, ffn_dim=64,
                  max_position_embeddings=24, dropout_rate=0.0)
TOLERANCE = 1e-4


def random_ids(rng, shape, lengths, vocab_size):
  """Ids in [1, vocab) with trailing pad (0) beyond each row's length."""
  ids = rng.integers(1, vocab_size, shape)
  return np.where(np.arange(shape[1])[None] < np.asarray(lengths)[:, None], ids, 0).astype(np.int32)


def random_params(model, features):
  """Random values in the model's param shapes (LayerNorm scales around 1). No zero biases or unit scales
  to hide a mapping error, and activations large enough that, e.g., the wrong GELU flavour (about 8e-4
  here) exceeds TOLERANCE. Built from shapes alone: an eager init would cost seconds."""
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), features)["params"])
  rng = np.random.default_rng(1)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: float(path[-1].key == "scale") + 0.2 * rng.standard_normal(leaf.shape).astype(np.float32),
      shapes)


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


@pytest.fixture(scope="module")
def bart_case():
  rng = np.random.default_rng(2)
  encoder_lengths, decoder_lengths = [14, 9], [10, 6]
  encoder_ids = random_ids(rng, (2, 14), encoder_lengths, BART.vocab_size)
  decoder_ids = random_ids(rng, (2, 10), decoder_lengths, BART.vocab_size)
  decoder_ids[:, 0] = [0, 1]  # seqio-style start (pad id 0) and fairseq-style start (</s>)
  decoder_mask = np.arange(10)[None] < np.array(decoder_lengths)[:, None]
  features = {"encoder_input_ids": jnp.asarray(encoder_ids), "decoder_input_ids": jnp.asarray(decoder_ids)}
  model = BartForConditionalGeneration(BART)
  params = random_params(model, features)
  hf_model, missing = build_hf(bart_mapping, BART, params)
  with torch.no_grad():
    hf_logits = hf_model(input_ids=torch.from_numpy(encoder_ids).long(),
                         attention_mask=torch.from_numpy(encoder_ids > 0).long(),
                         decoder_input_ids=torch.from_numpy(decoder_ids).long(),
                         decoder_attention_mask=torch.from_numpy(decoder_mask).long()).logits.numpy()
  return dict(features=features, model=model, params=params, hf_model=hf_model, missing=missing,
              decoder_lengths=decoder_lengths, hf_logits=hf_logits)


def test_bart_matches_hf(bart_case):
  case = bart_case
  assert case["missing"] == {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}
  logits = np.asarray(case["model"].apply({"params": case["params"]}, case["features"])["logits"])
  assert logits.dtype == np.float32
  diff = max(np.abs(logits[row, :length] - case["hf_logits"][row, :length]).max()
             for row, length in enumerate(case["decoder_lengths"]))
  assert diff < TOLERANCE, diff
  print(f"BART max |diff|: logits {diff:.2e}")


def test_bart_round_trip_through_hf(bart_case):
  assert_round_trip(bart_mapping, BART, bart_case["params"], bart_case["hf_model"].state_dict())


def test_bart_config_checks():
  hf = transformers.BartConfig(**{k: v for k, v in bart_mapping.hf_config(BART).items() if k != "model_type"})
  assert hf.pad_token_id == 0
  assert bart_mapping.config_from_hf(hf.to_dict()) == BART
  with pytest.raises(ValueError, match="decoder_ffn_dim"):
    bart_mapping.config_from_hf({**hf.to_dict(), "decoder_ffn_dim": 128})
  with pytest.raises(ValueError, match="max_position_embeddings"):
    long = jnp.ones((1, BART.max_position_embeddings + 1), jnp.int32)
    BartForConditionalGeneration(BART).init(jax.random.PRNGKey(0), {"encoder_input_ids": long,
                                                                    "decoder_input_ids": long[:, :4]})


def random_batch(family, feature_lengths, rng):
  """Token ids for the *_ids features, 0 or 1 for the rest (segments, labels, positions, weights)."""
  batch = {}
  for name, spec in family.feature_shapes(2, feature_lengths).items():
    low, high = (1, 50) if name.endswith("_ids") and name != "segment_ids" else (0, 2)
    batch[name] = jnp.asarray(rng.integers(low, high, spec.shape), spec.dtype)
  return batch


def test_bart_family_loss_counts_weighted_positions_only(bart_case):
  family = BartFamily(dataclasses.replace(BART, dropout_rate=0.1))
  batch = random_batch(family, {"encoder_input_ids": 14, "decoder_input_ids": 10}, np.random.default_rng(3))
  batch["decoder_weights"] = batch["decoder_weights"].at[1, -1].set(0.0)
  model, params, rngs = family.make_model(), bart_case["params"], {"dropout": jax.random.PRNGKey(1)}
  outputs, carry = family.forward(model, params, batch, {}, rngs=rngs, deterministic=True)
  assert carry == {} and outputs["logits"].shape == (2, 10, BART.vocab_size)
  loss, metrics = family.loss_and_metrics(outputs, batch)
  weights = np.asarray(batch["decoder_weights"])
  picked = target_log_probs(outputs["logits"], batch["decoder_target_ids"])
  np.testing.assert_allclose(loss, -(picked * weights).sum() / weights.sum(), rtol=1e-5)
  assert set(metrics) == {"denoising_loss", "denoising_accuracy"}
  targets = batch["decoder_target_ids"].at[1, -1].set(7)  # a zero-weight position
  assert family.loss_and_metrics(outputs, {**batch, "decoder_target_ids": targets})[0] == loss
  noisy, _ = family.forward(model, params, batch, {}, rngs=rngs, deterministic=False)
  assert not np.allclose(noisy["logits"], outputs["logits"])  # dropout reaches the model in training mode


def target_log_probs(logits, targets):
  """log p(target) at every position, from a plain log-softmax."""
  log_probs = special.log_softmax(np.asarray(logits, np.float64), axis=-1)
  return np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


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


@pytest.mark.parametrize("case_name", ["albert_case", "bart_case"])
def test_bf16_compute_with_padding_stays_finite_and_close(case_name, request):
  case = request.getfixturevalue(case_name)
  model = type(case["model"])(dataclasses.replace(case["model"].config, dtype=jnp.bfloat16))
  reference = case["model"].apply({"params": case["params"]}, case["features"])
  out = model.apply({"params": case["params"]}, case["features"])
  for name, logits in out.items():
    logits, expected = np.asarray(logits), np.asarray(reference[name])
    assert logits.dtype == np.float32 and np.isfinite(logits).all(), name
    # bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.004); a few layers of rounding stay well under 5%.
    relative = np.abs(logits - expected).max() / np.abs(expected).max()
    assert relative < 0.05, (name, relative)
