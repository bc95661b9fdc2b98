"""Scanned layer stacks (`scan_layers=True`) compute what unrolled layers compute, from the same
weights: outputs and gradients of every family agree, the weights convert between the two layouts
without loss, stacked weights carry the "layers" axis, and LAMB's trust ratio stays per layer."""
import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers
from models.albert import AlbertConfig
from models.bart import BartConfig
from models.bert import BertConfig
from models.xlnet import XLNetConfig
from pretrain import optimizers, registry
from pretrain.hf_mappings.common import flatten_params, unflatten_params

VOCAB = 96
CONFIGS = {
    "bert": ("bert", BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, mlp_dim=64)),
    "albert_shared": ("albert", AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_layers=3,
                                             num_heads=4, mlp_dim=64)),
    "albert_unshared": ("albert", AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_layers=3,
                                               num_heads=4, mlp_dim=64, share="none")),
    "bart": ("bart", BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, num_heads=4,
                                ffn_dim=64)),
    "xlnet": ("xlnet", XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=3, n_head=4, d_head=8, d_inner=64,
                                   mem_len=6, reuse_len=8)),
}


def family_inputs(family: str, config):
  """The registry's check batch, plus memory for XLNet (so the per-layer memory slices are exercised)."""
  features = registry.get(family).check_batch(config).features
  if family != "xlnet":
    return features, {}
  mems = np.random.default_rng(1).normal(size=(2, config.n_layer, config.mem_len, config.d_model))
  return features, {"mems": jnp.asarray(mems, jnp.float32)}


def squared_outputs(model, params, features, extra):
  outputs = model.apply({"params": params}, features, **extra)
  return sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(outputs)), outputs


def outputs_and_grads(model, params, features, extra):
  """((sum of squared outputs, outputs), gradients w.r.t. params), jitted: one program, not an op at a time."""
  return jax.jit(jax.value_and_grad(functools.partial(squared_outputs, model), has_aux=True))(params, features, extra)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
  family, config = CONFIGS[request.param]
  spec = registry.get(family)
  scanned_config = dataclasses.replace(config, scan_layers=True)
  features, extra = family_inputs(family, config)
  unrolled = spec.family_cls(config=config).make_model()
  params = nn.unbox(jax.jit(lambda key: unrolled.init(key, features, **extra))(jax.random.PRNGKey(0))["params"])
  params = jax.tree.map(np.asarray, params)
  return dict(name=request.param, spec=spec, config=config, scanned_config=scanned_config, features=features,
              extra=extra, unrolled=unrolled, params=params,
              scanned=spec.family_cls(config=scanned_config).make_model(),
              scanned_params=layers.stack_layer_params(params))


def test_scanned_stack_gives_the_unrolled_outputs_and_gradients(case):
  (_, unrolled_out), unrolled_grads = outputs_and_grads(case["unrolled"], case["params"], case["features"],
                                                        case["extra"])
  (_, scanned_out), scanned_grads = outputs_and_grads(case["scanned"], case["scanned_params"], case["features"],
                                                      case["extra"])
  for key in unrolled_out:
    np.testing.assert_allclose(scanned_out[key], unrolled_out[key], rtol=1e-5, atol=1e-5, err_msg=key)
  # Gradients compared in the unrolled layout: every layer's slice against that layer's weights.
  assert_trees_close(layers.unstack_layer_params(scanned_grads), unrolled_grads)


def assert_trees_close(actual, expected, rtol=1e-5):
  """Leaf by leaf, to rtol of the largest magnitude in the whole tree: some gradients are zero in
  exact arithmetic (a key bias under softmax) and hold only rounding noise."""
  actual, expected = flatten_params(jax.device_get(actual)), flatten_params(jax.device_get(expected))
  assert actual.keys() == expected.keys()
  atol = rtol * max(np.abs(value).max() for value in expected.values())
  for path in expected:
    np.testing.assert_allclose(actual[path], expected[path], rtol=rtol, atol=atol, err_msg=path)


