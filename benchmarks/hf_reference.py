"""Our training step and HuggingFace transformers' PyTorch one, set up alike: what the benchmarks share.

Not a script: `benchmarks/train_step.py` (speed) and `benchmarks/convergence.py` (learning curves)
import it. Both sides of a comparison are built from one family (fitted to its data) and one
`AdamWSettings`:

- `OurTrainer`: the family on a one-device CPU mesh through `steps.make_setup` and
  `steps.jit_train_step`, with `optimizers.make_optimizer` (AdamW, global-norm clipping, no decay on
  biases and LayerNorm scales) and `optimizers.warmup_linear_decay`, exactly as pretrain.train builds
  them; evaluation through `steps.jit_eval_step`.
- `HFTrainer`: the transformers class of `pretrain.registry`'s mapping, built from the mapping's config
  and loaded with our initial weights (`hf_mappings.common.to_hf`), trained with `torch.optim.AdamW`
  under the same schedule (a LambdaLR of the same factors), clipping (`clip_grad_norm_`) and decay mask
  (read off our `optimizers.decay_mask` through the mapping's rules), on a loss computed as our family
  computes it (`hf_loss_and_metrics`).

Both take the same numpy batches of the objective's features (`HFTrainer` converts them). XLNet carries
its memory from step to step in both: ours as [b, n_layer, mlen, d] in the family's carry, HF's as a
list of [mlen, b, d] per layer (`mems`). With bi_data our model reads even rows forwards and odd rows
backwards, HF the first half of the batch forwards and the second half backwards, so HF gets the rows
reordered (`hf_row_order`); its memory stays in that order, and every loss is a sum over rows.
"""
import dataclasses
from typing import Any, Dict, Iterable, Optional

import numpy as np

# The token-level task of each family: its metrics are named <task>_loss and <task>_accuracy.
TOKEN_TASK = {"bert": "mlm", "albert": "mlm", "xlnet": "plm", "bart": "denoising"}
SENTENCE_TASK = {"bert": ("nsp", "seq_relationship_logits"), "albert": ("sop", "sop_logits")}  # ours, HF output
# transformers config settings for training as ours does, beyond the mapping's: XLNet returns its memory
# in train mode too; ALBERT's SOP head has no dropout in ours (nor in the reference), where HF's drops
# classifier_dropout_prob (0.1 by default) of the pooled output.
HF_TRAINING_CONFIG = {"xlnet": {"use_mems_train": True}, "albert": {"classifier_dropout_prob": 0.0}}


@dataclasses.dataclass(frozen=True)
class AdamWSettings:
  """The optimizer and schedule of a run, as gin_configs/runs/pretrain.gin's macros name them."""
  peak_learning_rate: float
  warmup_steps: int
  total_steps: int
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-6
  clip_norm: float = 1.0

  def learning_rate_factor(self, step: int) -> float:
    """The schedule over its peak at `step` (0 for the first update), as optimizers.warmup_linear_decay's."""
    warmup, total = max(self.warmup_steps, 1), max(self.total_steps - self.warmup_steps, 1)
    if step < self.warmup_steps:
      return step / warmup
    return max(0.0, 1.0 - (step - self.warmup_steps) / total)

  def ours(self):
    """(optimizer, schedule) from pretrain.optimizers."""
    from pretrain import optimizers
    schedule = optimizers.warmup_linear_decay(self.peak_learning_rate, self.warmup_steps, self.total_steps)
    return optimizers.make_optimizer(schedule, "adamw", weight_decay=self.weight_decay, b1=self.b1, b2=self.b2,
                                     eps=self.eps, clip_norm=self.clip_norm), schedule


def without_dropout(family):
  """The family with every dropout rate of its model config at 0 (both models are then deterministic); other
  dropout settings (how masks are drawn) stay."""
  rates = {field.name: 0.0 for field in dataclasses.fields(family.config)
           if "dropout" in field.name and isinstance(getattr(family.config, field.name), (int, float))}
  return dataclasses.replace(family, config=dataclasses.replace(family.config, **rates))


# ----------------------------------------------------------------------------- ours


