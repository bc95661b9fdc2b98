"""The seqio feature converter: task examples -> model features with fixed shapes.

Objectives already emit model-ready features (their names are the model's inputs and targets), so
conversion is validation: every feature the model expects is present, with its dtype and shape,
and nothing else passes. seqio's stock converters assume 1-D token features; XLNet's perm_mask
and target_mapping are 2-D, so this one checks full shapes instead.
"""
from typing import Mapping, Tuple

import seqio
import tensorflow as tf

FeatureShapes = Mapping[str, Tuple[Tuple[int, ...], object]]  # name -> (shape without batch, dtype)


class FixedShapeFeatureConverter(seqio.FeatureConverter):
  """`model_features`: name -> (per-example shape, dtype), e.g. {'input_ids': ((128,), tf.int32)}."""

  TASK_FEATURES = {}
  MODEL_FEATURES = {}
  PACKING_FEATURE_DTYPES = {}

  def __init__(self, model_features: FeatureShapes):
    super().__init__(pack=False)
    self.model_features = {name: (tuple(shape), tf.as_dtype(dtype)) for name, (shape, dtype) in model_features.items()}

  def __call__(self, ds: tf.data.Dataset, task_feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    return self._convert_features(ds, task_feature_lengths)

  def _convert_features(self, ds, task_feature_lengths):
    del task_feature_lengths  # shapes come from the model features
    spec = ds.element_spec
    missing = sorted(set(self.model_features) - set(spec))
    if missing:
      raise ValueError(f"the task's examples lack model features {missing} (have {sorted(spec)})")
    for name, (shape, _) in self.model_features.items():
      if not tf.TensorShape(spec[name].shape).is_compatible_with(shape):
        raise ValueError(f"feature {name!r} has shape {spec[name].shape}, the model expects {shape}: "
                         "check TASK_FEATURE_LENGTHS")

    def convert(example):
      return {name: tf.ensure_shape(tf.cast(example[name], dtype), shape)
              for name, (shape, dtype) in self.model_features.items()}

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> Mapping[str, int]:
    return {name: shape[0] for name, (shape, _) in self.model_features.items() if shape}

