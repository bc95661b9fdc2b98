"""XLNet (Yang et al. 2019): a Transformer-XL encoder trained as a permutation language model.

A batch-major re-implementation of the reference TF code (zihangdai/xlnet `modeling.py`), which
HuggingFace's `XLNetLMHeadModel` mirrors: relative positional attention with content, position
and segment biases, segment-level recurrence (memory), and two-stream attention in which the
query stream `g` predicts a position from its location alone while the content stream `h` also
sees the token there.

Conventions (as the reference, only batch first):
- `perm_mask[b, i, j] = 1`: position i may not attend to position j. Memory is always visible.
- `target_mapping[b, m, j] = 1`: the m-th prediction is at position j (one 1 per row; rows of zeros
  = padding). HuggingFace's takes any weights; one-hot rows let the query stream attend from its
  predicted positions only.
- `input_mask[b, j] = 1`: position j is padding (optional; nobody attends to it).
- `mems`: [b, n_layer, mlen, d_model], each layer's input states of earlier segments. Batch leads
  so that the trainer can split it with the batch (gradient accumulation, data parallelism).
- With `bi_data`, even batch rows use forward relative distances and odd rows backward ones (for
  reversed text). The reference splits each core's batch in halves instead; alternating rows keep
  every even-sized contiguous slice (a host's rows, a microbatch) half forward, half backward.
Deliberate differences: one dropout mask on the relative encodings per direction rather than per
example (saves projecting [b, klen + qlen, d_model] per layer); GELU is the exact (erf) form
HuggingFace uses, where the reference TF code uses its tanh approximation.
"""
import dataclasses
import functools
from typing import Any, List, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import flash_dropout, layers

MEMORY_AXES = ("activation_batch", None, "activation_length", "activation_embed")
BIAS_NAMES = ("r_w_bias", "r_r_bias", "r_s_bias")  # content, position and segment biases
MASKED_SCORE = 1e30  # subtracted from blocked scores, as the reference does
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "triton")
# What attention's backward pass reads of the probabilities: 'written', the forward's output behind an optimization
# barrier (layers.softmax's keep_output_as_written); 'xla', whatever XLA keeps to have them again; 'auto', the chip's.
PROBS_KEPT = ("auto", "written", "xla")


def probs_kept_for_device(device) -> str:
  """'written' on GPUs, where XLA otherwise kept exp(scores - max) in fp32: XLNet-Large's 2-layer H200 plan takes
  5.21 ms and 2.56 GiB with the barrier, 5.31 ms and 2.83 GiB without. 'xla' elsewhere: on TPUs the barrier costs,
  XLNet-Large's v3-512 plan >= 0.854 s and 11.46 GiB per core with it, 0.831 s and 11.05 GiB without (libtpu
  0.0.42.1, benchmarks/plan_xlnet_large_v3_512.py)."""
  return "written" if device.platform in ("gpu", "cuda") else "xla"


@dataclasses.dataclass(frozen=True)
class XLNetConfig:
  vocab_size: Optional[int] = 32000
  d_model: int = 768
  n_layer: int = 12
  n_head: int = 12
  d_head: int = 64
  d_inner: int = 3072
  dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  mem_len: int = 384  # 0 disables memory
  # Positions of a segment cached for the next one; None or 0 = all. A pretraining run sets it from the
  # data's TASK_FEATURE_LENGTHS['reuse_len'], the tokens each window shares with the next.
  reuse_len: Optional[int] = None
  clamp_len: int = -1  # clip relative distances to [-clamp_len, clamp_len]; -1 = no clipping
  bi_data: bool = True
  untie_r: bool = True  # per-layer r_w/r_r/r_s biases; False shares one set across layers
  attn_type: str = "bi"
  dtype: Any = jnp.float32  # compute dtype; parameters are always fp32
  remat_policy: str = "none"
  scan_layers: bool = False  # one nn.scan over the layers (see layers.layer_stack)
  dropout_masks: str = "auto"  # dropout.DROPOUT_MASKS; 'auto': the chip's cheaper one
  gelu_gradient: str = "formula"  # layers.GELU_GRADIENTS: what the GELU's backward pass keeps
  # ATTENTION_IMPLEMENTATIONS: 'xla' computes the scores, probabilities and dropout masks in XLA; 'triton' adds
  # the position and segment scores (and the mask) to the content scores inside models/flash_dropout.py's kernel
  # (NVIDIA GPUs; a CPU interprets it), where its shapes tile, XLA's elsewhere. 'auto' is 'xla' on every chip:
  # the kernel is not yet measured on a GPU.
  attention_implementation: str = "auto"
  attention_probs_kept: str = "auto"  # PROBS_KEPT

  def __post_init__(self):
    for name, known in (("attention_implementation", ATTENTION_IMPLEMENTATIONS), ("attention_probs_kept", PROBS_KEPT)):
      if getattr(self, name) not in known:
        raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(known)}")
    if self.attn_type != "bi":
      raise ValueError(f"attn_type={self.attn_type!r}: only 'bi' (XLNet pretraining's attention) is supported")
    layers.check_at_least(1, vocab_size=self.vocab_size, d_model=self.d_model, n_layer=self.n_layer,
                          n_head=self.n_head, d_head=self.d_head, d_inner=self.d_inner)
    layers.check_at_least(0, mem_len=self.mem_len, reuse_len=self.reuse_len)
    layers.check_fractions(dropout_rate=self.dropout_rate)