def test_remat_inside_the_scan_keeps_the_outputs(case):
  remat = dataclasses.replace(case["scanned_config"], remat_policy="full")
  model = case["spec"].family_cls(config=remat).make_model()
  _, grad = outputs_and_grads(model, case["scanned_params"], case["features"], case["extra"])
  _, plain = outputs_and_grads(case["scanned"], case["scanned_params"], case["features"], case["extra"])
  assert_trees_close(grad, plain)


def test_layouts_convert_without_loss_and_stacks_carry_the_layers_axis(case):
  config = case["config"]
  back = flatten_params(layers.unstack_layer_params(case["scanned_params"]))
  original = flatten_params(case["params"])
  assert back.keys() == original.keys() and all(np.array_equal(back[k], original[k]) for k in original)

  boxed = jax.eval_shape(lambda: case["scanned"].init(jax.random.PRNGKey(0), case["features"], **case["extra"]))
  specs = flatten_params(jax.tree.map(lambda s: np.array(tuple(s), dtype=object), nn.get_partition_spec(boxed),
                                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))["params"])
  scanned = flatten_params(case["scanned_params"])
  assert {path: value.shape for path, value in scanned.items()} == case["spec"].param_shapes(case["scanned_config"])
  stacked = [path for path in scanned if "/layers/" in f"/{path}"]
  if case["name"] == "albert_shared":  # one shared layer: the same params whichever way it runs
    assert not stacked and scanned.keys() == original.keys()
    return
  assert stacked and not any(re.search(r"layer_\d", path) for path in scanned)
  for path in stacked:
    assert scanned[path].shape[0] == stack_depth(config, path), path
    assert specs[path][0] == "layers", (path, specs[path])


def stack_depth(config, path: str) -> int:
  if isinstance(config, BartConfig):
    return config.encoder_layers if path.startswith("encoder/") else config.decoder_layers
  return config.n_layer if isinstance(config, XLNetConfig) else config.num_layers


def test_lamb_trust_ratio_is_per_layer_in_a_scanned_stack(case):
  """One LAMB update from the same weights and gradients agrees in both layouts. Gradients grow with
  depth, so a ratio over a whole stack would give each layer a ratio other than its own."""
  rng = np.random.default_rng(2)
  grads = {path: rng.normal(size=value.shape).astype(np.float32) * 4.0 ** layer_index(path)
           for path, value in flatten_params(case["params"]).items()}
  grads = unflatten_params(grads)
  optimizer = optimizers.make_optimizer(lambda step: 1e-3, name="lamb", clip_norm=0.0)

  @jax.jit
  def one_update(params, grads):
    return optimizer.update(grads, optimizer.init(params), params)[0]

  unrolled = one_update(case["params"], grads)
  scanned = one_update(case["scanned_params"], layers.stack_layer_params(grads))
  assert_trees_close(layers.unstack_layer_params(scanned), unrolled)


def layer_index(path: str) -> int:
  match = re.search(r"layer_(\d+)", path)
  return int(match.group(1)) if match else 0


def test_albert_scans_only_whole_layer_sharing():
  with pytest.raises(ValueError, match="scan_layers=True needs share in"):
    AlbertConfig(share="attention", scan_layers=True)


# Each family's sizes (a width or count of 0 trained, then could not be saved) and dropout rates (at 1 or more
# every update is not finite).
SIZES_AND_RATES = {
    BertConfig: (("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim", "max_position_embeddings",
                  "type_vocab_size"), ("dropout_rate", "attention_dropout")),
    AlbertConfig: (("vocab_size", "embedding_size", "hidden_size", "num_layers", "num_heads", "mlp_dim",
                    "max_position_embeddings", "type_vocab_size"), ("dropout_rate", "attention_dropout")),
    XLNetConfig: (("vocab_size", "d_model", "n_layer", "n_head", "d_head", "d_inner"), ("dropout_rate",)),
    BartConfig: (("vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads", "ffn_dim",
                  "max_position_embeddings"), ("dropout_rate", "attention_dropout", "activation_dropout")),
}