class OurTrainer:
  """Our train state and jitted steps on one device, built as pretrain.train builds them."""

  def __init__(self, family, feature_lengths, batch_size: int, settings: AdamWSettings, device, seed: int = 0):
    import jax

    from pretrain import partitioning, steps
    self.mesh = partitioning.make_mesh({"data": -1, "fsdp": 1, "model": 1}, devices=[device])
    optimizer, schedule = settings.ours()
    self.setup = steps.make_setup(family, feature_lengths, batch_size, self.mesh, optimizer, schedule)
    with self._context():
      self.state = jax.jit(self.setup.init_state, out_shardings=self.setup.state_shardings)(jax.random.PRNGKey(seed))
      self._train_step = steps.jit_train_step(self.setup)
      self._eval_step = steps.jit_eval_step(self.setup)

  def ready(self) -> "OurTrainer":
    """Itself, once its state is on the device (initialised)."""
    import jax
    jax.block_until_ready(self.state)
    return self

  def _context(self):
    from pretrain import partitioning
    return partitioning.tracing_context(self.mesh, self.setup.rules)  # as pretrain.train traces its steps

  @property
  def num_params(self) -> int:
    import jax
    return sum(x.size for x in jax.tree.leaves(self.state.params))

  def numpy_params(self):
    import jax
    return jax.tree.map(np.asarray, jax.device_get(self.state.params))

  def device_batch(self, numpy_batch):
    from pretrain import partitioning
    return partitioning.global_batch(numpy_batch, self.mesh)

  def compile(self, device_batch) -> int:
    """Compiles the train step for this batch ahead of its first call (which then runs it without tracing);
    returns XLA's memory footprint of the step on the device, in bytes: arguments + outputs - aliased
    (the donated state) + temporaries."""
    with self._context():
      self._train_step = self._train_step.lower(self.state, device_batch).compile()
    memory = self._train_step.memory_analysis()
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)

  def program_text(self) -> str:
    """The compiled train step's optimised HLO (after `compile`)."""
    return self._train_step.as_text()

  def dispatch(self, device_batch) -> Dict[str, Any]:
    """Starts one training step (the state is donated and replaced); its metrics, on the device, not waited for."""
    with self._context():
      self.state, metrics = self._train_step(self.state, device_batch)
    return metrics

  def step(self, device_batch) -> Dict[str, float]:
    """One training step; its metrics, once it has finished."""
    import jax
    return {k: float(v) for k, v in jax.device_get(self.dispatch(device_batch)).items()}

  def evaluate(self, numpy_batches: Iterable) -> Dict[str, float]:
    """Mean metrics over held-out batches read in order, XLNet's memory carried from one to the next
    (as pretrain.trainer evaluates)."""
    import jax

    from pretrain import steps
    rows = []
    with self._context():
      carry = steps.initial_eval_carry(self.setup)
      for batch in numpy_batches:
        metrics, carry = self._eval_step(self.state.params, self.device_batch(batch), carry)
        rows.append(jax.device_get(metrics))
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


# ----------------------------------------------------------------------------- HuggingFace transformers


