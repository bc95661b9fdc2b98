"""Building blocks shared by the model families, with logical axis names on every array.

Parameter axes: vocab, embed, hidden (the output side of a square embed->embed matrix), heads, kv,
mlp, position, token_type, layers.
Activation axes: activation_batch, activation_length, activation_embed, activation_heads,
activation_kv, activation_mlp, activation_vocab. `pretrain/partitioning.py` maps both onto the
mesh; a model never names a mesh axis itself.
"""
import functools
import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import flash_dropout
from models.dropout import Dropout

Dtype = Any
Initializer = Callable[..., jax.Array]

BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")
BATCH_LENGTH_HEADS_KV = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
BATCH_LENGTH_MLP = ("activation_batch", "activation_length", "activation_mlp")
BATCH_LENGTH_VOCAB = ("activation_batch", "activation_length", "activation_vocab")

# BERT-family initialisation: truncated normal with standard deviation 0.02.
default_kernel_init = nn.initializers.truncated_normal(0.02)


def with_axes(init: Initializer, axes: Sequence[Optional[str]]) -> Initializer:
  return nn.with_logical_partitioning(init, tuple(axes))


def constrain(x: jax.Array, axes: Sequence[Optional[str]]) -> jax.Array:
  """Sharding hint for an activation; a no-op outside a mesh context."""
  return nn.with_logical_constraint(x, tuple(axes))


GELU_GRADIENTS = ("formula", "autodiff")


def gelu(x: jax.Array, approximate: bool = False, gradient: str = "formula") -> jax.Array:
  """The GELU of x, in x's dtype; `gradient` chooses how, and what the backward pass keeps.

  'formula': nn.gelu computed in fp32 and rounded once, whose backward pass keeps only the input and writes the
  slope out (`_gelu_by_formula`). 'autodiff': flax's nn.gelu in x's dtype, differentiated by JAX, which keeps
  three arrays of the input's size (five with tanh) unless XLA fuses them away. The input is an FFN's widest
  activation: BERT-Large at batch 32, planned for one H200, keeps 5.9 GiB more by autodiff in a 23.7 GiB step.
  Yet XLNet-Large's v4-128 plan and BART-large's v5litepod-256 plan are better by autodiff (benchmarks/README.md,
  "Which GELU gradient"), so a run chooses.
  """
  # Exact (erf) GELU: fairseq BART and HF's "gelu". The TF reference code of BERT, ALBERT and XLNet
  # uses the tanh approximation (HF "gelu_new"): approximate=True.
  if gradient == "formula":
    return _gelu_by_formula(x, approximate)
  if gradient == "autodiff":
    return nn.gelu(x, approximate=approximate)
  raise ValueError(f"gelu_gradient={gradient!r}: expected one of {', '.join(GELU_GRADIENTS)}")


def _gelu_fp32(x: jax.Array, approximate: bool) -> jax.Array:
  return nn.gelu(x.astype(jnp.float32), approximate=approximate).astype(x.dtype)


_gelu_by_formula = jax.custom_vjp(_gelu_fp32, nondiff_argnums=(1,))


def _gelu_forward(x: jax.Array, approximate: bool) -> tuple:
  return _gelu_fp32(x, approximate), x


def _gelu_backward(approximate: bool, x: jax.Array, cotangent: jax.Array) -> tuple:
  # The barrier keeps XLA from computing the slope in the forward pass's fusion, beside the GELU, and keeping
  # it in fp32 instead of x (BART-large on a v4-128: 7.21 GiB and >= 1.11 s per step, against 6.49 GiB and
  # 0.94 s). Over the cotangent too, it planned as jax.checkpoint(nn.gelu) did: 1.01 s.
  x = jax.lax.optimization_barrier(x)
  x32 = x.astype(jnp.float32)
  if approximate:  # d/dx of x/2 (1 + tanh(u)), u = c (x + 0.044715 x^3)
    c = math.sqrt(2 / math.pi)
    t = jnp.tanh(c * (x32 + 0.044715 * x32 ** 3))
    slope = 0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * c * (1 + 3 * 0.044715 * x32 * x32)
  else:  # d/dx of x Phi(x): Phi(x) + x phi(x)
    slope = 0.5 * jax.lax.erfc(-x32 / math.sqrt(2)) + x32 * jnp.exp(-0.5 * x32 * x32) / math.sqrt(2 * math.pi)
  return ((cotangent.astype(jnp.float32) * slope).astype(x.dtype),)


_gelu_by_formula.defvjp(_gelu_forward, _gelu_backward)


