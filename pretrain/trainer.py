"""One generic train loop: sharded state, jitted step, periodic eval, checkpoints, exact resume.

The trainer knows models and data only through a `Family` (pretrain/families/base.py) and a seqio
task name; everything else (mesh, rules, optimizer) is configuration.
"""
import dataclasses
import time
from typing import Any, Dict, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from jax.sharding import PartitionSpec

from data_pipelines import input_pipeline
from models import layers
from pretrain import checkpoints, partitioning
from pretrain.families.base import Family, weight_totals
from pretrain.metrics import MetricsWriter


INIT_ROWS = 2  # rows of the dummy batch that initialises params: bi_data needs a forward and a backward row


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  carry: Any  # state a family carries across steps (XLNet memory); {} otherwise


@dataclasses.dataclass
class Setup:
  """Everything about a run that does not change from step to step."""
  family: Family
  model: nn.Module
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  mesh: Any
  rules: tuple
  state_shardings: TrainState
  batch_shapes: Dict[str, jax.ShapeDtypeStruct]
  microbatches: int = 1

  def abstract_state(self) -> TrainState:
    return jax.eval_shape(lambda: self.init_state(jax.random.PRNGKey(0)))

  def sharded_abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of the state: what restore and ahead-of-time compilation need."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_state(),
                        self.state_shardings)

  def init_state(self, rng) -> TrainState:
    params_rng, dropout_rng, state_rng = jax.random.split(rng, 3)
    example = {k: jnp.zeros((INIT_ROWS,) + s.shape[1:], s.dtype) for k, s in self.batch_shapes.items()}
    params = nn.unbox(self.model.init({"params": params_rng, "dropout": dropout_rng}, example)["params"])
    batch_size = next(iter(self.batch_shapes.values())).shape[0]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params),
                      rng=state_rng, carry=self.family.initial_carry(batch_size))


def build_setup(family: Family, batch_shapes, optimizer, schedule, mesh, rules, microbatches: int = 1) -> Setup:
  """Derives every shardings from the model's logical axis names and the rules."""
  model = family.make_model()
  example = {k: jax.ShapeDtypeStruct((INIT_ROWS,) + s.shape[1:], s.dtype) for k, s in batch_shapes.items()}
  boxed = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)},
                                            {k: jnp.zeros(s.shape, s.dtype) for k, s in example.items()}))["params"]
  param_shardings = partitioning.logical_shardings(nn.get_partition_spec(boxed), mesh, rules)
  replicated = partitioning.replicated(mesh)
  abstract_opt = jax.eval_shape(optimizer.init, nn.unbox(boxed))
  opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_opt, param_shardings,
                                        transform_non_params=lambda _: replicated)
  carry_shardings = partitioning.logical_shardings(
      {k: PartitionSpec(*axes) for k, axes in family.carry_axes().items()}, mesh, rules)
  state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated,
                               carry=carry_shardings)
  return Setup(family, model, optimizer, schedule, mesh, rules, state_shardings, dict(batch_shapes), microbatches)


def resolve_microbatches(batch_size: int, shards: int, microbatches: int, per_device_batch: Optional[int]) -> int:
  """MICROBATCHES, or the number that gives each batch shard PER_DEVICE_BATCH rows at a time."""
  if per_device_batch is None:
    return microbatches
  if microbatches != 1:
    raise ValueError(f"MICROBATCHES={microbatches} and PER_DEVICE_BATCH={per_device_batch}: set one of them")
  if per_device_batch < 1 or batch_size % (shards * per_device_batch):
    raise ValueError(f"PER_DEVICE_BATCH={per_device_batch} does not divide the {batch_size / shards:g} rows that each "
                     f"of the mesh's {shards} batch shards gets from BATCH_SIZE={batch_size}")
  return batch_size // (shards * per_device_batch)


