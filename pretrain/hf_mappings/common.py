"""Table-driven conversion between nested Flax params and flat HuggingFace state dicts.

A family lists `Rule`s: one Flax leaf path, one HF key, and how the array changes on the way.
`Linear` covers torch `nn.Linear` weights ([out, in], the transpose of a Flax kernel whose leading
`num_in_dims` axes are inputs); `Same` covers arrays stored with identical layout (embeddings,
biases, LayerNorm, einsum weights). The same table serves both directions.
"""
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from pretrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Same:
  flatten: bool = False  # e.g. a [heads, head_dim] bias that HF stores flat

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    return value.reshape(-1) if value.ndim > 1 and self.flatten else value

  def from_hf(self, value: np.ndarray, shape) -> np.ndarray:
    return value.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Linear:
  num_in_dims: int = 1

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    fan_in = int(np.prod(value.shape[: self.num_in_dims]))
    return value.reshape(fan_in, -1).T

  def from_hf(self, value: np.ndarray, shape) -> np.ndarray:
    return value.T.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Rule:
  flax_path: str  # "/"-joined path below the params root, e.g. "encoder/layer_0/ffn/output/kernel"
  hf_key: str
  transform: object = Same()


def flatten_params(params: Mapping) -> dict:
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      path = f"{prefix}/{key}" if prefix else key
      if isinstance(value, Mapping):
        walk(value, path)
      else:
        flat[path] = np.asarray(value)

  walk(params, "")
  return flat


def unflatten_params(flat: Mapping[str, np.ndarray]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  return tree


def to_hf(params: Mapping, rules: Sequence[Rule]) -> dict:
  """Flax params -> {hf_key: np.ndarray}. Every Flax leaf must be claimed by exactly one rule."""
  flat = flatten_params(params)
  claimed = {rule.flax_path for rule in rules}
  unmapped = sorted(set(flat) - claimed)
  missing = sorted(claimed - set(flat))
  if unmapped or missing:
    raise ValueError(
        f"weight mapping mismatch: unmapped Flax params {unmapped[:5]}, rules without params {missing[:5]}")
  return {rule.hf_key: np.ascontiguousarray(rule.transform.to_hf(flat[rule.flax_path])) for rule in rules}


def from_hf(state_dict: Mapping[str, np.ndarray], rules: Sequence[Rule], shapes: Mapping[str, tuple]) -> dict:
  """{hf_key: array} -> Flax params, given the Flax leaf shapes ({flax_path: shape})."""
  missing = sorted(rule.hf_key for rule in rules if rule.hf_key not in state_dict)
  if missing:
    raise ConfigError(f"HuggingFace checkpoint lacks weights {missing[:5]} ({len(missing)} in all)")
  flat = {}
  for rule in rules:
    value = np.asarray(state_dict[rule.hf_key], dtype=np.float32)
    shape = tuple(shapes[rule.flax_path])
    converted = rule.transform.from_hf(value, shape)
    if converted.shape != shape:
      raise ConfigError(f"{rule.hf_key}: shape {value.shape} does not fit {rule.flax_path} {shape}")
    flat[rule.flax_path] = converted
  return unflatten_params(flat)


def dense_rules(flax_prefix: str, hf_prefix: str, num_in_dims: int = 1) -> list:
  """A Flax Dense (kernel, bias) against a torch Linear (weight [out, in], bias)."""
  return [Rule(f"{flax_prefix}/kernel", f"{hf_prefix}.weight", Linear(num_in_dims)),
          Rule(f"{flax_prefix}/bias", f"{hf_prefix}.bias")]


def norm_rules(flax_prefix: str, hf_prefix: str) -> list:
  """A Flax LayerNorm (scale, bias) against a torch LayerNorm (weight, bias)."""
  return [Rule(f"{flax_prefix}/scale", f"{hf_prefix}.weight"), Rule(f"{flax_prefix}/bias", f"{hf_prefix}.bias")]