class Dense(nn.Module):
  """inputs · kernel (+ bias), contracting `axis` of the inputs, with `features` as the output's trailing axes;
  the kernel's axes are named `in_axes` + `out_axes`, the bias's `out_axes`.

  Flax's DenseGeneral, which this follows (its params, their initial values and its arithmetic), draws its
  kernel flattened to 2-D under the full kernel's axis names, which a sharding constraint rejects once a mesh
  is set; this one makes each param at its full shape.
  """
  features: Sequence[int]
  axis: Sequence[int]
  in_axes: Sequence[Optional[str]]
  out_axes: Sequence[Optional[str]]
  dtype: Dtype
  use_bias: bool
  kernel_init: Initializer

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    axis = tuple(sorted(a % inputs.ndim for a in self.axis))
    kernel = self.param("kernel", with_axes(self.kernel_init, (*self.in_axes, *self.out_axes)),
                        tuple(inputs.shape[a] for a in axis) + tuple(self.features), jnp.float32)
    bias = (self.param("bias", with_axes(nn.initializers.zeros, self.out_axes), tuple(self.features), jnp.float32)
            if self.use_bias else None)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    out = jax.lax.dot_general(inputs, kernel, ((axis, tuple(range(len(axis)))), ((), ())))
    return out if bias is None else out + bias


def dense(features, in_axes, out_axes, *, dtype, name, use_bias=True, axis=-1, kernel_init=default_kernel_init):
  """A Dense layer whose kernel and bias carry logical axis names."""
  return Dense(features=tuple(np.atleast_1d(features).tolist()), axis=tuple(np.atleast_1d(axis).tolist()),
               in_axes=tuple(in_axes), out_axes=tuple(out_axes), dtype=dtype, use_bias=use_bias,
               kernel_init=kernel_init, name=name)


def layer_norm(epsilon: float, dtype: Dtype, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=jnp.float32,
      scale_init=with_axes(nn.initializers.ones, ("embed",)),
      bias_init=with_axes(nn.initializers.zeros, ("embed",)),
      name=name,
  )


class Embed(nn.Embed):
  """nn.Embed, or with `one_hot` a lookup by a product with the ids' one-hot vectors in the table's fp32, cast
  after: for a table of a few rows (token types), where a scatter-add would send every position's gradient
  into the same rows. On an H200 that contention (bf16, 16,384 positions into 2 rows) took 24.6 ms of
  BERT-Large's 126.5 ms step; as a product the gradient is one small matmul, summed in fp32."""
  one_hot: bool = False

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not self.one_hot:
      return super().__call__(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"{self.name}: embedding ids must be integers, got {inputs.dtype}")
    hot = jax.nn.one_hot(inputs, self.num_embeddings, dtype=self.embedding.dtype)
    # HIGHEST: each output is one table entry exactly, also where fp32 products would round (TPU).
    rows = jnp.einsum("...n,nd->...d", hot, self.embedding, precision=jax.lax.Precision.HIGHEST)
    return rows.astype(self.dtype)


def embedding(num: int, features: int, axes: Sequence[str], dtype: Dtype, name: str, one_hot: bool = False) -> Embed:
  return Embed(
      num_embeddings=num,
      features=features,
      dtype=dtype,
      param_dtype=jnp.float32,
      embedding_init=with_axes(default_kernel_init, axes),
      one_hot=one_hot,
      name=name,
  )


def check_at_least(least: float, **settings: Optional[float]) -> None:
  """Each setting is None (another decides it) or at least `least`: a width or a count of 0 fails late (a division
  by zero after the compile, arrays of no size that cannot be saved) or loses work (no checkpoint kept)."""
  for name, value in settings.items():
    if value is not None and value < least:
      raise ValueError(f"{name}={value}: must be at least {least}")


def check_fractions(**settings: Optional[float]) -> None:
  """Each setting (a dropout rate, Adam's decay) is None or in [0, 1): at 1 or more every update is not finite."""
  for name, value in settings.items():
    if value is not None and not 0 <= value < 1:
      raise ValueError(f"{name}={value}: must be at least 0 and below 1")


def check_heads_divide(width_name: str, width: int, num_heads: int) -> None:
  """Each head gets width // num_heads: where that leaves a remainder, the attention would project to fewer
  features than the model's width and train on silently, so it is a configuration error; so are no heads, which
  would stop the run in a division by zero."""
  check_at_least(1, num_heads=num_heads)
  if width % num_heads:
    raise ValueError(f"{width_name}={width} is not divisible by num_heads={num_heads}")