def relative_encoding(qlen: int, klen: int, d_model: int, bi_data: bool, clamp_len: int) -> jax.Array:
  """Sinusoids of the query-minus-key distances klen .. -qlen+1, [directions, klen + qlen, d_model].

  Direction 0 is forward; with `bi_data` direction 1 holds the negated (backward) distances.
  """
  distances = jnp.arange(klen, -qlen, -1, dtype=jnp.float32)
  distances = jnp.stack([distances, -distances]) if bi_data else distances[None]
  if clamp_len > 0:
    distances = jnp.clip(distances, -clamp_len, clamp_len)
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model))
  angles = distances[..., None] * inv_freq
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def rel_shift(scores: jax.Array, klen: int) -> jax.Array:
  """[b, n, q, klen + q] scores per distance -> [b, n, q, klen] scores per key.

  Row i of the input runs over distances klen .. -q+1; key j sits at distance (klen - q + i) - j.
  Dropping one row of the transposed layout shifts row i left by q - i: a reshape, no gather.
  """
  b, n, q, r = scores.shape
  shifted = scores.reshape(b, n, r, q)[:, :, 1:].reshape(b, n, q, r - 1)
  return shifted[..., :klen]


# Binary digits of a row's shift per stage of shift_rows. XLNet-Large's step (shifts < 512) with 3, three stages of
# 8 slices, plans 3.8% fewer HBM bytes on a v3-512 than with 1, nine stages of 2 (2.5% on a v4-128, the same on a
# v5litepod-256); with one layer on a v3-8, 2 and 4 saved less than 3 and 5 added bytes.
SHIFT_DIGIT_BITS = 3


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def shift_rows(scores: jax.Array, starts: jax.Array, width: int) -> jax.Array:
  """[b, n, m, r] -> [b, n, m, width]: row (b, m) keeps the columns from starts[b, m] on, 0 <= start <= r - width.

  A shift per row in stages, each taking a digit of the start (`_shift_digits`), largest first (the rows
  narrow soonest) and selecting among as many slices. (XLA makes a gather of this shape a loop over rows on
  TPU, and take_along_axis costs 30x the bytes.) The gradient puts each row back the same way, one select per
  stage: autodiff would pad and add every branch of every select.
  """
  shift = scores.shape[-1] - width
  x = jnp.pad(scores, [(0, 0)] * 3 + [(0, (1 << shift.bit_length()) - 1 - shift)])  # shifts < 2**bits
  for stride, radix in reversed(_shift_digits(shift)):
    kept = x.shape[-1] - (radix - 1) * stride
    x = jax.lax.select_n(_digit(starts, stride, radix, x.shape[:3] + (kept,)),
                         *(x[..., d * stride:d * stride + kept] for d in range(radix)))
  return x[..., :width]


def _shift_digits(largest_shift: int) -> List[Tuple[int, int]]:
  """(stride, radix) of each of shift_rows' stages, smallest first: the shift's binary digits SHIFT_DIGIT_BITS at
  a time, the last stage taking the rest."""
  digits, low = [], 0
  while low < largest_shift.bit_length():
    bits = min(SHIFT_DIGIT_BITS, largest_shift.bit_length() - low)
    digits.append((1 << low, 1 << bits))
    low += bits
  return digits