def setup_for_run(family: Family, task_feature_lengths: Mapping[str, int], batch_size: int, mesh,
                  optimizer: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int,
                  vocab_size: int, per_device_batch: Optional[int] = None) -> Setup:
  """The Setup `train` runs, from its gin-bound arguments and the vocabulary size; reads no data.

  pretrain.plan compiles this same Setup for a TPU topology, so its figures are the training step's.
  """
  shards = partitioning.batch_shards(mesh)
  microbatches = resolve_microbatches(batch_size, shards, microbatches, per_device_batch)
  if batch_size % (microbatches * shards):
    raise ValueError(f"BATCH_SIZE={batch_size} is not divisible by MICROBATCHES={microbatches} × the mesh's "
                     f"{shards} batch shards")
  rows = batch_size // (microbatches * shards)
  if family.reverse_odd_rows() and rows % 2:
    raise ValueError(f"bi_data pairs forward and backward rows, but BATCH_SIZE={batch_size} gives {rows} rows per "
                     f"device per microbatch (MICROBATCHES={microbatches}): make it even")
  family = family.with_vocab_size(vocab_size)
  return build_setup(family, family.feature_shapes(batch_size, task_feature_lengths), optimizer, schedule, mesh,
                     partitioning.axis_rules(), microbatches)


def tokens_per_batch(batch_size: int, feature_lengths: Mapping[str, int]) -> int:
  """Input tokens of a global batch (encoder and decoder inputs for encoder-decoder families)."""
  return batch_size * sum(v for k, v in feature_lengths.items() if k.endswith("input_ids"))


def _loss_and_grads(setup: Setup, params, batch, carry, rng, weight_totals=None):
  def loss_fn(p):
    outputs, new_carry = setup.family.forward(setup.model, p, batch, carry, rngs={"dropout": rng}, deterministic=False)
    loss, metrics = setup.family.loss_and_metrics(outputs, batch, weight_totals)
    return loss, (metrics, new_carry)

  (loss, (metrics, new_carry)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, metrics, new_carry, grads


def _split_microbatches(x, n: int, shards: int):
  """[B, ...] -> [n, B / n, ...]: microbatch k is the k-th of n equal runs of rows of every batch shard.

  Every device keeps its own rows, so the scan runs over an unsharded axis and nothing moves. (Cutting
  the batch into n contiguous blocks puts each microbatch on a few devices; the SPMD partitioner then
  computes each device's whole local batch in every iteration, n times the work and more memory.)
  """
  return x.reshape((shards, n, -1) + x.shape[1:]).swapaxes(0, 1).reshape((n, -1) + x.shape[1:])


def _merge_microbatches(x, shards: int):
  """The inverse of _split_microbatches."""
  return x.reshape((x.shape[0], shards, -1) + x.shape[2:]).swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def _accumulated_loss_and_grads(setup: Setup, params, batch, carry, rng):
  """Gradient accumulation: the batch is split into `microbatches` slices scanned in sequence.

  Each slice keeps its own rows' carry, so memory-carrying families see the same rows every step.
  Weighted losses divide by the whole batch's weights (over n), so the mean over slices is exactly
  the plain step's loss even when slices hold different numbers of predicted positions.
  """
  n, shards = setup.microbatches, partitioning.batch_shards(setup.mesh)
  totals = {k: v / n for k, v in weight_totals(batch).items()}
  split = lambda x: _split_microbatches(x, n, shards)
  micro_batches = jax.tree.map(split, batch)
  micro_carry = jax.tree.map(split, carry)

  def body(grad_sum, inputs):
    micro_batch, micro_carry_in, index = inputs
    loss, metrics, new_carry, grads = _loss_and_grads(setup, params, micro_batch, micro_carry_in,
                                                      jax.random.fold_in(rng, index), totals)
    return jax.tree.map(jnp.add, grad_sum, grads), (loss, metrics, new_carry)

  zeros = jax.tree.map(jnp.zeros_like, params)
  grad_sum, (losses, metrics, new_carry) = jax.lax.scan(body, zeros, (micro_batches, micro_carry, jnp.arange(n)))
  return (losses.mean(), jax.tree.map(jnp.mean, metrics),
          jax.tree.map(lambda x: _merge_microbatches(x, shards), new_carry),
          jax.tree.map(lambda g: g / n, grad_sum))


def train_step(setup: Setup, state: TrainState, batch) -> tuple:
  rng = jax.random.fold_in(state.rng, state.step)
  compute = _accumulated_loss_and_grads if setup.microbatches > 1 else _loss_and_grads
  loss, metrics, carry, grads = compute(setup, state.params, batch, state.carry, rng)
  updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads),
             "learning_rate": setup.schedule(state.step)}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, carry=carry), metrics


def eval_step(setup: Setup, params, batch) -> Dict[str, jax.Array]:
  batch_size = next(iter(batch.values())).shape[0]
  outputs, _ = setup.family.forward(setup.model, params, batch, setup.family.initial_carry(batch_size), rngs={},
                                    deterministic=True)
  loss, metrics = setup.family.loss_and_metrics(outputs, batch)
  return {**metrics, "loss": loss}