def check_sequence_length(length: int, max_position_embeddings: int) -> None:
  """Learned positions stop at the table's end: a longer sequence is a configuration error (an
  embedding lookup past the table would give NaN, not an error)."""
  if length > max_position_embeddings:
    raise ValueError(f"sequence length {length} exceeds max_position_embeddings={max_position_embeddings}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def softmax(scores: jax.Array, dtype: Dtype, keep_output_as_written: bool = False) -> jax.Array:
  """Softmax over the last axis of fp32 scores, returned in `dtype`, which is also all the backward pass keeps.

  jax.nn.softmax would keep its fp32 output for the gradient: with bf16 compute that is twice the bytes
  of the largest activation of attention, written and read once per layer.

  XLA may still keep what the output was computed from instead, and compute it again where the backward pass
  reads it. `keep_output_as_written` puts an optimization barrier between them. XLNet's scores sum three
  products: on an H200 XLA kept exp(scores - max) in fp32, and with the barrier XLNet-Large's 2-layer plan takes
  5.21 ms and 2.56 GiB, against 5.31 ms and 2.83 GiB. BERT's XLA attention, whose scores are one product,
  plans 8% slower with it (benchmarks/README.md, "Plans for GPUs"), and XLNet-Large's v3-512 plan 3% slower: XLNet
  asks for it on GPUs only (models/xlnet.py, `probs_kept_for_device`).
  """
  return jax.nn.softmax(scores, axis=-1).astype(dtype)


def _softmax_forward(scores, dtype, keep_output_as_written):
  probs = softmax(scores, dtype, keep_output_as_written)
  return probs, probs


def _softmax_backward(dtype, keep_output_as_written, probs, grad):
  if keep_output_as_written:
    probs = jax.lax.optimization_barrier(probs)
  probs, grad = probs.astype(jnp.float32), grad.astype(jnp.float32)
  return (probs * (grad - jnp.sum(grad * probs, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_forward, _softmax_backward)


@flax.struct.dataclass
class AttentionMask:
  """Which keys each query may attend to, in the forms the attention implementations take.

  `query_valid` [b, q] and `key_valid` [b, k] mark real (non-padding) positions; real positions come
  before padding in every row, as the feature converters pad. `causal` lets a query attend only to keys
  at or before its own position. None means every position is real.
  """
  query_valid: Optional[jax.Array] = None
  key_valid: Optional[jax.Array] = None
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  def bias(self, query_length: int, key_length: int) -> jax.Array:
    """[batch or 1, 1, q, k] additive fp32 bias for XLA's attention: 0 where allowed, a large negative elsewhere."""
    allowed = jnp.ones((1, 1, query_length, key_length), bool)
    if self.query_valid is not None:
      allowed = allowed & (self.query_valid[:, None, :, None] > 0)
    if self.key_valid is not None:
      allowed = allowed & (self.key_valid[:, None, None, :] > 0)
    if self.causal:
      allowed = allowed & jnp.tril(jnp.ones((query_length, key_length), bool))
    return jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)


# Attention implementations. 'xla' writes out the [b, heads, q, k] scores and probabilities; the fused
# kernels never do. Of them only 'triton' (models/flash_dropout.py: Pallas on Triton, for NVIDIA GPUs) drops out
# probabilities; cuDNN's kernel has dropout underneath, with a seed fixed at compile time, not exposed by JAX.
# 'auto' is resolved per chip by `attention_for_device`.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas", "splash", "triton")


def attention_for_device(device) -> str:
  """The fastest attention a device runs exactly: cuDNN's fused kernel on NVIDIA GPUs of compute capability
  8.0 and later (A100, L4, H100, H200); Pallas splash attention on TPU v4 and later; XLA's elsewhere (TPU v2
  and v3, whose Mosaic has no bf16 x bf16 -> fp32 matmul; CPUs).

  On TPUs the choice is the plans' (`pretrain.plan`, with the kernels costed from their algorithm and blocks
  by pretrain.kernel_costs; libtpu 0.0.42.1): splash attention plans BART-large on a v5litepod-256 at >= 0.44 s
  per step in 5.69 GiB per chip, against XLA's attention's 0.58 s in 8.01 GiB (on a v4-128, 1.00 s and 6.50
  GiB per core against 1.58 s and 7.73 GiB), and ALBERT-xxlarge and
  BERT-Large within 0.5% of XLA's time in as much HBM or less (the v4_128 and v5litepod_256 run files).
  Pallas flash attention ('pallas') plans slower than both: a head_dim of 64 fills 128 lanes in its layout,
  and its backward computes the scores twice."""
  if device.platform in ("gpu", "cuda") and "NVIDIA" in device.device_kind.upper():
    return "cudnn" if float(getattr(device, "compute_capability", 0) or 0) >= 8.0 else "xla"
  if device.platform == "tpu" and not re.match(r"TPU v[23]\b", device.device_kind):
    return "splash"
  return "xla"


def attention_refusal(implementation: str, device) -> Optional[str]:
  """Why `device` cannot run `implementation`'s kernel, or None: cuDNN's needs an NVIDIA GPU, the Pallas TPU
  kernels a TPU; Triton's needs an NVIDIA GPU, or a CPU, which interprets it (slowly: for tests)."""
  nvidia = device.platform in ("gpu", "cuda") and "NVIDIA" in device.device_kind.upper()
  needs = {"cudnn": ("an NVIDIA GPU", nvidia), "pallas": ("a TPU", device.platform == "tpu"),
           "splash": ("a TPU", device.platform == "tpu"),
           "triton": ("an NVIDIA GPU (or a CPU, interpreted)", nvidia or device.platform == "cpu")}
  if implementation in needs and not needs[implementation][1]:
    return f"needs {needs[implementation][0]}, not {device.device_kind}"
  return None


def fused_attention_applies(implementation: str, *, dtype, head_dim: int, query_length: int, key_length: int,
                            dropout_rate: float, deterministic: bool) -> bool:
  """Whether `implementation`'s kernel computes this attention as XLA's would (with probability dropout: the
  same distribution of masks); where it cannot (probability dropout in training, but for 'triton'; fp32
  compute; shapes the kernel does not tile), XLA's runs instead."""
  if implementation == "triton":
    return flash_dropout.applies(query_length, key_length, head_dim)
  if implementation not in ("cudnn", "pallas", "splash") or (dropout_rate > 0 and not deterministic):
    return False
  if implementation == "cudnn":  # cuDNN's flash attention: half precision, head dims up to 128 in steps of 8
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
  return query_length % 128 == 0 and key_length % 128 == 0  # the Pallas kernels' blocks


def dot_product_attention(query, key, value, mask: AttentionMask, *, implementation: str, dropout: Dropout,
                          deterministic: bool) -> jax.Array:
  """Softmax(q k^T / sqrt(d) + mask) v over [batch, length, heads, head_dim] arrays, in query's dtype;
  `dropout` (of the calling module) drops attention probabilities in training."""
  _, query_length, _, head_dim = query.shape
  key_length = key.shape[1]
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention_implementation={implementation!r}: expected one of {ATTENTION_IMPLEMENTATIONS}")
  if implementation == "auto":  # a model used outside a run's setup (which resolves it for the mesh's chip)
    implementation = attention_for_device(jax.devices()[0])
  if fused_attention_applies(implementation, dtype=query.dtype, head_dim=head_dim, query_length=query_length,
                             key_length=key_length, dropout_rate=dropout.rate, deterministic=deterministic):
    if implementation == "triton":
      return _triton_attention(query, key, value, mask, dropout, deterministic)
    fused = {"cudnn": _cudnn_attention, "pallas": _pallas_attention, "splash": _splash_attention}[implementation]
    return fused(query, key, value, mask)
  query = query / jnp.sqrt(head_dim).astype(query.dtype)
  # Bias and softmax in fp32: bf16 loses too much in the normaliser, and the fp32 "masked" bias would
  # round to -inf in bf16, turning fully masked (padding) rows into NaN.
  scores = jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32) + mask.bias(query_length, key_length)
  probs = dropout(softmax(scores, query.dtype), deterministic=deterministic)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


def _valid_lengths(valid: Optional[jax.Array]) -> Optional[jax.Array]:
  return None if valid is None else valid.sum(axis=-1, dtype=jnp.int32)


def _cudnn_attention(query, key, value, mask: AttentionMask) -> jax.Array:
  # Padding as lengths: cuDNN's padding mask skips the tiles past a row's length instead of adding a bias.
  return jax.nn.dot_product_attention(query, key, value, is_causal=mask.causal,
                                      query_seq_lengths=_valid_lengths(mask.query_valid),
                                      key_value_seq_lengths=_valid_lengths(mask.key_valid), implementation="cudnn")


def _pallas_attention(query, key, value, mask: AttentionMask) -> jax.Array:
  """Pallas flash attention on TPU (jax's first TPU kernel: separate dq and dk/dv backward kernels)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as flash  # TPU-only module, imported on use

  def attend(q, k, v, segments, _device):
    segment_ids = None if segments is None else flash.SegmentIds(*segments)
    return flash.flash_attention(q, k, v, segment_ids=segment_ids, causal=mask.causal,
                                 sm_scale=1.0 / math.sqrt(q.shape[-1]))

  return _per_device(attend, query, key, value, mask)


def _triton_attention(query, key, value, mask: AttentionMask, dropout: Dropout, deterministic: bool,
                      bias=None) -> jax.Array:
  """models/flash_dropout.py's kernels, per device under the mesh, the probabilities dropped out in training;
  each device's masks under its own seed."""
  rate = 0.0 if deterministic else dropout.rate
  seed = dropout.hash_seed() if rate else None

  def attend(q, k, v, segments, device_index, bias=None):
    return flash_dropout.attention(q, k, v, key_valid=None if segments is None else segments[1], causal=mask.causal,
                                   rate=rate, seed=None if seed is None else flash_dropout.fold_in(seed, device_index),
                                   bias=bias)

  return _per_device(attend, query, key, value, mask, heads_major=False, bias=bias)


def biased_attention(query, key, value, bias, *, dropout: Dropout, deterministic: bool) -> jax.Array:
  """Softmax(q k^T / sqrt(d) + bias) v over [batch, length, heads, head_dim] arrays through the Triton kernel
  (models/flash_dropout.py), `bias` [batch, heads, q, k] differentiated too (XLNet's position and segment
  scores, its mask in them), the probabilities dropped out by the kernel in training. Callers check
  `flash_dropout.applies` first."""
  return _triton_attention(query, key, value, AttentionMask(), dropout, deterministic, bias)


def _splash_attention(query, key, value, mask: AttentionMask) -> jax.Array:
  """Pallas splash attention on TPU: one fused backward kernel, which computes the scores once for dq, dk
  and dv, and queries, keys and values laid out with the sequence minor, so that a head_dim under 128 is
  not padded to the 128 lanes of a TPU tile."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  query_length, key_length, head_dim = query.shape[1], key.shape[1], query.shape[-1]
  seq_minor = splash.QKVLayout.SEQ_MINOR if head_dim < 128 else splash.QKVLayout.HEAD_DIM_MINOR
  block_q, block_kv = _splash_block(query_length), _splash_block(key_length)
  blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_q_dkv=block_q, block_kv_dkv=block_kv,
                             use_fused_bwd_kernel=True, q_layout=seq_minor, k_layout=seq_minor, v_layout=seq_minor)
  head_mask = (masks.CausalMask((query_length, key_length)) if mask.causal
               else masks.FullMask((query_length, key_length)))

  def attend(q, k, v, segments, _device):
    kernel = splash.make_splash_mha(masks.MultiHeadMask([head_mask] * q.shape[1]), head_shards=1, q_seq_shards=1,
                                    block_sizes=blocks)
    q = q / jnp.sqrt(head_dim).astype(q.dtype)  # splash takes no softmax scale
    if segments is None:
      return jax.vmap(kernel)(q, k, v)
    return jax.vmap(lambda *row: kernel(*row[:3], segment_ids=splash.SegmentIds(*row[3:])))(q, k, v, *segments)

  return _per_device(attend, query, key, value, mask)


def _splash_block(length: int) -> int:
  """Splash attention's block along a sequence: the whole of one up to 512 (no block is read twice), else the
  largest of 512, 256 and 128 that divides it."""
  return next(block for block in (512, 256, 128) if length % block == 0)


def _per_device(attend, query, key, value, mask: AttentionMask, heads_major: bool = True, bias=None) -> jax.Array:
  """`attend(q, k, v, segments, device)` of a Pallas kernel, run per device under the mesh (a kernel is not
  partitioned by XLA): batch and heads split as the logical axis rules split the activations, each device
  attending over whole rows. The arrays are [batch, heads, length, head_dim] if `heads_major` (the TPU kernels'
  layout), else as given: [batch, length, heads, head_dim]. `segments`: None, or the (query, key) segment ids
  [batch, length] that express padding: real positions are segment 1, padding 0, and a query attends only
  within its segment. `device`: the device's index among those that split the rows (0 without a mesh). A
  `bias` [batch, heads, q, k], split as the rows are, goes to `attend` as `bias=`."""
  segments = None
  if mask.query_valid is not None or mask.key_valid is not None:
    batch, query_length, key_length = query.shape[0], query.shape[1], key.shape[1]
    as_ids = lambda valid, length: (jnp.ones((batch, length), jnp.int32) if valid is None
                                    else jnp.broadcast_to(valid, (batch, length)).astype(jnp.int32))
    segments = (as_ids(mask.query_valid, query_length), as_ids(mask.key_valid, key_length))

  def in_layout(q, k, v, segments, device, bias=None):
    extra = {} if bias is None else {"bias": bias}
    if not heads_major:
      return attend(q, k, v, segments, device, **extra)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    return jnp.swapaxes(attend(q, k, v, segments, device, **extra), 1, 2)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return in_layout(query, key, value, segments, 0, bias)
  batch_axes, _, heads_axes, _ = nn.logical_to_mesh_axes(BATCH_LENGTH_HEADS_KV)
  # An axis the mesh does not divide (init's one example row) is whole on every device.
  batch_axes = _if_dividing(batch_axes, query.shape[0], mesh)
  heads_axes = _if_dividing(heads_axes, query.shape[2], mesh)
  splitting = _axis_names(batch_axes) + _axis_names(heads_axes)
  heads_spec = jax.sharding.PartitionSpec(batch_axes, None, heads_axes, None)  # whole rows on every device
  rows_spec = jax.sharding.PartitionSpec(batch_axes, None)
  segment_spec = None if segments is None else (rows_spec, rows_spec)

  bias_spec = None if bias is None else jax.sharding.PartitionSpec(batch_axes, heads_axes, None, None)

  def on_device(q, k, v, segments, bias):
    return in_layout(q, k, v, segments, jax.lax.axis_index(splitting) if splitting else 0, bias)

  return jax.shard_map(on_device, mesh=mesh, in_specs=(heads_spec, heads_spec, heads_spec, segment_spec, bias_spec),
                       out_specs=heads_spec, check_vma=False)(query, key, value, segments, bias)


def _axis_names(mesh_axes) -> tuple:
  """A PartitionSpec entry (a name, names or None) as a tuple of names."""
  return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())


def _if_dividing(mesh_axes, size: int, mesh):
  """`mesh_axes` (a name, names or None) if their devices divide `size`, else None."""
  return mesh_axes if size % math.prod(mesh.shape[name] for name in _axis_names(mesh_axes)) == 0 else None


class MultiHeadAttention(nn.Module):
  """Scaled dot-product attention with biased q/k/v/o projections (BERT, ALBERT, BART)."""
  num_heads: int
  head_dim: int
  dropout_rate: float
  dtype: Dtype = jnp.float32
  implementation: str = "xla"  # see ATTENTION_IMPLEMENTATIONS
  dropout_masks: str = "auto"

  @nn.compact
  def __call__(self, inputs_q, inputs_kv, mask: AttentionMask, deterministic: bool):
    def project(name):
      return dense((self.num_heads, self.head_dim), ("embed",), ("heads", "kv"), dtype=self.dtype, name=name)

    query = constrain(project("query")(inputs_q), BATCH_LENGTH_HEADS_KV)
    key = constrain(project("key")(inputs_kv), BATCH_LENGTH_HEADS_KV)
    value = constrain(project("value")(inputs_kv), BATCH_LENGTH_HEADS_KV)
    context = dot_product_attention(query, key, value, mask, implementation=self.implementation,
                                    dropout=Dropout(self.dropout_rate, self.dropout_masks),
                                    deterministic=deterministic)
    context = constrain(context, BATCH_LENGTH_HEADS_KV)
    output = dense(inputs_q.shape[-1], ("heads", "kv"), ("embed",), axis=(-2, -1), dtype=self.dtype,
                   name="output")(context)
    return constrain(output, BATCH_LENGTH_EMBED)


class FeedForward(nn.Module):
  """Dense -> GELU -> Dense."""
  hidden_dim: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  approximate_gelu: bool = False
  dropout_masks: str = "auto"
  gelu_gradient: str = "formula"

  @nn.compact
  def __call__(self, x, deterministic: bool):
    h = dense(self.hidden_dim, ("embed",), ("mlp",), dtype=self.dtype, name="intermediate")(x)
    h = constrain(gelu(h, self.approximate_gelu, self.gelu_gradient), BATCH_LENGTH_MLP)
    h = Dropout(self.dropout_rate, self.dropout_masks)(h, deterministic=deterministic)
    out = dense(x.shape[-1], ("mlp",), ("embed",), dtype=self.dtype, name="output")(h)
    return constrain(out, BATCH_LENGTH_EMBED)


class PostLNAttentionBlock(nn.Module):
  """x = LN(x + Dropout(Attention(x, context))): one post-norm sublayer, a part of PostLNEncoderLayer
  and used alone where sublayers are shared or mixed (ALBERT's partial sharing, BART's decoder)."""
  num_heads: int
  head_dim: int
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_eps: float
  dtype: Dtype = jnp.float32
  attention_implementation: str = "xla"
  dropout_masks: str = "auto"

  @nn.compact
  def __call__(self, x, context, mask: AttentionMask, deterministic: bool):
    attention = MultiHeadAttention(self.num_heads, self.head_dim, self.attention_dropout_rate, self.dtype,
                                   self.attention_implementation, self.dropout_masks, name="attention")
    update = Dropout(self.dropout_rate, self.dropout_masks)(attention(x, context, mask, deterministic),
                                                            deterministic=deterministic)
    return constrain(layer_norm(self.layer_norm_eps, self.dtype, "norm")(x + update), BATCH_LENGTH_EMBED)


class PostLNFeedForwardBlock(nn.Module):
  """x = LN(x + Dropout(FFN(x))), the FFN with its own dropout after the activation."""
  mlp_dim: int
  dropout_rate: float
  activation_dropout_rate: float
  layer_norm_eps: float
  dtype: Dtype = jnp.float32
  approximate_gelu: bool = False
  dropout_masks: str = "auto"
  gelu_gradient: str = "formula"

  @nn.compact
  def __call__(self, x, deterministic: bool):
    ffn = FeedForward(self.mlp_dim, self.activation_dropout_rate, self.dtype, self.approximate_gelu,
                      self.dropout_masks, self.gelu_gradient, name="mlp")
    update = Dropout(self.dropout_rate, self.dropout_masks)(ffn(x, deterministic), deterministic=deterministic)
    return constrain(layer_norm(self.layer_norm_eps, self.dtype, "norm")(x + update), BATCH_LENGTH_EMBED)


class PostLNEncoderLayer(nn.Module):
  """A self-attention block, then an FFN block: the encoder layer of BERT, ALBERT and BART."""
  num_heads: int
  head_dim: int
  mlp_dim: int
  dropout_rate: float
  layer_norm_eps: float
  attention_dropout_rate: float
  dtype: Dtype = jnp.float32
  activation_dropout_rate: float = 0.0
  approximate_gelu: bool = False
  attention_implementation: str = "xla"
  dropout_masks: str = "auto"
  gelu_gradient: str = "formula"

  @nn.compact
  def __call__(self, x, mask: AttentionMask, deterministic: bool):
    """-> (x, None): the `layer_stack` protocol."""
    x = PostLNAttentionBlock(self.num_heads, self.head_dim, self.dropout_rate, self.attention_dropout_rate,
                             self.layer_norm_eps, self.dtype, self.attention_implementation, self.dropout_masks,
                             name="attention")(x, x, mask, deterministic)
    x = PostLNFeedForwardBlock(self.mlp_dim, self.dropout_rate, self.activation_dropout_rate, self.layer_norm_eps,
                               self.dtype, self.approximate_gelu, self.dropout_masks, self.gelu_gradient,
                               name="ffn")(x, deterministic)
    return x, None


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def maybe_remat(module_cls, policy: str, static_argnums: Sequence[int] = (), prevent_cse: bool = True):
  """Wraps a layer class in rematerialisation according to a policy name (none/full/dots)."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat_policy={policy!r}: expected one of {sorted(REMAT_POLICIES)}")
  if policy == "none":
    return module_cls
  return nn.remat(module_cls, policy=REMAT_POLICIES[policy], static_argnums=tuple(static_argnums),
                  prevent_cse=prevent_cse)


