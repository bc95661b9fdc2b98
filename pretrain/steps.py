"""The train state, its shardings and the jitted steps (gradient accumulation included).

`make_setup` derives everything about a run that does not change from step to step from a family
fitted to its data, the batch, the mesh and the optimizer. `pretrain.trainer` runs its steps and
`pretrain.plan` compiles the same ones for a TPU topology, so the plan's figures are the training
step's.
"""
import dataclasses
import functools
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.core import meta
from jax.sharding import PartitionSpec

from models import layers
from pretrain import optimizers, partitioning
from pretrain.errors import ConfigError
from pretrain.families.base import Family, weight_totals

# flax.linen makes module classes as it traces a model (its lifted scan and remat), and making one edits its base
# classes' dataclass fields for a moment: two threads must not trace a model at once. A start traces the init
# while the train step is traced in a thread beside it, and a layout search sets up and traces layouts in
# several; the compiles, which take the time, still overlap. Held where a model is traced: initial_params,
# lower_train_step, roofline.model_flops_per_step.
MODEL_TRACING = threading.RLock()


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
  _abstract_state: Optional[TrainState] = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def abstract_state(self) -> TrainState:
    # make_setup fills it in; a Setup changed by dataclasses.replace traces it once. The lock only while tracing:
    # a restore must not wait for the train step's trace in the thread beside it.
    if self._abstract_state is None:
      with MODEL_TRACING:
        if self._abstract_state is None:
          self._abstract_state = jax.eval_shape(lambda: self.init_state(jax.random.PRNGKey(0)))
    return self._abstract_state

  def sharded_abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of the state: what restore and ahead-of-time compilation need."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_state(),
                        self.state_shardings)

  def sharded_batch_shapes(self) -> Dict[str, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and sharding of a global batch as partitioning.global_batch makes it: for compiling
    ahead of the first batch."""
    sharding = partitioning.batch_sharding(self.mesh)
    return {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for k, s in self.batch_shapes.items()}

  def init_state(self, rng) -> TrainState:
    params_rng, dropout_rng, state_rng = jax.random.split(rng, 3)
    params = initial_params(self.family, self.batch_shapes, {"params": params_rng, "dropout": dropout_rng})
    return self.state_around(nn.unbox(params), state_rng)

  def state_around(self, params, rng) -> TrainState:
    """Step 0 with these params: a fresh optimizer state and carry."""
    batch_size = next(iter(self.batch_shapes.values())).shape[0]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params), rng=rng,
                      carry=self.family.initial_carry(batch_size))


def example_batch(family: Family, batch_shapes: Mapping[str, jax.ShapeDtypeStruct]) -> Dict[str, jax.Array]:
  """A batch of zeros with the family's example_rows: what initialises the params."""
  return {k: jnp.zeros((family.example_rows(),) + s.shape[1:], s.dtype) for k, s in batch_shapes.items()}


def initial_params(family: Family, batch_shapes: Mapping[str, jax.ShapeDtypeStruct], rngs: Mapping[str, jax.Array]):
  """The model's params, boxed with their logical axes, drawn from `rngs` ({"params", "dropout"}).

  Layer stacks are always initialised scanned, then sliced into `layer_<i>` modules for a model with
  unrolled layers: one layer's initializers are traced and compiled instead of every layer's (XLA
  compiles each random draw on its own), so the state of a deep model compiles several times faster.
  nn.scan gives every layer its own key, and a seed gives the same weights in either layout. A config
  that cannot scan (ALBERT sharing single sublayers) initialises as it runs.
  """
  config = family.config
  try:
    scanned = dataclasses.replace(family, config=dataclasses.replace(config, scan_layers=True))
  except ValueError:
    scanned = family
  example = example_batch(family, batch_shapes)
  with MODEL_TRACING:
    params = scanned.make_model().init(rngs, example)["params"]
  return params if scanned.config.scan_layers == config.scan_layers else _unrolled(params)


def _unrolled(params):
  """Scanned stacks' params (boxed or not, traced or not) laid out as unrolled `layer_<i>` modules, as
  `layers.unstack_layer_params` lays out host arrays."""
  if not isinstance(params, Mapping):
    return params
  out = {}
  for key, value in params.items():
    if key != layers.SCANNED_STACK:
      out[key] = _unrolled(value)
      continue
    for index in range(jax.tree.leaves(value)[0].shape[0]):
      layer = jax.tree.map(lambda leaf: leaf[index], value)
      out[layers.unrolled_layer_name(index)] = meta.remove_axis(layer, 0, {nn.PARTITION_NAME: "layers"})
  return out


def resolve_microbatches(batch_size: int, groups: int, microbatches: int,
                         microbatch_rows_per_group: Optional[int]) -> int:
  """MICROBATCHES, or the number that gives each data-parallel group MICROBATCH_ROWS_PER_GROUP rows at a time."""
  if microbatch_rows_per_group is None:
    return microbatches
  if microbatches != 1:
    raise ConfigError(f"MICROBATCHES={microbatches} and MICROBATCH_ROWS_PER_GROUP={microbatch_rows_per_group}: "
                      "set one of them")
  if microbatch_rows_per_group < 1 or batch_size % (groups * microbatch_rows_per_group):
    raise ConfigError(f"MICROBATCH_ROWS_PER_GROUP={microbatch_rows_per_group} does not divide the "
                      f"{batch_size / groups:g} rows that each of the mesh's {groups} data-parallel groups gets from "
                      f"BATCH_SIZE={batch_size}")
  return batch_size // (groups * microbatch_rows_per_group)


def make_setup(family: Family, feature_lengths: Mapping[str, int], batch_size: int, mesh,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int = 1,
               microbatch_rows_per_group: Optional[int] = None) -> Setup:
  """The Setup of a run whose family is fitted to its data (`Family.fit_to_data`); reads no data.

  Every sharding follows from the model's logical axis names and `partitioning.AXIS_RULES`.
  """
  groups = partitioning.data_parallel_groups(mesh)
  microbatches = resolve_microbatches(batch_size, groups, microbatches, microbatch_rows_per_group)
  if batch_size % (microbatches * groups):
    raise ConfigError(f"BATCH_SIZE={batch_size} is not divisible by MICROBATCHES={microbatches} × the mesh's "
                      f"{groups} data-parallel groups")
  family.check_microbatch_rows(batch_size // (microbatches * groups))
  family = family.for_device(mesh.devices.flat[0])
  rules = partitioning.AXIS_RULES
  model = family.make_model()
  batch_shapes = family.feature_shapes(batch_size, feature_lengths)
  key = jax.random.PRNGKey(0)
  boxed = jax.eval_shape(lambda: initial_params(family, batch_shapes, {"params": key, "dropout": key}))
  param_shardings = partitioning.logical_shardings(nn.get_partition_spec(boxed), mesh, rules)
  replicated = partitioning.replicated(mesh)
  abstract_opt = jax.eval_shape(optimizer.init, nn.unbox(boxed))
  opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_opt, param_shardings,
                                        transform_non_params=lambda _: replicated)
  carry_shardings = partitioning.logical_shardings(
      {k: PartitionSpec(*axes) for k, axes in family.carry_axes().items()}, mesh, rules)
  state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, rng=replicated,
                               carry=carry_shardings)
  setup = Setup(family, model, optimizer, schedule, mesh, rules, state_shardings, batch_shapes, microbatches)
  setup._abstract_state = jax.eval_shape(setup.state_around, nn.unbox(boxed), key)  # the model traced once, above
  return setup


