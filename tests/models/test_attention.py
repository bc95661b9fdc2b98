"""The attention implementations (`layers.dot_product_attention`) compute what XLA's attention computes.

cuDNN's kernel needs an NVIDIA GPU: here its arguments (padding as sequence lengths, causal) go to the
same jax.nn.dot_product_attention with implementation='xla', which must match ours at every real
position. The Pallas kernels run in Pallas's interpreters (TPU flash attention in its TPU interpret mode, splash
attention and the GPU kernel of models/flash_dropout.py in its generic one), values and gradients."""
import contextlib
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from models import layers
from models.dropout import Dropout

BATCH, LENGTH, HEADS, HEAD_DIM = 2, 128, 2, 32
REAL_LENGTHS = np.array([128, 77])  # the second row ends in padding


def qkv(seed: int = 0, key_length: int = LENGTH):
  rng = np.random.default_rng(seed)
  shape = lambda length: (BATCH, length, HEADS, HEAD_DIM)
  return (jnp.asarray(rng.normal(size=shape(LENGTH)), jnp.float32),
          jnp.asarray(rng.normal(size=shape(key_length)), jnp.float32),
          jnp.asarray(rng.normal(size=shape(key_length)), jnp.float32))


def valid(length: int = LENGTH) -> jax.Array:
  return jnp.arange(length)[None, :] < REAL_LENGTHS[:, None]


MASKS = {
    "padded self-attention": (layers.AttentionMask(query_valid=valid(), key_valid=valid()), valid()),
    "causal": (layers.AttentionMask(causal=True), jnp.ones((BATCH, LENGTH), bool)),
    "cross-attention over padded keys": (layers.AttentionMask(key_valid=valid()), jnp.ones((BATCH, LENGTH), bool)),
}


def xla_attention(q, k, v, mask, implementation="xla", dropout_rate=0.0, deterministic=True, rng=0):
  dropout = Dropout(dropout_rate)
  return dropout.apply({}, method=lambda module: layers.dot_product_attention(
      q, k, v, mask, implementation=implementation, dropout=module, deterministic=deterministic),
                       rngs={"dropout": jax.random.PRNGKey(rng)})


@pytest.mark.parametrize("case", sorted(MASKS))
def test_cudnn_arguments_give_our_attention(case):
  mask, real_queries = MASKS[case]
  q, k, v = qkv()
  ours = xla_attention(q, k, v, mask)
  lengths = lambda v: None if v is None else v.sum(-1).astype(jnp.int32)
  # What _cudnn_attention passes, computed by jax's reference implementation of the same call.
  fused = jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, query_seq_lengths=lengths(mask.query_valid),
                                       key_value_seq_lengths=lengths(mask.key_valid), implementation="xla")
  np.testing.assert_allclose(np.asarray(fused)[np.asarray(real_queries)], np.asarray(ours)[np.asarray(real_queries)],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(MASKS))
@pytest.mark.parametrize("kernel", ["pallas", "splash", "triton"])
def test_pallas_kernels_match_xla_values_and_gradients(kernel, case, monkeypatch):
  interpreted = pltpu.force_tpu_interpret_mode()
  if kernel == "triton":  # the GPU kernel runs in Pallas's generic interpreter on a CPU by itself
    interpreted = contextlib.nullcontext()
  if kernel == "splash":
    # Pallas's TPU interpreter cannot run a kernel vmapped over the batch (its grid then has one dimension
    # more than the kernel's dimension semantics); its generic interpreter runs the same kernel.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    monkeypatch.setattr(splash, "make_splash_mha", functools.partial(splash.make_splash_mha, interpret=True))
    interpreted = contextlib.nullcontext()
  mask, real_queries = MASKS[case]
  q, k, v = qkv(1)
  weights = jnp.asarray(real_queries, jnp.float32)[:, :, None, None]  # the loss reads real positions only

  def loss(implementation):
    return lambda q, k, v: (xla_attention(q, k, v, mask, implementation) * weights).sum()

  # Jitted and waited for: the interpreter runs JAX ops in callbacks from inside the program, and eager ops
  # dispatched meanwhile (an eager backward pass) can queue behind it and deadlock.
  with interpreted:
    fused_value, fused_grads = jax.block_until_ready(
        jax.jit(jax.value_and_grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v))
  value, grads = jax.value_and_grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(fused_value, value, rtol=1e-4)
  for fused_grad, grad in zip(fused_grads, grads):
    np.testing.assert_allclose(fused_grad, grad, rtol=1e-3, atol=1e-4)