# Module names. Params below a `layers` module, and only those, lead with a "layers" axis (the
# optimizer's per-layer LAMB trust ratio relies on it).
SCANNED_STACK = "layers"  # a scanned stack of layers with their own params
SHARED_LAYER = "shared_layer"  # one layer's params applied at every depth, scanned or not


def unrolled_layer_name(index: int) -> str:
  return f"layer_{index}"


def stack_layer_params(params):
  """Params of unrolled layer stacks (`layer_<i>` modules) laid out for the same model with scanned
  stacks (one `layers` module, each leaf stacked on a leading axis): the same weights, bit for bit."""
  if not isinstance(params, Mapping):
    return params
  out, per_layer = {}, {}
  for key, value in params.items():
    match = re.fullmatch(r"layer_(\d+)", key)
    if match:
      per_layer[int(match.group(1))] = value
    else:
      out[key] = stack_layer_params(value)
  if per_layer:
    if sorted(per_layer) != list(range(len(per_layer))):
      raise ValueError(f"layer params {sorted(per_layer)} are not numbered 0..{len(per_layer) - 1}")
    out[SCANNED_STACK] = jax.tree.map(lambda *values: np.stack(values), *(per_layer[i] for i in sorted(per_layer)))
  return out


def unstack_layer_params(params):
  """The inverse of stack_layer_params: a `layers` module's leaves split into `layer_<i>` modules."""
  if not isinstance(params, Mapping):
    return params
  out = {}
  for key, value in params.items():
    if key == SCANNED_STACK:
      for index in range(jax.tree.leaves(value)[0].shape[0]):
        out[unrolled_layer_name(index)] = jax.tree.map(lambda leaf: np.asarray(leaf[index]), value)
    else:
      out[key] = unstack_layer_params(value)
  return out