def hf_model(family, params, **config_overrides):
  """transformers' model of the family's config (the registry mapping's class), in train mode, holding our
  `params` (numpy, as our model holds them)."""
  import torch
  import transformers

  from pretrain import registry
  from pretrain.hf_mappings import common
  mapping = registry.get(family.name).mapping
  kwargs = {**mapping.hf_config(family.config), **config_overrides}
  config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
  model = getattr(transformers, mapping.HF_CLASS)(config).train()
  state = {key: torch.tensor(value) for key, value in common.to_hf(params, mapping.rules(family.config)).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  for key in set(state) & set(dict(model.named_buffers())):
    # A weight we train that HF keeps fixed (BART's final_logits_bias, a zero buffer in HF; fairseq has
    # none) trains here too: the comparison is of the training, with the same parameters on both sides.
    owner_name, _, attribute = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner.register_parameter(attribute, torch.nn.Parameter(owner._buffers.pop(attribute)))
  loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
  untied = [name for name in missing if model.state_dict()[name].data_ptr() not in loaded]
  if unexpected or untied:  # only weights tied to loaded ones (LM heads) may be left to the model
    raise ValueError(f"{mapping.HF_CLASS}: weights not loaded {untied[:5]}, unknown weights {unexpected[:5]}")
  return model


def hf_no_decay_names(family, model, params) -> set:
  """Names (as model.named_parameters gives them) of the parameters our optimizer does not decay:
  our `optimizers.decay_mask` carried through the mapping's rules, so both decay the same weights."""
  from pretrain import optimizers, registry
  from pretrain.hf_mappings import common
  decayed = common.flatten_params(optimizers.decay_mask(params))
  by_key = {rule.hf_key: bool(decayed[rule.flax_path]) for rule in registry.get(family.name).mapping.rules(
      family.config)}
  names = [name for name, _ in model.named_parameters()]
  unknown = [name for name in names if name not in by_key]
  if unknown:
    raise ValueError(f"parameters of {type(model).__name__} the mapping does not name: {unknown[:5]}")
  return {name for name in names if not by_key[name]}


def hf_row_order(family, batch_size: int) -> np.ndarray:
  """Our batch row of each of HF's rows: with bi_data, HF reads its first half forwards and its second
  half backwards, where our rows alternate (forward, backward, ...)."""
  if family.name == "xlnet" and family.config.bi_data:
    return np.concatenate([np.arange(0, batch_size, 2), np.arange(1, batch_size, 2)])
  return np.arange(batch_size)


def hf_inputs(family, numpy_batch):
  """(the model's keyword arguments, our batch's features as torch tensors) for one batch, rows in HF's
  order. No labels: the loss is ours (`hf_loss_and_metrics`)."""
  import torch
  order = hf_row_order(family, len(next(iter(numpy_batch.values()))))
  b = {name: torch.from_numpy(np.ascontiguousarray(np.asarray(value)[order])) for name, value in numpy_batch.items()}
  if family.name in ("bert", "albert"):
    inputs = {"input_ids": b["input_ids"].long(), "token_type_ids": b["segment_ids"].long(),
              "attention_mask": (b["input_ids"] > 0).long()}  # ours masks padding (id 0) from the ids
  elif family.name == "xlnet":
    inputs = {"input_ids": b["input_ids"].long(), "token_type_ids": b["segment_ids"].long(),
              "perm_mask": b["perm_mask"], "target_mapping": b["target_mapping"]}
  else:
    inputs = {"input_ids": b["encoder_input_ids"].long(), "attention_mask": (b["encoder_input_ids"] > 0).long(),
              "decoder_input_ids": b["decoder_input_ids"].long()}  # the decoder: causal mask alone, as ours
  return inputs, b


def weighted_cross_entropy(logits, targets, weights):
  """pretrain.families.base.weighted_cross_entropy in torch: summed over weighted positions, divided by
  the sum of the weights; and the accuracy, likewise."""
  import torch.nn.functional as F
  losses = F.cross_entropy(logits.float().flatten(0, -2), targets.long().flatten(), reduction="none")
  weights = weights.float().flatten()
  total = weights.sum().clamp_min(1e-9)
  accuracy = ((logits.argmax(-1).flatten() == targets.long().flatten()) * weights).sum() / total
  return (losses * weights).sum() / total, accuracy


def hf_loss_and_metrics(family, outputs, b):
  """The loss of our family (pretrain/families/*.py) from transformers' outputs, and its metrics by
  our names: BERT/ALBERT MLM at the masked positions plus the NSP/SOP mean; XLNet at target_mapping's
  predictions; BART over the decoder positions, each divided by its weights' sum."""
  import torch
  import torch.nn.functional as F
  if family.name in ("bert", "albert"):
    positions = b["masked_positions"].long()[..., None]
    mlm_logits = torch.take_along_dim(outputs.prediction_logits, positions, dim=1)  # HF predicts every position
    mlm_loss, mlm_accuracy = weighted_cross_entropy(mlm_logits, b["masked_ids"], b["masked_weights"])
    task, output_name = SENTENCE_TASK[family.name]
    pair_logits, labels = getattr(outputs, output_name).float(), b[f"{task}_label"].long()
    pair_loss = F.cross_entropy(pair_logits, labels)
    pair_accuracy = (pair_logits.argmax(-1) == labels).float().mean()
    return mlm_loss + pair_loss, {"mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy, f"{task}_loss": pair_loss,
                                  f"{task}_accuracy": pair_accuracy}
  targets, weights = (("target_ids", "target_weights") if family.name == "xlnet"
                      else ("decoder_target_ids", "decoder_weights"))
  loss, accuracy = weighted_cross_entropy(outputs.logits, b[targets], b[weights])
  task = TOKEN_TASK[family.name]
  return loss, {f"{task}_loss": loss, f"{task}_accuracy": accuracy}


class HFTrainer:
  """transformers' model of the family with torch.optim.AdamW, set up as `OurTrainer`'s optimizer is."""

  def __init__(self, family, batch_size: int, settings: AdamWSettings, params, seed: int = 0, device: str = "cpu",
               compile_backend: Optional[str] = None):
    """`params`: our initial weights (numpy), which the model starts from; `seed`: torch's, for dropout.
    On a CUDA `device` it trains as people train it there: fp32 weights, bf16 autocast, fused AdamW, and
    transformers' default attention for the model (sdpa where it has one). `compile_backend` (e.g. 'inductor'):
    the model's forward (and so its backward) through torch.compile with it, which compiles at the first step."""
    import torch
    torch.manual_seed(seed)
    self.family, self.batch_size, self.settings, self.device = family, batch_size, settings, torch.device(device)
    self.model = hf_model(family, params, **HF_TRAINING_CONFIG.get(family.name, {})).to(self.device)
    # the same parameters, compiled or not
    self.forward_model = torch.compile(self.model, backend=compile_backend) if compile_backend else self.model
    no_decay = hf_no_decay_names(family, self.model, params)
    named = list(self.model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": settings.weight_decay},
              {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
    self.optimizer = torch.optim.AdamW(groups, lr=settings.peak_learning_rate, betas=(settings.b1, settings.b2),
                                       eps=settings.eps, fused=self.on_gpu or None)
    self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, settings.learning_rate_factor)
    self.mems = self.initial_mems()

  @property
  def num_params(self) -> int:
    return sum(p.numel() for p in self.model.parameters())

  @property
  def on_gpu(self) -> bool:
    return self.device.type == "cuda"

  @property
  def attention(self) -> str:
    """transformers' attention implementation for this model (eager, sdpa, ...)."""
    return self.model.config._attn_implementation

  def initial_mems(self):
    """XLNet: a memory of zeros, as our family's initial carry; None for the others."""
    import torch
    if self.family.name != "xlnet":
      return None
    cfg = self.family.config
    return [torch.zeros(cfg.mem_len, self.batch_size, cfg.d_model, device=self.device) for _ in range(cfg.n_layer)]

  def device_batch(self, numpy_batch):
    """(the model's keyword arguments, our features) of one batch as tensors on the model's device."""
    return tuple({k: v.to(self.device) for k, v in d.items()} for d in hf_inputs(self.family, numpy_batch))

  def _forward(self, device_batch, mems):
    import torch
    inputs, b = device_batch
    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.on_gpu):
      outputs = self.forward_model(**inputs, **({"mems": mems} if mems is not None else {}))
    loss, metrics = hf_loss_and_metrics(self.family, outputs, b)
    return loss, metrics, (list(outputs.mems) if mems is not None else None)

  def dispatch(self, device_batch) -> Dict[str, Any]:
    """Starts one training step: forward, our loss, backward, clipping, AdamW, the schedule's next factor. Its
    metrics, as tensors on the device: nothing here waits for the device."""
    import torch
    self.optimizer.zero_grad(set_to_none=True)
    loss, metrics, self.mems = self._forward(device_batch, self.mems)  # new memory, detached by the model
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_norm)
    self.optimizer.step()
    self.scheduler.step()
    return {"loss": loss.detach(), "grad_norm": grad_norm, **{k: v.detach() for k, v in metrics.items()}}

  def step(self, numpy_batch) -> Dict[str, float]:
    """One training step on a batch from the host; its metrics, once it has finished."""
    return {k: v.item() for k, v in self.dispatch(self.device_batch(numpy_batch)).items()}

  def evaluate(self, numpy_batches: Iterable, mems: Optional[list] = None) -> Dict[str, float]:
    """Mean metrics over held-out batches in eval mode, XLNet's memory starting from zeros and carried."""
    import torch
    mems = self.initial_mems() if mems is None else mems
    rows = []
    self.model.eval()
    with torch.no_grad():
      for batch in numpy_batches:
        loss, metrics, mems = self._forward(self.device_batch(batch), mems)
        rows.append({"loss": loss.item(), **{k: v.item() for k, v in metrics.items()}})
    self.model.train()
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