def tokens_per_batch(batch_size: int, feature_lengths: Mapping[str, int]) -> int:
  """Input tokens of a global batch (encoder and decoder inputs for encoder-decoder families)."""
  return batch_size * sum(v for k, v in feature_lengths.items() if k.endswith("input_ids"))


def _loss_and_grads(setup: Setup, params, batch, carry, rng, totals=None):
  def loss_fn(p):
    outputs, new_carry = setup.family.forward(setup.model, p, batch, carry, rngs={"dropout": rng}, deterministic=False)
    loss, metrics = setup.family.loss_and_metrics(outputs, batch, totals)
    return loss, (metrics, new_carry)

  (loss, (metrics, new_carry)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, metrics, new_carry, grads


def _split_microbatches(x, n: int, groups: int):
  """[B, ...] -> [n, B / n, ...]: microbatch k is the k-th of n equal runs of rows of every data-parallel group.

  Every device keeps its own rows, so the scan runs over an unsharded axis and nothing moves. (Cutting
  the batch into n contiguous blocks puts each microbatch on a few devices; the SPMD partitioner then
  computes each device's whole local batch in every iteration, n times the work and more memory.)
  """
  return x.reshape((groups, n, -1) + x.shape[1:]).swapaxes(0, 1).reshape((n, -1) + x.shape[1:])


def _merge_microbatches(x, groups: int):
  """The inverse of _split_microbatches."""
  return x.reshape((x.shape[0], groups, -1) + x.shape[2:]).swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def _accumulated_loss_and_grads(setup: Setup, params, batch, carry, rng):
  """Gradient accumulation: the batch is split into `microbatches` slices scanned in sequence.

  Each slice keeps its own rows' carry, so memory-carrying families see the same rows every step.
  Weighted losses divide by the whole batch's weights (over n), so the mean over slices is exactly
  the plain step's loss even when slices hold different numbers of predicted positions.
  """
  n, groups = setup.microbatches, partitioning.data_parallel_groups(setup.mesh)
  totals = {k: v / n for k, v in weight_totals(batch).items()}
  split = lambda x: _split_microbatches(x, n, groups)
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
          jax.tree.map(lambda x: _merge_microbatches(x, groups), new_carry),
          jax.tree.map(lambda g: g / n, grad_sum))