def layer_stack(layer_cls, num_layers: int, carry, *args, deterministic: bool, scan: bool, remat_policy: str,
                per_layer_args: Sequence[int] = (), stack_axis: int = 0, shared: bool = False, **layer_attributes):
  """Applies `num_layers` layers of `layer_cls`, unrolled or as one `nn.scan`; returns (carry, outputs).

  The layer's protocol: `layer(carry, *args, deterministic) -> (carry, output or None)`. Arguments
  whose positions are in `per_layer_args` hold one slice per layer along `stack_axis`; the others go
  to every layer. Per-layer outputs come back stacked along `stack_axis` (None if there are none).

  Unrolled, layer i is the module `layer_<i>`. Scanned, one module `layers` holds every layer's params
  stacked on a leading axis named "layers" (its sharding rule: see pretrain/partitioning.py), and XLA
  compiles one layer body however deep the stack: compile time and program size stop growing with
  depth. `shared=True` applies one set of params at every depth (ALBERT): the module `shared_layer`,
  whose params are the same whether scanned (broadcast to every step) or not.
  """
  # Counting self, `deterministic` comes after the carry and args: a Python bool, static under remat.
  layer_cls = maybe_remat(layer_cls, remat_policy, static_argnums=(len(args) + 2,), prevent_cse=not scan)
  if scan:
    in_axes = tuple(stack_axis if i in per_layer_args else nn.broadcast for i in range(len(args)))
    scanned = nn.scan(layer_cls, variable_axes={} if shared else {"params": 0},
                      variable_broadcast="params" if shared else False,
                      split_rngs={"params": not shared, "dropout": True}, in_axes=in_axes + (nn.broadcast,),
                      out_axes=stack_axis, length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(**layer_attributes, name=SHARED_LAYER if shared else SCANNED_STACK)(carry, *args, deterministic)
  shared_layer = layer_cls(**layer_attributes, name=SHARED_LAYER) if shared else None
  outputs = []
  for index in range(num_layers):
    layer = shared_layer or layer_cls(**layer_attributes, name=unrolled_layer_name(index))
    layer_args = [jax.lax.index_in_dim(arg, index, stack_axis, keepdims=False) if i in per_layer_args else arg
                  for i, arg in enumerate(args)]
    carry, output = layer(carry, *layer_args, deterministic)
    outputs.append(output)
  if outputs[0] is None:
    return carry, None
  return carry, jax.tree.map(lambda *per_layer: jnp.stack(per_layer, axis=stack_axis), *outputs)


@jax.custom_vjp
def add_row_bias(x: jax.Array, bias: jax.Array) -> jax.Array:
  """x [..., n] + bias [n] (of x's dtype). The bias gradient sums the rows as a product with a vector of
  ones: XLA's CPU backend runs that 26x faster than a sum over rows (a [2048, 32000] gradient: 8.8
  against 231 ms); on TPU both read the gradient once."""
  return x + bias


def _add_row_bias_forward(x, bias):
  return x + bias, None


def _add_row_bias_backward(_, grad):
  rows = grad.reshape(-1, grad.shape[-1])
  ones = jnp.ones((rows.shape[0],), grad.dtype)
  return grad, jnp.dot(ones, rows, preferred_element_type=jnp.float32).astype(grad.dtype)


add_row_bias.defvjp(_add_row_bias_forward, _add_row_bias_backward)


class TiedLMBias(nn.Module):
  """The output bias of an LM head whose weight is tied to the word embedding."""
  vocab_size: int

  @nn.compact
  def __call__(self, logits):
    bias = self.param("bias", with_axes(nn.initializers.zeros, ("vocab",)), (self.vocab_size,), jnp.float32)
    return add_row_bias(logits, bias.astype(logits.dtype))


class MaskedLMHead(nn.Module):
  """Dense -> GELU -> LayerNorm, then logits against the tied word embedding plus a bias.

  `features` is the transform's width: the hidden size for BERT, the embedding size E for ALBERT's
  factorized embedding (unset: the input width).
  """
  vocab_size: int
  layer_norm_eps: float
  dtype: Dtype
  features: Optional[int] = None
  approximate_gelu: bool = False
  gelu_gradient: str = "formula"

  @nn.compact
  def __call__(self, hidden, word_embedding: nn.Embed):
    h = dense(self.features or hidden.shape[-1], ("embed",), ("hidden",), dtype=self.dtype, name="transform")(hidden)
    h = layer_norm(self.layer_norm_eps, self.dtype, "norm")(gelu(h, self.approximate_gelu, self.gelu_gradient))
    logits = word_embedding.attend(h.astype(self.dtype))
    logits = TiedLMBias(self.vocab_size, name="output")(logits)
    return constrain(logits, BATCH_LENGTH_VOCAB)
