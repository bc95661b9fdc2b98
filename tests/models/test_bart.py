"""BART against transformers' BartForConditionalGeneration (fp32, eval mode), its weight mapping's round
trip, and the family adapter's loss."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers import (assert_bf16_close, assert_round_trip, build_hf, random_batch, random_ids, random_params,
                     target_log_probs)
from models.bart import BartConfig, BartForConditionalGeneration
from pretrain.families.bart import BartFamily
from pretrain.hf_mappings import bart as bart_mapping

BART = BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4, ffn_dim=64,
                  max_position_embeddings=24, dropout_rate=0.0)
TOLERANCE = 1e-4


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


def test_bf16_compute_with_padding_stays_finite_and_close(bart_case):
  assert_bf16_close(bart_case)