def jit_train_step(setup: Setup):
  batch_shardings = {k: partitioning.batch_sharding(setup.mesh) for k in setup.batch_shapes}
  replicated = partitioning.replicated(setup.mesh)
  return jax.jit(lambda state, batch: train_step(setup, state, batch),
                 in_shardings=(setup.state_shardings, batch_shardings),
                 out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))


def _config_json(value):
  if dataclasses.is_dataclass(value):
    return {f.name: _config_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (list, tuple)):
    return [_config_json(v) for v in value]
  return str(jnp.dtype(value)) if isinstance(value, (type, np.dtype)) else str(value)


def run_config(family: Family, task_name: str, feature_lengths: Mapping[str, int]) -> dict:
  """What export and import need to rebuild the model without gin: family, sizes, vocabulary."""
  return {"family": family.name, "model_config": _config_json(family.config), "task": task_name,
          "feature_lengths": dict(feature_lengths), "vocab_model": "vocab.model"}


def _mean_metrics(rows):
  return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _keep_vocabulary(kept: epath.Path, run_vocab: str) -> None:
  """MODEL_DIR keeps the vocabulary its checkpoints were trained with; a run must not switch it."""
  model = epath.Path(run_vocab).read_bytes()
  if kept.exists():
    if kept.read_bytes() != model:
      raise ValueError(f"VOCAB_MODEL={run_vocab!r} differs from {kept}, the vocabulary this MODEL_DIR was "
                       "trained with; use that one or a new MODEL_DIR")
  elif jax.process_index() == 0:
    kept.write_bytes(model)


def _saved_scan_layers(model_dir: str, step: int) -> bool:
  return bool(checkpoints.read_run_config(model_dir, step)[1]["model_config"].get("scan_layers", False))


def _imported_params(setup: Setup, model_dir: str, step: int):
  """The params of a weights-only checkpoint (pretrain.import_hf writes unrolled layers), sharded and
  laid out as this run's model has them."""
  abstract = setup.sharded_abstract_state().params
  scan = setup.family.config.scan_layers
  if _saved_scan_layers(model_dir, step) == scan:
    return checkpoints.restore_params(model_dir, step, abstract)
  host_params = checkpoints.restore_params(model_dir, step)
  params = layers.stack_layer_params(host_params) if scan else layers.unstack_layer_params(host_params)
  return jax.tree.map(lambda target, value: jax.make_array_from_callback(target.shape, target.sharding,
                                                                         lambda index: value[index]),
                      abstract, params)


def _check_same_layout(setup: Setup, model_dir: str, step: int) -> None:
  saved = _saved_scan_layers(model_dir, step)
  if saved != setup.family.config.scan_layers:
    raise ValueError(f"the checkpoints in {checkpoints.checkpoint_dir(model_dir)} have scan_layers={saved}, this run "
                     f"sets scan_layers={setup.family.config.scan_layers}: resume with the setting they were saved with")


def _state_from_weights(setup: Setup, params, seed: int) -> TrainState:
  """A fresh state around given params: step 0, new optimizer state, rng and carry; data from the start."""
  # One program, so XLA drops the random params init_state would make and never holds two states.
  def fresh(rng, params):
    return setup.init_state(rng).replace(params=params, opt_state=setup.optimizer.init(params))

  return jax.jit(fresh, out_shardings=setup.state_shardings)(jax.random.PRNGKey(seed), params)


def input_pipeline_for_run(family: Family, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
                           batch_size: int, batch_shards: int, seed: int, data_shards: Optional[int],
                           **process) -> input_pipeline.InputPipeline:
  """This process's batches of the run's task, shaped for the family. `process`: process_index and
  process_count when not this JAX process's (benchmarks/input_pipeline.py plays one host of many)."""
  family_shards = family.data_shards(batch_size)
  if family_shards and data_shards not in (None, family_shards):
    raise ValueError(f"DATA_SHARDS={data_shards}: {family.name} reads one data shard per batch row "
                     f"(BATCH_SIZE={batch_size}); leave DATA_SHARDS unset")
  batch_shapes = family.feature_shapes(batch_size, task_feature_lengths)
  return input_pipeline.InputPipeline(mixture_or_task_name, task_feature_lengths, batch_size,
                                      {k: (s.shape[1:], s.dtype) for k, s in batch_shapes.items()},
                                      batch_shards=batch_shards, seed=seed, num_data_shards=family_shards or data_shards,
                                      reverse_odd_rows=family.reverse_odd_rows(), **process)


