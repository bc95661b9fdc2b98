"""Flash attention for GPUs with dropout on the attention probabilities: a Pallas kernel on Triton.

No fused attention in JAX's public API drops out attention probabilities (cuDNN's kernel can, underneath, with
a seed fixed when the program compiles), so BERT's recipe (attention dropout 0.1) trained through XLA's
attention, which writes out the [batch, heads, q, k] scores, probabilities and dropout masks of every layer.
Here each keep-or-drop decision is a hash of the element's coordinates under the call's seed (`keep_mask`;
models/dropout.py's 'hashed' masks), so the forward pass makes it where it uses it and the backward pass makes
the same one again: nothing score-sized reaches memory.

- Forward: per block of queries, one pass over the keys (FlashAttention-2): the running max and normaliser
  of the softmax from the undropped probabilities, the output from the kept ones scaled by 1 / (1 - rate);
  it saves each row's largest score and sum of exponentials.
- Backward: one kernel per block of keys for dk and dv, one per block of queries for dq, each computing the
  probabilities and decisions again from those and the seed.

Arrays are [batch, length, heads, head_dim]; padding is a key mask (`key_valid` [batch, keys]), padded keys
get no weight; rows of padded queries attend like the others (nothing downstream reads them). An additive
`bias` [batch, heads, queries, keys] (XLNet's position and segment scores, with its attention mask as
MASKED_SCORE) is read tile by tile, and its gradient written out by the dq kernel: score-sized, but once each
way, where XLA's attention makes several passes over its scores, probabilities and masks. On the CPU the kernels
run in Pallas's interpret mode (tests); on an NVIDIA GPU Triton compiles them.
"""
import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from models.dropout import SPREAD, hashed_keep_mask, hashed_keeps, mix32, row_salt



class Tiling(NamedTuple):
  """How the kernels cut the work: `queries` and `keys` per tile (each kernel program takes a block of one and
  loops over blocks of the other; lengths must be multiples of both), and the warps and software-pipeline
  stages Triton gives a program."""
  queries: int = 64
  keys: int = 64
  warps: int = 4
  stages: int = 2

  def __str__(self) -> str:
    return f"{self.queries}x{self.keys}/{self.warps}/{self.stages}"

  @classmethod
  def parse(cls, text: str) -> "Tiling":
    """'QUERIESxKEYS/WARPS/STAGES', as str() writes it (e.g. 128x64/8/2)."""
    match = re.fullmatch(r"(\d+)x(\d+)/(\d+)/(\d+)", text.strip())
    if not match:
      raise ValueError(f"tiling {text!r}: expected QUERIESxKEYS/WARPS/STAGES, e.g. 128x64/8/2")
    return cls(*map(int, match.groups()))


TILING = Tiling()  # not yet tuned on a GPU: benchmarks/attention.py --tilings times others
MASKED_SCORE = -1e30  # finite, so that a row with no valid key stays finite (uniform), as XLA's bias makes it


def applies(query_length: int, key_length: int, head_dim: int, tiling: Tiling = TILING) -> bool:
  """Whether the kernels tile these shapes (Triton's products want a head_dim that is a power of 2, >= 16)."""
  multiple = math.lcm(tiling.queries, tiling.keys)
  return (query_length % multiple == 0 and key_length % multiple == 0 and head_dim >= 16
          and head_dim & (head_dim - 1) == 0)


def _program_salt(seed_ref, rate: float):
  """The salt of the (batch, head) row of this kernel program (grids are (block, batch, head)); None without
  dropout."""
  return row_salt(seed_ref, pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)) if rate > 0 else None


def _keeps(salt, query_positions, key_positions, key_length: int, rate: float):
  """A tile's keep-or-drop decisions (dropout.hashed_keeps over the element's index in its (batch, head) row);
  None without a salt (no dropout)."""
  if salt is None:
    return None
  return hashed_keeps(salt, query_positions.astype(jnp.uint32) * np.uint32(key_length)
                      + key_positions.astype(jnp.uint32), rate)


