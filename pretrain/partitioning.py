"""Sharding as data: logical axis names -> mesh axes, a mesh from MESH_SHAPE, global batches.

Models name their axes logically (models/layers.py); these rules say where each name lives on the
mesh `replica × data × fsdp × model`. Data parallelism splits the batch over replica, data and
fsdp; FSDP (ZeRO-3) additionally splits parameters and optimizer state along `embed`; tensor
parallelism splits heads, FFN and vocabulary over `model`.
"""
import contextlib
import math
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pretrain.errors import ConfigError

MESH_AXES = ("replica", "data", "fsdp", "model")
BATCH_AXES = ("replica", "data", "fsdp")

AXIS_RULES: Tuple[Tuple[str, object], ...] = (
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "model"),
    ("activation_kv", None),
    ("activation_mlp", "model"),
    ("activation_vocab", "model"),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("hidden", None),
    ("position", None),
    ("token_type", None),
    ("layers", None),
)


def resolve_mesh_shape(mesh_shape: Mapping[str, int], num_devices: int) -> Dict[str, int]:
  """Fills one -1 entry with the remaining devices; every mesh axis gets a size (default 1)."""
  unknown = set(mesh_shape) - set(MESH_AXES)
  if unknown:
    raise ConfigError(f"MESH_SHAPE has unknown axes {sorted(unknown)}; expected some of {MESH_AXES}")
  shape = {axis: int(mesh_shape.get(axis, 1)) for axis in MESH_AXES}
  if any(size < 1 and size != -1 for size in shape.values()):  # 0 would divide by zero, two negatives multiply
    raise ConfigError(f"MESH_SHAPE={dict(mesh_shape)}: each axis's size must be at least 1, or -1 for the devices left")
  free = [axis for axis, size in shape.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f"MESH_SHAPE={dict(mesh_shape)}: at most one axis may be -1")
  known = math.prod(size for size in shape.values() if size != -1)
  if free:
    if num_devices % known:
      raise ConfigError(f"MESH_SHAPE={dict(mesh_shape)} does not divide {num_devices} devices")
    shape[free[0]] = num_devices // known
  if math.prod(shape.values()) != num_devices:
    raise ConfigError(f"MESH_SHAPE={dict(mesh_shape)} needs {math.prod(shape.values())} devices, have {num_devices}")
  return shape


def make_mesh(mesh_shape: Mapping[str, int], devices: Optional[Sequence] = None, num_slices: int = 1) -> Mesh:
  """A mesh with Auto axes (jax.make_mesh defaults to Explicit, which breaks sharding constraints).

  With several slices the `replica` axis spans slices over DCN and the others stay within a slice.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_shape, len(devices))
  sizes = tuple(shape[axis] for axis in MESH_AXES)
  if num_slices > 1:
    if shape["replica"] % num_slices:
      raise ConfigError(f"replica={shape['replica']} must be a multiple of num_slices={num_slices}")
    per_slice = (shape["replica"] // num_slices,) + sizes[1:]
    dcn = (num_slices, 1, 1, 1)
    array = mesh_utils.create_hybrid_device_mesh(per_slice, dcn, devices)
  else:
    try:
      array = mesh_utils.create_device_mesh(sizes, devices)
    except (ValueError, NotImplementedError, AssertionError):  # host devices have no physical topology
      array = np.array(devices).reshape(sizes)
  return Mesh(array, MESH_AXES)


@contextlib.contextmanager
def tracing_context(mesh: Mesh, rules) -> Iterator[None]:
  """What a step is traced and compiled under: the mesh, set with jax.set_mesh, and the logical axis rules.
  Flax applies activations' sharding constraints only where an abstract mesh is set, which the legacy
  `with mesh:` does not set; a Pallas kernel needs it too, to run per device under shard_map."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def logical_shardings(logical_specs, mesh: Mesh, rules) -> object:
  """Tree of PartitionSpecs over logical names -> tree of NamedShardings on the mesh."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def data_parallel_groups(mesh: Mesh) -> int:
  """How many parts the batch is split into over the mesh, the product of the batch axes' sizes: each
  part goes to one data-parallel group of devices (one device, unless the mesh has a `model` axis)."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh) -> Dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
