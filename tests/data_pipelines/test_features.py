"""Each objective's task emits exactly the features its schema states, with the schema's shapes and dtypes."""
import numpy as np
import pytest

from data_pipelines import features, input_pipeline, tasks


def test_every_objective_has_a_schema():
  assert set(features.SCHEMAS) == set(tasks.OBJECTIVES)


@pytest.mark.parametrize("objective", sorted(features.SCHEMAS))
def test_the_demo_task_emits_the_schemas_features(objective, demo_paths):
  schema = features.schema(objective)
  task = tasks.get_task_or_mixture(f"demo_{objective}")
  assert tasks.objective_of(task) == objective
  assert set(task.output_features) == set(schema.token_features(features.INPUT_TOKENS))
  dataset = input_pipeline.task_examples(task, dict(schema.default_lengths), "validation")
  example = next(dataset.as_numpy_iterator())
  expected = schema.shapes(schema.default_lengths)
  assert set(example) == set(expected) | set(schema.diagnostics)
  for name, (shape, dtype) in expected.items():
    value = np.asarray(example[name])
    assert value.shape == shape and value.dtype == dtype, (name, value.shape, value.dtype)


def test_lengths_must_be_the_schemas():
  schema = features.schema("xlnet_plm")
  with pytest.raises(ValueError, match=r"takes the lengths \['input_ids', 'target_ids', 'reuse_len'\]"):
    schema.check_lengths("xlnet_plm", {"input_ids": 64, "target_ids": 6})
