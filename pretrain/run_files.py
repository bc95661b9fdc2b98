"""What a MODEL_DIR holds besides the train state: the run config, the kept vocabulary, the layer layout.

  MODEL_DIR/vocab.model                        the sentencepiece model every checkpoint was trained with
  MODEL_DIR/checkpoints/<step>/run_config      family, model config, task and lengths (`RunConfig`)

The run config is what export and import need to rebuild the model without gin. `RunConfig.to_json`
is its one writer and `read_run_config` its one reader. Params are stored as the model had them:
scanned layer stacks (`scan_layers`) or unrolled ones; `in_layout` converts between the two.
"""
import dataclasses
import uuid
from typing import List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from models import layers
from pretrain import checkpoints, registry
from pretrain.errors import ConfigError
from pretrain.families.base import Family

VOCAB_FILE = "vocab.model"
# Model settings a run may change when it resumes: how it computes, not what it computes.
RESUMABLE_MODEL_CHANGES = ("dtype", "remat_policy", "dropout_rate", "attention_dropout", "activation_dropout",
                           "attention_implementation", "dropout_masks", "gelu_gradient")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  family: Family  # with its model config
  task: Optional[str] = None
  feature_lengths: Mapping[str, int] = dataclasses.field(default_factory=dict)
  batch_size: Optional[int] = None
  imported_from: Optional[str] = None  # the HuggingFace directory of a `pretrain.import_hf` checkpoint

  def to_json(self) -> dict:
    data = {"family": self.family.name, "model_config": _as_json(self.family.config), "task": self.task,
            "feature_lengths": dict(self.feature_lengths), "batch_size": self.batch_size, "vocab_model": VOCAB_FILE}
    return {**data, "imported_from": self.imported_from} if self.imported_from else data

  @classmethod
  def from_json(cls, data: Mapping) -> "RunConfig":
    spec = registry.get(data.get("family"))
    fields = dict(data["model_config"])
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(spec.config_cls)})
    if unknown:
      raise ConfigError(f"run_config model_config has fields {unknown} that {spec.config_cls.__name__} lacks")
    if "dtype" in fields:
      fields["dtype"] = jnp.dtype(fields["dtype"])
    return cls(spec.family_cls(config=spec.config_cls(**fields)), data.get("task"), data.get("feature_lengths") or {},
               data.get("batch_size"), data.get("imported_from"))

  def differences(self, now: "RunConfig") -> List[str]:
    """The settings of `now` that a run resuming from this config may not change, as 'NAME: saved -> now'."""
    saved_model, now_model = self.to_json()["model_config"], now.to_json()["model_config"]
    pairs = [("family", self.family.name, now.family.name), ("MIXTURE_OR_TASK_NAME", self.task, now.task),
             ("TASK_FEATURE_LENGTHS", dict(self.feature_lengths), dict(now.feature_lengths)),
             ("BATCH_SIZE", self.batch_size, now.batch_size)]
    if self.family.name == now.family.name:
      prefix = f"{type(self.family.config).__name__}."
      pairs += [(prefix + name, saved_model.get(name), now_model.get(name)) for name in now_model
                if name not in RESUMABLE_MODEL_CHANGES]
    return [f"{name}: {saved!r} -> {current!r}" for name, saved, current in pairs
            if saved is not None and saved != current]


def _as_json(value):
  if dataclasses.is_dataclass(value):
    return {f.name: _as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (list, tuple)):
    return [_as_json(v) for v in value]
  return str(jnp.dtype(value)) if isinstance(value, (type, np.dtype)) else str(value)


def read_run_config(model_dir: str, step: Optional[int] = None) -> Tuple[int, RunConfig]:
  """(step, RunConfig) of a checkpoint in model_dir; the latest when step is None."""
  directory = checkpoints.checkpoint_dir(model_dir)
  if not directory.exists():  # a CheckpointManager would create it
    raise FileNotFoundError(f"no checkpoint in {directory}")
  manager = ocp.CheckpointManager(directory)
  steps = manager.all_steps()
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise ConfigError(f"step {step} not in {directory} (available: {sorted(steps)})")
  data = manager.restore(step, args=ocp.args.Composite(run_config=ocp.args.JsonRestore())).run_config
  return step, RunConfig.from_json(data)


def vocab_path(model_dir: str) -> epath.Path:
  return epath.Path(model_dir) / VOCAB_FILE


def keep_vocabulary(model_dir: str, run_vocab: str, write: bool) -> None:
  """MODEL_DIR keeps the vocabulary its checkpoints were trained with; a run must not switch it.
  `write`: this process writes it if it is not there yet (one process of a job)."""
  kept, model = vocab_path(model_dir), epath.Path(run_vocab).read_bytes()
  if kept.exists():
    if kept.read_bytes() != model:
      raise ConfigError(f"VOCAB_MODEL={run_vocab!r} differs from {kept}, the vocabulary this MODEL_DIR was "
                        "trained with; use that one or a new MODEL_DIR")
  elif write:  # whole or not at all: the other processes compare it as soon as it is there
    partial = kept.with_name(f"{kept.name}.tmp-{uuid.uuid4().hex[:8]}")
    partial.write_bytes(model)
    partial.rename(kept)


def in_layout(params, scan_layers: bool):
  """Params laid out for a model with scanned layer stacks, or unrolled ones: the same weights."""
  return layers.stack_layer_params(params) if scan_layers else layers.unstack_layer_params(params)