@pytest.mark.parametrize("config_class", SIZES_AND_RATES, ids=lambda c: c.__name__)
def test_a_config_refuses_a_size_of_0_and_a_rate_outside_0_to_1_naming_the_field(config_class):
  sizes, rates = SIZES_AND_RATES[config_class]
  assert {f.name for f in dataclasses.fields(config_class) if f.type is int and f.name not in sizes} <= {
      "mem_len", "clamp_len"}  # every other whole-number field is a size
  for name in sizes:
    with pytest.raises(ValueError, match=f"^{name}=0: must be at least 1$"):
      config_class(**{name: 0})
  for name, rate in ((name, rate) for name in rates for rate in (-0.1, 1.0)):
    with pytest.raises(ValueError, match=f"^{name}={rate}: must be at least 0 and below 1$"):
      config_class(**{name: rate})
  config_class(**{name: 0.0 for name in rates}, vocab_size=None)  # no dropout; the run's vocabulary size


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_by_formula_keeps_only_its_input_for_the_backward_pass_and_gives_flaxs_gradient(approximate, capsys):
  from jax import ad_checkpoint
  x = jnp.linspace(-6.0, 6.0, 64 * 64).reshape(64, 64)

  def kept_of_x_size(function) -> list:
    ad_checkpoint.print_saved_residuals(lambda x: function(x).sum(), x)
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("f32[64,64]")]

  by_formula = functools.partial(layers.gelu, approximate=approximate)
  by_autodiff = functools.partial(layers.gelu, approximate=approximate, gradient="autodiff")
  flaxs = functools.partial(nn.gelu, approximate=approximate)
  assert kept_of_x_size(by_formula) == ["f32[64,64] from the argument x"]
  assert len(kept_of_x_size(by_autodiff)) >= 3  # erfc's and exp's outputs and a product (tanh: more)
  np.testing.assert_array_equal(by_formula(x), flaxs(x))
  np.testing.assert_array_equal(by_autodiff(x), flaxs(x))
  flaxs_grad = jax.grad(lambda x: flaxs(x).sum())(x)
  np.testing.assert_array_equal(jax.grad(lambda x: by_autodiff(x).sum())(x), flaxs_grad)
  # Differentiated by formula, not by autodiff: fp32's rounding differs where 1 + tanh cancels (x near -6).
  np.testing.assert_allclose(jax.grad(lambda x: by_formula(x).sum())(x), flaxs_grad, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="gelu_gradient='checkpoint'"):
    layers.gelu(x, approximate, "checkpoint")


# GELUs with a backward pass in each test model: one per FFN and BERT's and ALBERT's MLM head. XLNet's FFN serves
# both streams, but its logits come from the query stream, so the last layer's content stream has no gradient.
GELUS = {"bert": 3 + 1, "albert_shared": 3 + 1, "albert_unshared": 3 + 1, "bart": 2 + 3, "xlnet": 3 * 2 - 1}


def test_a_models_gelu_gradient_setting_reaches_every_gelu(case):
  """Each GELU differentiated by formula puts one optimization barrier in the backward pass; by autodiff, none
  (their values are compared above)."""
  def barriers(gelu_gradient: str) -> int:
    config = dataclasses.replace(case["config"], gelu_gradient=gelu_gradient)
    model = case["spec"].family_cls(config=config).make_model()
    step = jax.value_and_grad(functools.partial(squared_outputs, model), has_aux=True)
    return str(jax.make_jaxpr(step)(case["params"], case["features"], case["extra"])).count("optimization_barrier")

  assert barriers("formula") - barriers("autodiff") == GELUS[case["name"]]


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_in_bf16_is_the_fp32_gelu_and_gradient_rounded_once(approximate):
  x = jnp.linspace(-6.0, 6.0, 64 * 64).reshape(64, 64).astype(jnp.bfloat16)
  exact = functools.partial(nn.gelu, approximate=approximate)
  grad_of = lambda f, x: jax.grad(lambda x: f(x).astype(jnp.float32).sum())(x)
  ours = functools.partial(layers.gelu, approximate=approximate)
  np.testing.assert_array_equal(ours(x), exact(x.astype(jnp.float32)).astype(jnp.bfloat16))
  # Within one rounding of fp32's gradient, which the formula gives (test above) to about 1e-6.
  np.testing.assert_allclose(np.asarray(grad_of(ours, x), np.float32), grad_of(exact, x.astype(jnp.float32)),
                             rtol=2 ** -8, atol=1e-6)