def _digit(starts, stride, radix, shape):
  return jnp.broadcast_to(((starts // stride) % radix)[:, None, :, None], shape)


def _shift_rows_forward(scores, starts, width):
  return shift_rows(scores, starts, width), (starts, scores.shape[-1])


def _shift_rows_backward(width, residuals, grad):
  starts, columns = residuals
  for stride, radix in _shift_digits(columns - width):  # smallest first: the reverse of the forward stages
    extra = (radix - 1) * stride
    grad = jax.lax.select_n(_digit(starts, stride, radix, grad.shape[:3] + (grad.shape[-1] + extra,)),
                            *(jnp.pad(grad, [(0, 0)] * 3 + [(d * stride, extra - d * stride)]) for d in range(radix)))
  return grad[..., :columns], None


shift_rows.defvjp(_shift_rows_forward, _shift_rows_backward)


def position_scores(query: jax.Array, key_r: jax.Array) -> jax.Array:
  """query [b, q, n, d] x key_r [directions, r, n, d] -> [b, n, q, r]; row i uses direction i % directions."""
  directions = key_r.shape[0]
  query = query.reshape((query.shape[0] // directions, directions) + query.shape[1:])
  scores = jnp.einsum("zjnd,bzind->bznij", key_r, query)  # this operand order spares XLA a transpose on TPU
  return scores.reshape((-1,) + scores.shape[2:])


def attention_masks(perm_mask, input_mask, batch: int, qlen: int, mlen: int):
  """(query-stream, content-stream) masks [b, q, mlen + q], True = blocked.

  The content stream may always see its own position; the query stream only if perm_mask allows.
  """
  blocked = jnp.zeros((batch, qlen, qlen), bool) if perm_mask is None else perm_mask > 0
  if input_mask is not None:
    blocked = blocked | (input_mask[:, None, :] > 0)
  blocked = jnp.pad(blocked, ((0, 0), (0, 0), (mlen, 0)))
  own_position = jnp.eye(qlen, mlen + qlen, k=mlen, dtype=bool)
  return blocked, blocked & ~own_position


class PredictedRows(NamedTuple):
  """What the query stream's rows need: row m of batch row b predicts position positions[b, m]."""
  starts: jax.Array  # [b, m] int32: the first of the row's klen relative distances, as an index into them
  blocked: jax.Array  # [b, m, klen] bool: the keys the row may not see (its position's perm_mask row)
  seg_diff: jax.Array  # [b, m, klen] bool: keys in another segment than the row's position
  valid: jax.Array  # [b, m] 0/1: rows of zeros in target_mapping are padding


def predicted_rows(target_mapping, mask_g, seg_diff) -> PredictedRows:
  """The rows of the full-length query-stream inputs at target_mapping's positions (one-hot rows or zeros)."""
  positions = jnp.argmax(target_mapping, axis=-1)
  qlen = target_mapping.shape[-1]
  take = lambda x: jnp.take_along_axis(x, positions[..., None], axis=1)
  # Position p sees distances mlen + p - j for keys j; index 0 of relative_encoding is distance klen.
  return PredictedRows(starts=(qlen - 1 - positions).astype(jnp.int32), blocked=take(mask_g),
                       seg_diff=take(seg_diff), valid=target_mapping.sum(-1) > 0)


def segment_difference(segment_ids: jax.Array, mlen: int) -> jax.Array:
  """[b, q, mlen + q] True where query and key lie in different segments; memory counts as segment 0."""
  key_segments = jnp.pad(segment_ids, ((0, 0), (mlen, 0)))
  return segment_ids[:, :, None] != key_segments[:, None, :]


def cache_memory(h: jax.Array, mem: jax.Array, mem_len: int, reuse_len: Optional[int]) -> jax.Array:
  """The next segment's memory: the last mem_len states of [memory, first reuse_len positions of h].

  Kept in the compute dtype, as the reference keeps its cache (bf16 with use_bfloat16): in fp32 it
  would be 0.6 GiB of each v3 core's HBM for XLNet-Large at 16 rows per core.
  """
  if reuse_len:
    h = h[:, :reuse_len]
  states = jnp.concatenate([mem.astype(h.dtype), h], axis=1)
  return jax.lax.stop_gradient(states[:, max(states.shape[1] - mem_len, 0):])


def relative_biases(module: nn.Module, config: XLNetConfig) -> dict:
  init = layers.with_axes(layers.default_kernel_init, ("heads", "kv"))
  return {name: module.param(name, init, (config.n_head, config.d_head), jnp.float32) for name in BIAS_NAMES}


class RelativeAttention(nn.Module):
  """Two-stream relative attention plus the residual LayerNorm; both streams share every weight."""
  config: XLNetConfig

  @nn.compact
  def __call__(self, h, g, mem, pos_emb, seg_diff, mask_h, rows, shared_biases, deterministic):
    cfg = self.config
    head_init = layers.with_axes(layers.default_kernel_init, ("embed", "heads", "kv"))
    shape = (cfg.d_model, cfg.n_head, cfg.d_head)
    weights = {name: self.param(name, head_init, shape, jnp.float32).astype(cfg.dtype) for name in "qkvor"}
    biases = relative_biases(self, cfg) if shared_biases is None else shared_biases
    biases = {name: value.astype(cfg.dtype) for name, value in biases.items()}
    seg_embed = self.param("seg_embed", layers.with_axes(layers.default_kernel_init, (None, "heads", "kv")),
                           (2, cfg.n_head, cfg.d_head), jnp.float32).astype(cfg.dtype)
    norm = layers.layer_norm(cfg.layer_norm_eps, cfg.dtype, "layer_norm")
    drop = layers.Dropout(cfg.dropout_rate, cfg.dropout_masks)

    def project(x, name):
      return layers.constrain(jnp.einsum("bld,dnh->blnh", x, weights[name]), layers.BATCH_LENGTH_HEADS_KV)

    keys_in = jnp.concatenate([mem, h], axis=1)
    key, value = project(keys_in, "k"), project(keys_in, "v")
    key_r = jnp.einsum("zrd,dnh->zrnh", pos_emb, weights["r"])

    def position_and_segment(query, seg_diff, shift, key_r):
      position = shift(position_scores(query + biases["r_r_bias"], key_r))
      segment = jnp.einsum("bind,snd->bnis", query + biases["r_s_bias"], seg_embed)
      return position, jnp.where(seg_diff[:, None], segment[..., 1:], segment[..., :1])

    def attend(query, mask, seg_diff, shift, key, value, key_r):
      if cfg.attention_implementation == "triton" and flash_dropout.applies(query.shape[1], key.shape[1],
                                                                           cfg.d_head):
        position, segment = position_and_segment(query, seg_diff, shift, key_r)
        bias = ((position + segment).astype(jnp.float32) / jnp.sqrt(jnp.float32(cfg.d_head))
                - MASKED_SCORE * mask[:, None]).astype(cfg.dtype)
        context = layers.biased_attention(query + biases["r_w_bias"], key, value, bias, dropout=drop,
                                          deterministic=deterministic)
        return layers.constrain(context, layers.BATCH_LENGTH_HEADS_KV)
      content = jnp.einsum("bind,bjnd->bnij", query + biases["r_w_bias"], key)
      position, segment = position_and_segment(query, seg_diff, shift, key_r)
      scores = (content + position + segment).astype(jnp.float32) / jnp.sqrt(jnp.float32(cfg.d_head))
      # Softmax in fp32: bf16 loses too much in the normaliser.
      kept = cfg.attention_probs_kept
      if kept == "auto":  # a model used outside a run's setup, which resolves it for the mesh's chip
        kept = probs_kept_for_device(jax.devices()[0])
      probs = layers.softmax(scores - MASKED_SCORE * mask[:, None], cfg.dtype,
                             keep_output_as_written=kept == "written")
      probs = drop(probs, deterministic=deterministic)
      return layers.constrain(jnp.einsum("bnij,bjnd->bind", probs, value), layers.BATCH_LENGTH_HEADS_KV)

    def residual(x, context):
      out = drop(jnp.einsum("binh,dnh->bid", context, weights["o"]), deterministic=deterministic)
      return layers.constrain(norm(out + x), layers.BATCH_LENGTH_EMBED)

    klen = key.shape[1]
    h_out = residual(h, attend(project(h, "q"), mask_h, seg_diff, lambda scores: rel_shift(scores, klen),
                               key, value, key_r))
    if g is None:
      return h_out, None
    # The query stream attends from its predicted positions only: each row's distances start elsewhere.
    # It reads the keys and values through a barrier: else XLA's dot merger (on GPUs) gives the two
    # streams' products with value (and their gradients' with key and key_r) one product each, by
    # concatenating their score-sized operands, a copy that took 16% of XLNet-Large's step on an H200.
    context_g = attend(project(g, "q"), rows.blocked, rows.seg_diff,
                       lambda scores: shift_rows(scores[..., 1:], rows.starts, klen),
                       *jax.lax.optimization_barrier((key, value, key_r)))
    return h_out, residual(g, context_g * rows.valid[:, :, None, None].astype(context_g.dtype))


class XLNetLayer(nn.Module):
  """Relative attention, then the shared position-wise FFN on each stream: x = LN(x + FFN(x)).

  The `layer_stack` protocol: carries the streams (h, g); its per-layer output is this layer's
  memory for the next segment (cache_memory of `mem` followed by the layer's input h).
  """
  config: XLNetConfig

  @nn.compact
  def __call__(self, streams, mem, pos_emb, seg_diff, mask_h, rows, shared_biases, deterministic):
    cfg = self.config
    h, g = streams
    new_mem = cache_memory(h, mem, cfg.mem_len, cfg.reuse_len)
    h, g = RelativeAttention(cfg, name="rel_attn")(
        h, g, mem.astype(cfg.dtype), pos_emb, seg_diff, mask_h, rows, shared_biases, deterministic)
    # x = LN(x + Dropout(FFN(x))), with dropout after the activation too, as the reference.
    position_wise = layers.PostLNFeedForwardBlock(cfg.d_inner, cfg.dropout_rate, cfg.dropout_rate,
                                                  cfg.layer_norm_eps, cfg.dtype, dropout_masks=cfg.dropout_masks,
                                                  gelu_gradient=cfg.gelu_gradient, name="ff")
    return (position_wise(h, deterministic), None if g is None else position_wise(g, deterministic)), new_mem


class XLNetLMHeadModel(nn.Module):
  """Features: input_ids, segment_ids [b, l] int32; optional perm_mask [b, l, l], target_mapping
  [b, p, l], input_mask [b, l] (float, see the module docstring). `mems` [b, n_layer, mlen, d_model].

  Returns logits (fp32; [b, p, vocab] from the query stream with target_mapping, else [b, l, vocab]
  from the content stream) and new_mems [b, n_layer, <=mem_len, d_model] (compute dtype, no gradient).
  """
  config: XLNetConfig

  @nn.compact
  def __call__(self, features, deterministic: bool = True, mems: Optional[jax.Array] = None):
    cfg = self.config
    input_ids = features["input_ids"]
    batch, qlen = input_ids.shape
    if cfg.bi_data and batch % 2:
      raise ValueError(f"bi_data=True needs an even batch (alternating forward and backward rows), got batch {batch}")
    if mems is None:
      mems = jnp.zeros((batch, cfg.n_layer, 0, cfg.d_model), cfg.dtype)
    if mems.ndim != 4 or mems.shape[:2] != (batch, cfg.n_layer) or mems.shape[3] != cfg.d_model:
      raise ValueError(f"mems shape {mems.shape}: expected ({batch}, {cfg.n_layer}, mem_length, {cfg.d_model})")
    mlen = mems.shape[2]

    mask_g, mask_h = attention_masks(features.get("perm_mask"), features.get("input_mask"), batch, qlen, mlen)
    seg_diff = segment_difference(features["segment_ids"], mlen)
    drop = layers.Dropout(cfg.dropout_rate, cfg.dropout_masks)
    word = layers.embedding(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), cfg.dtype, "word_embedding")
    h = layers.constrain(drop(word(input_ids), deterministic=deterministic), layers.BATCH_LENGTH_EMBED)
    g, rows, target_mapping = None, None, features.get("target_mapping")
    if target_mapping is not None:
      mask_emb = self.param("mask_emb", layers.with_axes(layers.default_kernel_init, (None, None, "embed")),
                            (1, 1, cfg.d_model), jnp.float32)
      g = jnp.broadcast_to(mask_emb.astype(cfg.dtype), (batch, target_mapping.shape[1], cfg.d_model))
      g = drop(g, deterministic=deterministic)
      rows = predicted_rows(target_mapping, mask_g, seg_diff)
    pos_emb = relative_encoding(qlen, mlen + qlen, cfg.d_model, cfg.bi_data, cfg.clamp_len).astype(cfg.dtype)
    pos_emb = drop(pos_emb, deterministic=deterministic)
    shared_biases = None if cfg.untie_r else relative_biases(self, cfg)

    (h, g), new_mems = layers.layer_stack(
        XLNetLayer, cfg.n_layer, (h, g), mems, pos_emb, seg_diff, mask_h, rows, shared_biases,
        deterministic=deterministic, scan=cfg.scan_layers, remat_policy=cfg.remat_policy, per_layer_args=(0,),
        stack_axis=1, config=cfg)

    output = drop(h if g is None else g, deterministic=deterministic)
    logits = layers.TiedLMBias(cfg.vocab_size, name="lm_loss")(word.attend(output))
    logits = layers.constrain(logits, layers.BATCH_LENGTH_VOCAB)
    new_mems = layers.constrain(new_mems, MEMORY_AXES)
    return {"logits": logits.astype(jnp.float32), "new_mems": new_mems}
