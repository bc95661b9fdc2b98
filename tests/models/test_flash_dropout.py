"""models/flash_dropout.py: the GPU attention kernels with probability dropout, run in Pallas's interpreter.

Their values and gradients are checked against XLA's attention given the kernels' own keep-or-drop decisions
(`reference_attention`, with models/dropout.py's hashed masks, whose statistics tests/models/test_dropout.py
measures). The
kernels are also lowered for an NVIDIA GPU (to Triton's IR), which needs no GPU."""
import json
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import flash_dropout


def seed(n: int) -> jax.Array:
  return jax.random.bits(jax.random.key(n), (2,), jnp.uint32)


CASES = {  # name: (query length, key length, real key lengths, causal, rate)
    "self-attention, no dropout": (128, 128, (128, 128), False, 0.0),
    "padded keys, the recipe's dropout": (128, 192, (150, 192), False, 0.1),
    "causal, heavy dropout": (128, 128, (128, 100), True, 0.3),
    "causal, longer": (256, 256, (256, 200), True, 0.1),
}
# Tiles that differ in queries and keys: a causal loop then stops inside a key block, or starts inside a query block.
OTHER_TILINGS = [flash_dropout.Tiling(128, 64, 8, 2), flash_dropout.Tiling(64, 128, 4, 3)]


@pytest.mark.parametrize("case,tiling", [pytest.param(case, tiling, id=f"{case}, tiles {tiling}") for case, tiling in
                                         [(case, flash_dropout.TILING) for case in sorted(CASES)]
                                         + [("causal, longer", tiling) for tiling in OTHER_TILINGS]])
def test_values_and_gradients_match_xla_with_the_same_decisions(case, tiling):
  query_length, key_length, real, causal, rate = CASES[case]
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 32)), jnp.float32)
             for length in (query_length, key_length, key_length))
  key_valid = (jnp.arange(key_length)[None, :] < jnp.asarray(real)[:, None]).astype(jnp.int32)
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  kernel_seed = seed(3)

  def loss(attend):
    return lambda q, k, v: (attend(q, k, v) * weights).sum()

  fused = lambda q, k, v: flash_dropout.attention(q, k, v, key_valid=key_valid, causal=causal, rate=rate,
                                                  seed=kernel_seed, tiling=tiling)
  ours, our_grads = jax.block_until_ready(jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 1, 2)))(q, k, v))
  xla = lambda q, k, v: flash_dropout.reference_attention(q, k, v, key_valid=key_valid, causal=causal, rate=rate,
                                                          seed=kernel_seed)
  value, grads = jax.value_and_grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(ours, value, rtol=1e-5, atol=1e-4)
  for our_grad, grad in zip(our_grads, grads):
    np.testing.assert_allclose(our_grad, grad, rtol=1e-4, atol=1e-5)
  if rate:  # the decisions mattered: without them the values differ
    undropped = lambda q, k, v: flash_dropout.reference_attention(q, k, v, key_valid=key_valid, causal=causal)
    assert not np.allclose(ours, loss(undropped)(q, k, v))


@pytest.mark.parametrize("tiling", [flash_dropout.TILING, OTHER_TILINGS[0]], ids=str)
def test_an_additive_bias_and_its_gradient_match_xla_with_the_same_decisions(tiling):
  """XLNet's use: position scores as a bias [batch, heads, q, k], its attention mask in it as MASKED_SCORE (one
  row wholly masked, as the query stream's unpredicted rows are), with dropout; the bias's gradient too."""
  rng = np.random.default_rng(2)
  batch, heads, length, keys = 2, 2, 128, 256
  q = jnp.asarray(rng.normal(size=(batch, length, heads, 32)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, keys, heads, 32)), jnp.float32) for _ in range(2))
  blocked = rng.random((batch, 1, length, keys)) < 0.3
  blocked[0, :, 5] = True
  bias = jnp.where(blocked, flash_dropout.MASKED_SCORE, jnp.asarray(rng.normal(size=(batch, heads, length, keys)),
                                                                     jnp.float32))
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(attend):
    return lambda q, k, v, bias: (attend(q, k, v, bias) * weights).sum()

  options = dict(key_valid=jnp.ones((batch, keys), jnp.int32), rate=0.1, seed=seed(4))
  fused = lambda q, k, v, bias: flash_dropout.attention(q, k, v, bias=bias, tiling=tiling, **options)
  ours, our_grads = jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  xla = lambda q, k, v, bias: flash_dropout.reference_attention(q, k, v, bias=bias, **options)
  value, grads = jax.value_and_grad(loss(xla), argnums=(0, 1, 2, 3))(q, k, v, bias)
  np.testing.assert_allclose(ours, value, rtol=1e-5, atol=1e-4)
  for our_grad, grad in zip(our_grads, grads):
    np.testing.assert_allclose(our_grad, grad, rtol=1e-4, atol=1e-5)
  partly_blocked = blocked.repeat(heads, axis=1)
  partly_blocked[0, :, 5] = False  # the wholly masked row attends uniformly, so each of its keys has a gradient
  d_bias = np.asarray(our_grads[3])
  assert np.all(d_bias[partly_blocked] == 0) and np.abs(d_bias).max() > 1e-3