def keep_mask(seed: jax.Array, shape, rate: float) -> jax.Array:
  """The kernels' decisions for a [batch, heads, q, k] attention, written out (for `reference_attention`)."""
  return hashed_keep_mask(seed, rate, shape, row_axes=2)


def reference_attention(q, k, v, *, key_valid, causal: bool = False, rate: float = 0.0, seed=None,
                        bias=None) -> jax.Array:
  """What `attention` computes, by XLA in fp32 with the kernels' decisions written out: to check the kernels
  against (tests, benchmarks/attention.py)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  query_length, key_length = q.shape[1], k.shape[1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  allowed = key_valid[:, None, None, :] > 0
  if causal:
    allowed = allowed & jnp.tril(jnp.ones((query_length, key_length), bool))
  probs = jax.nn.softmax(jnp.where(allowed, scores, MASKED_SCORE), axis=-1)
  if rate:
    probs = jnp.where(keep_mask(seed, probs.shape, rate), probs / (1 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def fold_in(seed: jax.Array, index) -> jax.Array:
  """The seed of the `index`-th device of those that split a call's rows: each draws different masks."""
  return jnp.stack([seed[0] ^ mix32(jnp.asarray(index, jnp.uint32) * SPREAD + np.uint32(1)), seed[1]])


def _scores(q, k, bias, query_positions, key_positions, key_valid, scale: float, causal: bool):
  """A tile's scaled scores in fp32 plus its `bias` tile (None: none), MASKED_SCORE where the key is padding or
  (causal) in the future."""
  scores = plt.dot(q, k, trans_b=True).astype(jnp.float32) * scale
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  allowed = key_valid[None, :] > 0
  if causal:
    allowed = allowed & (query_positions[:, None] >= key_positions[None, :])
  return jnp.where(allowed, scores, MASKED_SCORE)


def _dropped(probs, keep, rate: float):
  """Kept probabilities scaled by 1 / (1 - rate), dropped ones 0; probs themselves without dropout."""
  return probs if keep is None else jnp.where(keep, probs * (1.0 / (1.0 - rate)), 0.0)