def train(*, model_dir: str, family: Family, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
          batch_size: int, train_steps: int, mesh_shape: Mapping[str, int], optimizer: optax.GradientTransformation,
          schedule: optax.Schedule, log_every_steps: int = 10, checkpoint_every_steps: int = 1000,
          eval_every_steps: int = 1000, eval_steps: int = 10, keep_checkpoints: int = 3, seed: int = 0,
          microbatches: int = 1, per_device_batch: Optional[int] = None, num_slices: int = 1,
          data_shards: Optional[int] = None) -> Dict[str, Any]:
  """Trains until `train_steps`, resuming from the latest checkpoint in model_dir if there is one.

  Gradient accumulation: `microbatches` slices per step, or as many as give each batch shard (a
  data-parallel group of devices) `per_device_batch` rows at a time.
  `data_shards`: how many seqio shards make up the global batch (default: one per process).
  Returns a summary: first and last logged loss, steps run this call, checkpoint directory.
  """
  mesh = partitioning.make_mesh(mesh_shape, num_slices=num_slices)
  data = input_pipeline_for_run(family, mixture_or_task_name, task_feature_lengths, batch_size,
                                partitioning.batch_shards(mesh), seed, data_shards)
  setup = setup_for_run(family, task_feature_lengths, batch_size, mesh, optimizer, schedule, microbatches,
                        data.vocabulary.vocab_size, per_device_batch)
  family = setup.family

  model_path = epath.Path(model_dir)
  model_path.mkdir(parents=True, exist_ok=True)
  _keep_vocabulary(model_path / "vocab.model", data.vocabulary.sentencepiece_model_file)
  manager = checkpoints.make_manager(model_dir, keep_checkpoints)
  train_iterator = data.iterator("train")

  with mesh, nn.logical_axis_rules(setup.rules):
    latest = manager.latest_step()
    if latest is not None and not checkpoints.has_data_iterator(model_dir, latest):  # from pretrain.import_hf
      state = _state_from_weights(setup, _imported_params(setup, model_dir, latest), seed)
      origin = f"starting from the weights in {checkpoints.checkpoint_dir(model_dir)}: fresh optimizer, step 0"
    elif latest is not None:
      _check_same_layout(setup, model_dir, latest)
      state = checkpoints.restore(manager, latest, setup.sharded_abstract_state(), train_iterator)
      origin = f"resumed from step {latest} in {checkpoints.checkpoint_dir(model_dir)}"
    else:
      state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(jax.random.PRNGKey(seed))
      origin = None
    writer = MetricsWriter(model_dir, train_steps, start_step=int(state.step))
    if origin:
      writer.message(origin)
    step_fn = jit_train_step(setup)
    eval_fn = jax.jit(lambda params, batch: eval_step(setup, params, batch))
    config = run_config(family, mixture_or_task_name, task_feature_lengths)
    tokens_per_step = tokens_per_batch(batch_size, task_feature_lengths)
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    writer.message(f"{family.name}: {num_params / 1e6:.2f}M parameters, mesh {dict(mesh.shape)}, "
                   f"global batch {batch_size}, {jax.process_count()} process(es)")

    losses, step, window_start = [], int(state.step), time.time()
    window_first_step = step
    while step < train_steps:
      state, metrics = step_fn(state, partitioning.global_batch(next(train_iterator), mesh))
      step += 1
      if step % log_every_steps == 0 or step == train_steps:
        metrics = jax.device_get(metrics)
        elapsed = time.time() - window_start
        metrics["tokens_per_second"] = tokens_per_step * (step - window_first_step) / max(elapsed, 1e-9)
        writer.write(step, metrics)
        losses.append(float(metrics["loss"]))
        window_start, window_first_step = time.time(), step
      if eval_every_steps and step % eval_every_steps == 0 and data.has_split("validation"):
        rows = [jax.device_get(eval_fn(state.params, partitioning.global_batch(b, mesh)))
                for b in data.take("validation", eval_steps)]
        writer.write(step, _mean_metrics(rows), split="eval")
      if step % checkpoint_every_steps == 0 or step == train_steps:
        checkpoints.save(manager, step, state, train_iterator, config)
    manager.wait_until_finished()
  writer.close()
  return {"first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
          "steps": train_steps, "checkpoint_dir": str(checkpoints.checkpoint_dir(model_dir))}