def test_a_bias_of_another_shape_or_with_causal_is_refused():
  q = jnp.zeros((2, 128, 2, 32))
  with pytest.raises(ValueError, match=r"a bias must be \[batch, heads, queries, keys\] = \[2, 2, 128, 128\]"):
    flash_dropout.attention(q, q, q, bias=jnp.zeros((2, 128, 2, 128)))
  with pytest.raises(ValueError, match="without causal"):
    flash_dropout.attention(q, q, q, bias=jnp.zeros((2, 2, 128, 128)), causal=True)


def test_a_tiling_is_written_as_it_is_read_and_bad_ones_are_refused():
  tiling = flash_dropout.Tiling(128, 64, 8, 3)
  assert flash_dropout.Tiling.parse(str(tiling)) == tiling
  with pytest.raises(ValueError, match="expected QUERIESxKEYS/WARPS/STAGES"):
    flash_dropout.Tiling.parse("128x64")
  assert flash_dropout.applies(128, 128, 64, tiling) and not flash_dropout.applies(192, 128, 64, tiling)


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 2, 64)), jnp.float32) for _ in range(3))
  out = flash_dropout.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), rate=0.1, seed=seed(0))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), flash_dropout.attention(q, k, v, rate=0.1, seed=seed(0)),
                             atol=0.05)


def test_each_device_of_a_mesh_draws_its_own_decisions():
  rate, shape = 0.1, (4, 8, 128, 128)
  first = np.asarray(flash_dropout.keep_mask(seed(0), shape, rate))
  other_device = np.asarray(flash_dropout.keep_mask(flash_dropout.fold_in(seed(0), 1), shape, rate))
  agree = (1 - rate) ** 2 + rate**2  # two independent decisions agree this often
  assert abs((first == other_device).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / first.size)


def test_kernels_lower_to_triton_for_an_nvidia_gpu(tmp_path):
  # benchmarks/triton_offline.py's first half: JAX lowers the forward and both backward kernels for a GPU and
  # the script writes each as Triton IR (its second half, Triton's compile to PTX, needs the triton package).
  lower = runpy.run_path("benchmarks/triton_offline.py")["lower"]
  lower(str(tmp_path), batch=4, length=512, heads=16, head_dim=64, rate=0.1)  # BERT-Large's attention
  for name in ("_forward_kernel", "_dkv_kernel", "_dq_kernel"):
    ir = (tmp_path / f"{name}.ttir").read_text()
    assert f"tt.func public @{name}" in ir and "tt.dot" in ir
    assert "arith.cmpi uge" in ir  # the keep-or-drop decision compares the hash's bits unsigned
    assert json.loads((tmp_path / f"{name}.json").read_text()) == {"num_warps": 4, "num_stages": 2}


def test_shapes_the_kernels_do_not_tile_are_refused():
  assert flash_dropout.applies(512, 512, 64) and not flash_dropout.applies(500, 512, 64)
  assert not flash_dropout.applies(512, 512, 48) and not flash_dropout.applies(512, 512, 8)
  q = jnp.zeros((1, 100, 2, 32))
  with pytest.raises(ValueError, match="multiples of 64"):
    flash_dropout.attention(q, q, q)
  with pytest.raises(ValueError, match="needs a seed"):
    flash_dropout.attention(jnp.zeros((1, 64, 2, 32)), jnp.zeros((1, 64, 2, 32)), jnp.zeros((1, 64, 2, 32)),
                            rate=0.1)
