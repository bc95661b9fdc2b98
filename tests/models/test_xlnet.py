"""XLNet against transformers' XLNetLMHeadModel (fp32, eval mode): logits and memory with and without
memory, bi_data and clamp_len, the content-only path; weight-mapping round trips; the two-stream
property; shared biases; the family adapter."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers

from helpers import assert_round_trip, build_hf
from models.xlnet import XLNetConfig, XLNetLMHeadModel
from pretrain.families.xlnet import XLNetFamily
from pretrain.hf_mappings import xlnet as mapping
from pretrain.hf_mappings.common import flatten_params, from_hf, to_hf

SEQ, NUM_PREDICT, MEM_LEN = 16, 4, 8
SMALL = XLNetConfig(vocab_size=100, d_model=32, n_layer=3, n_head=4, d_head=8, d_inner=64, dropout_rate=0.0,
                    mem_len=MEM_LEN, reuse_len=6, bi_data=False)
TOLERANCE = 1e-4


def plm_features(rng, batch, num_targets=(NUM_PREDICT,), seq=SEQ, num_predict=NUM_PREDICT):
  """A permutation-LM batch built like the reference's _local_perm: context tokens are visible to all
  and see no target; targets see the context and the targets earlier in a random order."""
  num_targets = list(num_targets) + [num_predict] * (batch - len(num_targets))
  perm_mask = np.zeros((batch, seq, seq), np.float32)
  target_mapping = np.zeros((batch, num_predict, seq), np.float32)
  for b in range(batch):
    positions = np.sort(rng.choice(seq - 1, num_targets[b], replace=False))
    order = np.full(seq, -1)
    order[positions] = rng.permutation(num_targets[b])
    is_target = order >= 0
    perm_mask[b] = (order[:, None] <= order[None, :]) & is_target[None, :]
    target_mapping[b, np.arange(num_targets[b]), positions] = 1.0  # rows past num_targets stay padding
  first = seq * 9 // 16
  segment_ids = np.repeat(np.array([0, 1, 2], np.int32), [first, seq - first - 1, 1])  # A, B, <cls> as the reference
  return {"input_ids": rng.integers(0, SMALL.vocab_size, (batch, seq)).astype(np.int32),
          "segment_ids": np.tile(segment_ids, (batch, 1)), "perm_mask": perm_mask, "target_mapping": target_mapping}


def random_mems(rng, batch, config=SMALL):
  return rng.standard_normal((batch, config.n_layer, MEM_LEN, config.d_model)).astype(np.float32)


@pytest.fixture(scope="module")
def params():
  """Initial params plus noise, so zero biases and unit LayerNorm scales cannot hide a mapping error."""
  model = XLNetLMHeadModel(SMALL)
  initial = nn.unbox(model.init(jax.random.PRNGKey(0), plm_features(np.random.default_rng(0), 2))["params"])
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda p: np.asarray(p) + 0.05 * rng.standard_normal(p.shape).astype(np.float32), initial)


def tied_hf_model(config, params):
  """The HF model holding our params; its output layer is the word embedding."""
  model, missing = build_hf(mapping, config, params)
  assert missing == {"lm_loss.weight"}  # the tied head, loaded via the embedding
  assert model.lm_loss.weight.data_ptr() == model.transformer.word_embedding.weight.data_ptr()
  return model


def run_hf(model, features, mems):
  """HF is time-major inside but takes batch-first inputs; its mems are per-layer [mlen, b, d]."""
  inputs = {"input_ids": features["input_ids"], "token_type_ids": features["segment_ids"],
            "perm_mask": features["perm_mask"], "target_mapping": features.get("target_mapping")}
  inputs = {key: torch.from_numpy(value).long() if value.dtype == np.int32 else torch.from_numpy(value)
            for key, value in inputs.items() if value is not None}
  if mems is not None:
    inputs["mems"] = [torch.from_numpy(np.ascontiguousarray(mems[:, i].transpose(1, 0, 2)))
                      for i in range(mems.shape[1])]
  with torch.no_grad():
    out = model(**inputs, use_mems=True)
  return out.logits.numpy(), np.stack([m.numpy().transpose(1, 0, 2) for m in out.mems], axis=1)


CASES = {
    "no_memory": (SMALL, 2, False, True),
    "memory": (SMALL, 2, True, True),
    "bi_data_clamped": (dataclasses.replace(SMALL, bi_data=True, clamp_len=5), 2, True, True),  # 1 fwd + 1 bwd
    "content_only": (SMALL, 2, True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, params):
  config, batch, with_mems, two_stream = CASES[case]
  rng = np.random.default_rng(2)
  features = plm_features(rng, batch, num_targets=(NUM_PREDICT - 1,))  # example 0 has one padding prediction
  if not two_stream:
    del features["target_mapping"]
  mems = random_mems(rng, batch) if with_mems else None
  outputs = XLNetLMHeadModel(config).apply({"params": params}, features, mems=mems)
  hf_logits, hf_mems = run_hf(tied_hf_model(config, params), features, mems)

  expected_length = NUM_PREDICT if two_stream else SEQ
  assert outputs["logits"].shape == hf_logits.shape == (batch, expected_length, config.vocab_size)
  logit_diff = np.abs(np.asarray(outputs["logits"]) - hf_logits).max()
  # Memory = last mem_len of [old memory, first reuse_len positions]; without old memory only reuse_len exist.
  assert outputs["new_mems"].shape == hf_mems.shape == (batch, config.n_layer, MEM_LEN if with_mems else 6,
                                                        config.d_model)
  mems_diff = np.abs(np.asarray(outputs["new_mems"]) - hf_mems).max()
  print(f"{case}: max |logits - HF| = {logit_diff:.2e}, max |new_mems - HF| = {mems_diff:.2e}")
  assert logit_diff < TOLERANCE and mems_diff < TOLERANCE


def test_memory_changes_logits(params):
  """Guards the parity test against memory being ignored on both sides."""
  rng = np.random.default_rng(3)
  features, model = plm_features(rng, 2), XLNetLMHeadModel(SMALL)
  with_memory = model.apply({"params": params}, features, mems=random_mems(rng, 2))["logits"]
  without = model.apply({"params": params}, features)["logits"]
  assert np.abs(np.asarray(with_memory) - np.asarray(without)).max() > 1e-2


def test_mapping_round_trips_both_ways(params):
  rules = mapping.rules(SMALL)
  assert_round_trip(mapping, SMALL, params, to_hf(params, rules))

  torch.manual_seed(0)  # a freshly initialised HF model -> Flax -> HF
  fresh = transformers.XLNetLMHeadModel(transformers.XLNetConfig(**{
      k: v for k, v in mapping.hf_config(SMALL).items() if k != "model_type"}))
  hf_state = {key: value.detach().numpy() for key, value in fresh.state_dict().items()}
  shapes = {path: value.shape for path, value in flatten_params(params).items()}
  again = to_hf(from_hf(hf_state, rules, shapes), rules)
  assert set(again) == set(hf_state) - {"lm_loss.weight"}
  for key, value in again.items():
    np.testing.assert_array_equal(value, hf_state[key], err_msg=key)


def test_config_round_trips_through_hf():
  config = dataclasses.replace(SMALL, bi_data=True, clamp_len=5, dropout_rate=0.1)
  assert mapping.config_from_hf(mapping.hf_config(config)) == config


def test_query_stream_cannot_see_its_own_token(params):
  """Changing the token at a target leaves that target's logits unchanged, but a target later in the
  factorisation order (which may see it) does change."""
  rng = np.random.default_rng(4)
  features = plm_features(rng, 2)
  positions = features["target_mapping"][0].argmax(-1)
  # A target's place in the factorisation order = how many targets it may see.
  seen = (1 - features["perm_mask"][0][np.ix_(positions, positions)]).sum(-1)
  first, last = int(np.argmin(seen)), int(np.argmax(seen))
  changed = {**features, "input_ids": features["input_ids"].copy()}
  changed["input_ids"][0, positions[first]] = (features["input_ids"][0, positions[first]] + 1) % SMALL.vocab_size
  model = XLNetLMHeadModel(SMALL)
  before = np.asarray(model.apply({"params": params}, features)["logits"])
  after = np.asarray(model.apply({"params": params}, changed)["logits"])
  np.testing.assert_allclose(after[0, first], before[0, first], atol=1e-6)
  assert np.abs(after[0, last] - before[0, last]).max() > 1e-3


def test_shared_biases_have_no_hf_counterpart():
  config = dataclasses.replace(SMALL, untie_r=False)
  variables = XLNetLMHeadModel(config).init(jax.random.PRNGKey(0), plm_features(np.random.default_rng(0), 2))
  params = nn.unbox(variables["params"])
  assert params["r_w_bias"].shape == (config.n_head, config.d_head)
  assert "r_w_bias" not in params["layer_0"]["rel_attn"]
  with pytest.raises(ValueError, match="untie_r"):
    mapping.rules(config)


def test_bi_data_needs_an_even_batch(params):
  with pytest.raises(ValueError, match="even batch"):
    XLNetLMHeadModel(dataclasses.replace(SMALL, bi_data=True)).apply(
        {"params": params}, plm_features(np.random.default_rng(0), 3))


def test_family_carries_memory_and_scores_targets(params):
  family = XLNetFamily(SMALL)
  rng = np.random.default_rng(5)
  batch = plm_features(rng, 2)
  batch["target_ids"] = rng.integers(0, SMALL.vocab_size, (2, NUM_PREDICT)).astype(np.int32)
  batch["target_weights"] = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
  shapes = family.feature_shapes(2, {"input_ids": SEQ, "target_ids": NUM_PREDICT})
  assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == {k: (v.shape, v.dtype) for k, v in batch.items()}

  carry = family.initial_carry(2)
  assert carry["mems"].shape == (2, SMALL.n_layer, MEM_LEN, SMALL.d_model)
  assert len(family.carry_axes()["mems"]) == carry["mems"].ndim
  model = family.make_model()
  _, first_carry = family.forward(model, params, batch, carry, rngs={}, deterministic=True)
  outputs, carry = family.forward(model, params, batch, first_carry, rngs={}, deterministic=True)
  # The second step attends to the first step's states, as the model does when given them.
  # Memory = last mem_len of [8 zero states, this segment's first reuse_len = 6 states].
  first_mems = np.asarray(first_carry["mems"])
  assert not first_mems[:, :, :2].any() and np.abs(first_mems[:, :, 2:]).min(axis=-1).all()
  reference = XLNetLMHeadModel(SMALL).apply({"params": params}, batch, mems=first_carry["mems"])
  np.testing.assert_allclose(outputs["logits"], reference["logits"], atol=1e-5)
  np.testing.assert_allclose(carry["mems"], reference["new_mems"], atol=1e-5)

  loss, metrics = family.loss_and_metrics(outputs, batch)
  logits = np.asarray(outputs["logits"], np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  picked = np.take_along_axis(log_probs, batch["target_ids"][..., None], -1)[..., 0]
  expected = -(picked * batch["target_weights"]).sum() / batch["target_weights"].sum()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  assert set(metrics) == {"plm_loss", "plm_accuracy"}


@pytest.mark.parametrize("columns,width", [(20, 9), (16, 9), (9, 9), (1407, 896)])
def test_shift_rows_takes_each_rows_window_and_puts_the_gradient_back(columns, width):
  """shift_rows (the query stream's per-row relative shift, in stages of the start's digits, with its own gradient)
  against a gather of each row's window; starts cover 0 and the largest allowed."""
  import jax.numpy as jnp

  from models.xlnet import shift_rows
  scores = jax.random.normal(jax.random.key(0), (2, 3, 7, columns))
  starts = jax.random.randint(jax.random.key(1), (2, 7), 0, columns - width + 1).at[0, :2].set(
      jnp.array([0, columns - width]))
  window = starts[:, None, :, None] + jnp.arange(width)
  cotangent = jax.random.normal(jax.random.key(2), (2, 3, 7, width))
  ours, ours_vjp = jax.vjp(lambda x: shift_rows(x, starts, width), scores)
  gathered, gathered_vjp = jax.vjp(lambda x: jnp.take_along_axis(x, window, axis=-1), scores)
  np.testing.assert_array_equal(ours, gathered)
  np.testing.assert_array_equal(ours_vjp(cotangent)[0], gathered_vjp(cotangent)[0])