def _key_blocks_seen(causal: bool, key_length: int, tiling: Tiling):
  """How many key blocks a query block (this program's) may attend to: under a causal mask none wholly past its
  last query."""
  blocks = key_length // tiling.keys
  if not causal:
    return blocks
  return jnp.minimum(((pl.program_id(0) + 1) * tiling.queries + tiling.keys - 1) // tiling.keys, blocks)


def _forward_kernel(*, seed_ref, key_valid_ref, q_ref, k_ref, v_ref, out_ref, row_max_ref, row_sum_ref, scale, causal,
                    rate, tiling,
                    bias_ref=None):
  key_length = k_ref.shape[0]
  salt = _program_salt(seed_ref, rate)
  query_positions = pl.program_id(0) * tiling.queries + jnp.arange(tiling.queries)
  q = q_ref[...]

  def step(key_block, carry):
    acc, running_max, normaliser = carry
    keys = pl.ds(key_block * tiling.keys, tiling.keys)
    key_positions = key_block * tiling.keys + jnp.arange(tiling.keys)
    bias = None if bias_ref is None else bias_ref[:, keys]
    scores = _scores(q, k_ref[keys, :], bias, query_positions, key_positions, key_valid_ref[keys], scale, causal)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    correction = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max[:, None])
    keep = _keeps(salt, query_positions[:, None], key_positions[None, :], key_length, rate)
    v = v_ref[keys, :]
    acc = acc * correction[:, None] + plt.dot(_dropped(probs, keep, rate).astype(v.dtype), v)
    return acc, new_max, normaliser * correction + probs.sum(axis=-1)

  rows = tiling.queries
  start = (jnp.zeros((rows, q.shape[-1]), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  acc, running_max, normaliser = jax.lax.fori_loop(0, _key_blocks_seen(causal, key_length, tiling), step, start)
  out_ref[...] = (acc / normaliser[:, None]).astype(out_ref.dtype)
  row_max_ref[...] = running_max
  row_sum_ref[...] = normaliser


def _tile_gradients(q, k, v, bias, d_out, row_max, row_sum, delta, query_positions, key_positions, key_valid, salt,
                    key_length, *, scale, causal, rate):
  """A tile's (kept probabilities, gradients of its scores): what dv, and dk, dq (times `scale`) and the bias's
  gradient are."""
  # From the row's max and sum apart, not their log-sum-exp: a wholly masked row's max (MASKED_SCORE) would
  # swallow the log of its sum, and its probabilities come out 1 instead of uniform.
  scores = _scores(q, k, bias, query_positions, key_positions, key_valid, scale, causal)
  probs = jnp.exp(scores - row_max[:, None]) / row_sum[:, None]
  keep = _keeps(salt, query_positions[:, None], key_positions[None, :], key_length, rate)
  d_probs = _dropped(plt.dot(d_out, v, trans_b=True).astype(jnp.float32), keep, rate)
  return _dropped(probs, keep, rate), probs * (d_probs - delta[:, None])


def _dkv_kernel(*, seed_ref, key_valid_ref, q_ref, k_ref, v_ref, d_out_ref, row_max_ref, row_sum_ref, delta_ref, dk_ref,
                dv_ref, scale, causal, rate, tiling, bias_ref=None):
  query_length, key_length = q_ref.shape[0], key_valid_ref.shape[0]
  salt = _program_salt(seed_ref, rate)
  keys = pl.ds(pl.program_id(0) * tiling.keys, tiling.keys)
  key_positions = pl.program_id(0) * tiling.keys + jnp.arange(tiling.keys)
  k, v, key_valid = k_ref[...], v_ref[...], key_valid_ref[keys]

  def step(query_block, carry):
    dk, dv = carry
    queries = pl.ds(query_block * tiling.queries, tiling.queries)
    q, d_out = q_ref[queries, :], d_out_ref[queries, :]
    bias = None if bias_ref is None else bias_ref[queries, :]
    kept, d_scores = _tile_gradients(q, k, v, bias, d_out, row_max_ref[queries], row_sum_ref[queries],
                                     delta_ref[queries],
                                     query_block * tiling.queries + jnp.arange(tiling.queries), key_positions,
                                     key_valid, salt, key_length, scale=scale, causal=causal, rate=rate)
    dv = dv + plt.dot(kept.astype(d_out.dtype), d_out, trans_a=True)
    dk = dk + plt.dot((d_scores * scale).astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = jnp.zeros((tiling.keys, k.shape[-1]), jnp.float32)
  # Under a causal mask, query blocks wholly before this key block never see it.
  first = pl.program_id(0) * tiling.keys // tiling.queries if causal else 0
  dk, dv = jax.lax.fori_loop(first, query_length // tiling.queries, step, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*, seed_ref, key_valid_ref, q_ref, k_ref, v_ref, d_out_ref, row_max_ref, row_sum_ref, delta_ref, dq_ref,
               scale, causal, rate, tiling, bias_ref=None, d_bias_ref=None):
  key_length = k_ref.shape[0]
  salt = _program_salt(seed_ref, rate)
  query_positions = pl.program_id(0) * tiling.queries + jnp.arange(tiling.queries)
  q, d_out, row_max, row_sum, delta = q_ref[...], d_out_ref[...], row_max_ref[...], row_sum_ref[...], delta_ref[...]

  def step(key_block, dq):
    keys = pl.ds(key_block * tiling.keys, tiling.keys)
    k = k_ref[keys, :]
    bias = None if bias_ref is None else bias_ref[:, keys]
    _, d_scores = _tile_gradients(q, k, v_ref[keys, :], bias, d_out, row_max, row_sum, delta, query_positions,
                                  key_block * tiling.keys + jnp.arange(tiling.keys), key_valid_ref[keys], salt,
                                  key_length, scale=scale, causal=causal, rate=rate)
    if d_bias_ref is not None:
      d_bias_ref[:, keys] = d_scores.astype(d_bias_ref.dtype)
    return dq + plt.dot((d_scores * scale).astype(k.dtype), k)

  dq = jax.lax.fori_loop(0, _key_blocks_seen(causal, key_length, tiling), step,
                         jnp.zeros((tiling.queries, q.shape[-1]), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _specs(query_length: int, key_length: int, head_dim: int, blocked: str, tiling: Tiling) -> dict:
  """BlockSpecs of the kernels' operands and results by name, for a grid over (blocks of `blocked` ('queries' or
  'keys'), batch, heads): the blocked side one block, the other whole."""
  def rows(length, side):
    block, index = (getattr(tiling, side), lambda i: i) if side == blocked else (length, lambda i: 0)
    return (pl.BlockSpec((None, block, None, head_dim), lambda i, b, h: (b, index(i), h, 0)),
            pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, index(i))))
  query_rows, query_stats = rows(query_length, "queries")
  key_rows, _ = rows(key_length, "keys")
  if blocked == "queries":  # [batch, heads, queries, keys]: this program's rows of it, or its columns
    scores = pl.BlockSpec((None, None, tiling.queries, key_length), lambda i, b, h: (b, h, i, 0))
  else:
    scores = pl.BlockSpec((None, None, query_length, tiling.keys), lambda i, b, h: (b, h, 0, i))
  return dict(seed=pl.BlockSpec((2,), lambda i, b, h: (0,)),
              key_valid=pl.BlockSpec((None, key_length), lambda i, b, h: (b, 0)),
              q=query_rows, out=query_rows, d_out=query_rows, dq=query_rows, row_max=query_stats, row_sum=query_stats,
              delta=query_stats,
              k=key_rows, v=key_rows, dk=key_rows, dv=key_rows, bias=scores, d_bias=scores)


def _run(kernel, blocked: str, operands: dict, results: dict, *, causal: bool, rate: float, tiling: Tiling,
         interpret: bool):
  """`kernel` over a grid of (blocks of `blocked`, batch, heads), on `operands` and making `results` (by name:
  arrays and ShapeDtypeStructs; the kernel takes each as `<name>_ref`), each tiled as `_specs` tiles its name."""
  batch, query_length, heads, head_dim = operands["q"].shape
  key_length = operands["k"].shape[1]
  specs = _specs(query_length, key_length, head_dim, blocked, tiling)
  grid = ((query_length if blocked == "queries" else key_length) // getattr(tiling, blocked), batch, heads)
  names = [f"{name}_ref" for name in [*operands, *results]]

  def by_name(*refs):
    kernel(**dict(zip(names, refs)), scale=1.0 / math.sqrt(head_dim), causal=causal, rate=rate, tiling=tiling)

  return pl.pallas_call(by_name, name=kernel.__name__, grid=grid, in_specs=[specs[name] for name in operands],
                        out_specs=[specs[name] for name in results], out_shape=list(results.values()),
                        interpret=interpret,
                        compiler_params=plt.CompilerParams(num_warps=tiling.warps, num_stages=tiling.stages),
                        )(*operands.values())


def _with_bias(operands: dict, bias) -> dict:
  return operands if bias is None else {**operands, "bias": bias}


def _forward(q, k, v, key_valid, seed, bias, causal, rate, tiling, interpret):
  """(out, row_max, row_sum): the output, and each row's largest score and sum of exp(score - largest)
  [batch, heads, queries], in fp32."""
  batch, query_length, heads, _ = q.shape
  return _run(_forward_kernel, "queries", _with_bias(dict(seed=seed, key_valid=key_valid, q=q, k=k, v=v), bias),
              dict(out=jax.ShapeDtypeStruct(q.shape, q.dtype),
                   row_max=jax.ShapeDtypeStruct((batch, heads, query_length), jnp.float32),
                   row_sum=jax.ShapeDtypeStruct((batch, heads, query_length), jnp.float32)),
              causal=causal, rate=rate, tiling=tiling, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention(q, k, v, key_valid, seed, bias, causal, rate, tiling, interpret):
  return _forward(q, k, v, key_valid, seed, bias, causal, rate, tiling, interpret)[0]


def _attention_forward(q, k, v, key_valid, seed, bias, causal, rate, tiling, interpret):
  out, row_max, row_sum = _forward(q, k, v, key_valid, seed, bias, causal, rate, tiling, interpret)
  return out, (q, k, v, key_valid, seed, bias, out, row_max, row_sum)


def _attention_backward(causal, rate, tiling, interpret, residuals, d_out):
  q, k, v, key_valid, seed, bias, out, row_max, row_sum = residuals
  # Each row's sum of d_out * out equals its sum of probabilities times their gradient, dropout included.
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
  operands = _with_bias(dict(seed=seed, key_valid=key_valid, q=q, k=k, v=v, d_out=d_out.astype(q.dtype),
                             row_max=row_max, row_sum=row_sum, delta=delta), bias)
  options = dict(causal=causal, rate=rate, tiling=tiling, interpret=interpret)
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  dk, dv = _run(_dkv_kernel, "keys", operands, dict(dk=like(k), dv=like(v)), **options)
  results = dict(dq=like(q)) if bias is None else dict(dq=like(q), d_bias=like(bias))
  dq, *d_bias = _run(_dq_kernel, "queries", operands, results, **options)
  return dq, dk, dv, None, None, d_bias[0] if d_bias else None


_attention.defvjp(_attention_forward, _attention_backward)


def _target_platform() -> str:
  """The platform the traced program is for: its mesh's devices' where a mesh is set (a plan compiles for GPUs on a
  CPU), else the default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.devices()[0].platform


def attention(q, k, v, *, key_valid=None, causal: bool = False, rate: float = 0.0, seed=None, bias=None,
              tiling: Tiling = TILING, interpret=None) -> jax.Array:
  """Softmax(q k^T / sqrt(head_dim) + bias) v over [batch, length, heads, head_dim] arrays, with the probabilities
  dropped out at `rate` under `seed` (two uint32 words: `Dropout.hash_seed`); `key_valid` [batch, keys]
  marks real keys; `bias` [batch, heads, queries, keys] (not with `causal`) is differentiated too. The kernels
  are interpreted where `interpret` says, by default where the program is for a CPU (Triton compiles for GPUs
  only). The decisions do not depend on the tiling."""
  if bias is not None and (causal or bias.shape != (q.shape[0], q.shape[2], q.shape[1], k.shape[1])):
    raise ValueError(f"flash_dropout: a bias must be [batch, heads, queries, keys] = "
                     f"{[q.shape[0], q.shape[2], q.shape[1], k.shape[1]]}, not {list(bias.shape)}, and without "
                     "causal (a causal mask belongs in the bias then)")
  if not applies(q.shape[1], k.shape[1], q.shape[-1], tiling):
    raise ValueError(f"flash_dropout: lengths {q.shape[1]}, {k.shape[1]} must be multiples of "
                     f"{math.lcm(tiling.queries, tiling.keys)} (tiling {tiling}) and head_dim {q.shape[-1]} a power "
                     "of 2 >= 16")
  if rate > 0 and seed is None:
    raise ValueError("flash_dropout: dropout needs a seed")
  key_valid = (jnp.ones((k.shape[0], k.shape[1]), jnp.int32) if key_valid is None
               else jnp.broadcast_to(key_valid, (k.shape[0], k.shape[1])).astype(jnp.int32))
  seed = jnp.zeros((2,), jnp.uint32) if seed is None else seed
  if interpret is None:  # a chip that runs neither is refused earlier, by layers.attention_refusal
    interpret = _target_platform() == "cpu"
  return _attention(q, k, v, key_valid, seed, bias, causal, float(rate), tiling, interpret)