def test_probability_dropout_in_training_runs_xla_attention_whatever_is_chosen():
  q, k, v = qkv()
  mask = MASKS["padded self-attention"][0]
  # On a CPU, the cuDNN kernel would fail to lower: the program must not contain it.
  dropped = xla_attention(q, k, v, mask, "cudnn", dropout_rate=0.5, deterministic=False, rng=3)
  np.testing.assert_array_equal(dropped, xla_attention(q, k, v, mask, "xla", 0.5, deterministic=False, rng=3))
  assert not np.allclose(dropped, xla_attention(q, k, v, mask))  # the dropout was applied
  assert not layers.fused_attention_applies("cudnn", dtype=jnp.bfloat16, head_dim=64, query_length=512,
                                            key_length=512, dropout_rate=0.1, deterministic=False)
  assert layers.fused_attention_applies("cudnn", dtype=jnp.bfloat16, head_dim=64, query_length=512,
                                        key_length=512, dropout_rate=0.1, deterministic=True)
  assert not layers.fused_attention_applies("cudnn", dtype=jnp.float32, head_dim=64, query_length=512,
                                            key_length=512, dropout_rate=0.0, deterministic=True)


def test_triton_drops_probabilities_in_training_from_the_layers_dropout_rng():
  q, k, v = qkv()
  mask, real_queries = MASKS["padded self-attention"]
  real = np.asarray(real_queries)
  train = lambda rng: np.asarray(xla_attention(q, k, v, mask, "triton", 0.3, deterministic=False, rng=rng))
  first, again, other = train(3), train(3), train(4)
  np.testing.assert_array_equal(first, again)  # the seed comes from the rng: a step's masks are reproducible
  assert not np.allclose(first[real], other[real])
  evaluated = np.asarray(xla_attention(q, k, v, mask, "triton", 0.3, deterministic=True))
  np.testing.assert_allclose(evaluated[real], np.asarray(xla_attention(q, k, v, mask))[real], rtol=1e-5, atol=1e-5)
  assert not np.allclose(first[real], evaluated[real])
  assert layers.fused_attention_applies("triton", dtype=jnp.bfloat16, head_dim=64, query_length=512,
                                        key_length=512, dropout_rate=0.1, deterministic=False)


def device(platform, kind, compute_capability=None):
  return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=compute_capability)


@pytest.mark.parametrize("chip, expected", [
    (device("gpu", "NVIDIA H200", "9.0"), "cudnn"),
    (device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "cudnn"),
    (device("gpu", "Tesla V100-SXM2-16GB", "7.0"), "xla"),
    (device("tpu", "TPU v2"), "xla"),
    (device("tpu", "TPU v3"), "xla"),  # Mosaic has no bf16 x bf16 -> fp32 matmul there
    (device("tpu", "TPU v4"), "splash"),
    (device("tpu", "TPU v5 lite"), "splash"),
    (device("tpu", "TPU v6 lite"), "splash"),
    (device("cpu", "cpu"), "xla"),
])
def test_auto_picks_the_chips_fused_kernel(chip, expected):
  assert layers.attention_for_device(chip) == expected


def test_a_family_resolves_auto_for_the_chip_it_compiles_for_and_refuses_unknown_names():
  import dataclasses

  from models.bert import BertConfig
  from pretrain.errors import ConfigError
  from pretrain.families.bert import BertFamily
  family = BertFamily(config=BertConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32))
  on_gpu = family.for_device(device("gpu", "NVIDIA H100 80GB HBM3", "9.0")).config
  on_tpu, on_cpu = family.for_device(device("tpu", "TPU v3")).config, family.for_device(device("cpu", "cpu")).config
  assert (on_gpu.attention_implementation, on_gpu.dropout_masks) == ("cudnn", "bernoulli")
  assert (on_tpu.attention_implementation, on_tpu.dropout_masks) == ("xla", "bernoulli")
  assert (on_cpu.attention_implementation, on_cpu.dropout_masks) == ("xla", "hashed")
  chosen = dataclasses.replace(family, config=dataclasses.replace(family.config, dropout_masks="bernoulli"))
  assert chosen.for_device(device("cpu", "cpu")).config.dropout_masks == "bernoulli"  # a choice is kept
  for kernel, chip in (("cudnn", device("cpu", "cpu")), ("splash", device("gpu", "NVIDIA H100 80GB HBM3", "9.0")),
                       ("triton", device("tpu", "TPU v4"))):  # a kernel the chip cannot run: one line, not a trace
    with pytest.raises(ConfigError, match=f"attention_implementation='{kernel}' needs .*, not {chip.device_kind}"):
      dataclasses.replace(family, config=dataclasses.replace(family.config, attention_implementation=kernel)
                          ).for_device(chip)
  triton_on_cpu = dataclasses.replace(family.config, attention_implementation="triton")
  on_cpu = dataclasses.replace(family, config=triton_on_cpu).for_device(device("cpu", "cpu")).config
  assert on_cpu.attention_implementation == "triton"
  for name, value in (("attention_implementation", "flash"), ("dropout_masks", "philox"),
                      ("gelu_gradient", "checkpoint")):
    with pytest.raises(ConfigError, match=f"{name}='{value}'"):
      dataclasses.replace(family, config=dataclasses.replace(family.config, **{name: value})
                          ).for_device(device("cpu", "cpu"))