LONG = dataclasses.replace(SMALL, n_layer=1, n_head=2, d_head=16, mem_len=64, reuse_len=32, bi_data=True)


def long_features(rng, num_predict):
  """2 rows of 64 tokens (lengths the Triton kernel tiles) with `num_predict` prediction rows, one padding."""
  return plm_features(rng, 2, [num_predict - 1] * 2, seq=64, num_predict=num_predict)


@pytest.mark.parametrize("num_predict", [64, 20], ids=["both streams in the kernel", "query stream in XLA"])
def test_the_triton_kernel_with_a_bias_computes_what_xla_does(num_predict):
  """attention_implementation='triton' (the kernel interpreted on the CPU) against 'xla', deterministic: the
  logits, the new memory and every parameter's gradient. 20 predictions do not tile: that stream stays XLA's."""
  rng = np.random.default_rng(6)
  features, mems = long_features(rng, num_predict), rng.standard_normal((2, 1, 64, 32)).astype(np.float32)
  models = {name: XLNetLMHeadModel(dataclasses.replace(LONG, attention_implementation=name))
            for name in ("xla", "triton")}
  params = nn.unbox(models["xla"].init(jax.random.PRNGKey(0), features)["params"])
  weights = rng.standard_normal((2, num_predict, LONG.vocab_size)).astype(np.float32)

  def run(name):
    def loss(params):
      out = models[name].apply({"params": params}, features, mems=mems)
      return (out["logits"] * weights).sum(), out
    return jax.jit(jax.grad(loss, has_aux=True))(params)

  (grads, out), (xla_grads, xla_out) = run("triton"), run("xla")
  np.testing.assert_allclose(out["logits"], xla_out["logits"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out["new_mems"], xla_out["new_mems"], rtol=1e-5, atol=1e-5)
  for path, grad in jax.tree_util.tree_flatten_with_path(grads)[0]:
    np.testing.assert_allclose(grad, dict(jax.tree_util.tree_flatten_with_path(xla_grads)[0])[path], rtol=1e-3,
                               atol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_the_triton_kernel_drops_out_attention_in_training():
  rng = np.random.default_rng(7)
  features = long_features(rng, 64)
  model = XLNetLMHeadModel(dataclasses.replace(LONG, attention_implementation="triton", dropout_rate=0.1))
  params = model.init(jax.random.PRNGKey(0), features)["params"]
  logits = [np.asarray(model.apply({"params": params}, features, deterministic=False,
                                   rngs={"dropout": jax.random.PRNGKey(seed)})["logits"]) for seed in (1, 1, 2)]
  assert np.isfinite(logits[0]).all() and np.array_equal(logits[0], logits[1])
  assert not np.allclose(logits[0], logits[2])


def test_xlnet_attention_takes_its_own_implementations():
  with pytest.raises(ValueError, match="attention_implementation='cudnn': expected one of auto, xla, triton"):
    XLNetConfig(attention_implementation="cudnn")
  device = jax.devices()[0]
  assert XLNetFamily(SMALL).for_device(device).config.attention_implementation == "xla"  # 'auto'
  triton = XLNetFamily(dataclasses.replace(SMALL, attention_implementation="triton"))
  assert triton.for_device(device).config.attention_implementation == "triton"  # a CPU interprets it


def test_attentions_backward_pass_reads_the_probabilities_as_written_on_gpus_only():
  """A GPU's 'auto' puts the barrier in (XLA kept fp32 exponentials otherwise), a TPU's leaves XLA to choose (the
  barrier made the v3-512 plan slower); a choice made is kept whatever the chip, and an unknown one refused."""
  import types
  chip = lambda platform, kind: types.SimpleNamespace(platform=platform, device_kind=kind,  # noqa: E731
                                                      compute_capability="9.0")
  family = XLNetFamily(SMALL)
  assert family.for_device(chip("gpu", "NVIDIA H200")).config.attention_probs_kept == "written"
  for tpu in ("TPU v3", "TPU v5 lite"):
    assert family.for_device(chip("tpu", tpu)).config.attention_probs_kept == "xla"
  chosen = XLNetFamily(dataclasses.replace(SMALL, attention_probs_kept="written"))
  assert chosen.for_device(chip("tpu", "TPU v3")).config.attention_probs_kept == "written"
  with pytest.raises(ValueError, match="attention_probs_kept='kept': expected one of auto, written, xla"):
    XLNetConfig(attention_probs_kept="kept")