def train_step(setup: Setup, state: TrainState, batch) -> tuple:
  rng = jax.random.fold_in(state.rng, state.step)
  compute = _accumulated_loss_and_grads if setup.microbatches > 1 else _loss_and_grads
  loss, metrics, carry, grads = compute(setup, state.params, batch, state.carry, rng)
  # Skips the update if the gradients are not finite (and, if so configured, if the loss spikes).
  updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params, loss=loss)
  params = optax.apply_updates(state.params, updates)
  grad_norm = optax.global_norm(grads)
  # A skipped step also keeps the carry: XLNet's memory of a non-finite forward pass would poison the next.
  carry = jax.tree.map(lambda new, old: jnp.where(jnp.isfinite(grad_norm), new, old), carry, state.carry)
  metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "learning_rate": setup.schedule(state.step),
             **optimizers.skipped_updates(opt_state)}
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, carry=carry), metrics


def eval_step(setup: Setup, params, batch, carry) -> Tuple[Dict[str, jax.Array], Any]:
  """Metrics of a held-out batch, and the carry for the next one: XLNet's held-out rows read on with memory."""
  outputs, carry = setup.family.forward(setup.model, params, batch, carry, rngs={}, deterministic=True)
  loss, metrics = setup.family.loss_and_metrics(outputs, batch)
  return {**metrics, "loss": loss}, carry


def jit_train_step(setup: Setup):
  batch_shardings = {k: partitioning.batch_sharding(setup.mesh) for k in setup.batch_shapes}
  replicated = partitioning.replicated(setup.mesh)
  # A partial keeps the function's name, which names the program in profiles (jit_train_step).
  return jax.jit(functools.partial(train_step, setup),
                 in_shardings=(setup.state_shardings, batch_shardings),
                 out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))


def lower_train_step(setup: Setup):
  """The train step lowered ahead of time for the state's and a batch's shapes and shardings, traced under the
  run's mesh and axis rules (thread-local: a thread that lowers it enters them itself)."""
  with MODEL_TRACING, partitioning.tracing_context(setup.mesh, setup.rules):
    return jit_train_step(setup).lower(setup.sharded_abstract_state(), setup.sharded_batch_shapes())


def jit_eval_step(setup: Setup):
  """(params, batch, carry) -> (metrics, carry); the first batch takes `initial_eval_carry(setup)`."""
  return jax.jit(functools.partial(eval_step, setup),
                 out_shardings=(partitioning.replicated(setup.mesh), setup.state_shardings.carry))


def initial_eval_carry(setup: Setup):
  batch_size = next(iter(setup.batch_shapes.values())).shape[0]
  return jax.jit(lambda: setup.family.initial_carry(batch_size), out_shardings=setup.state_shardings.carry)()
