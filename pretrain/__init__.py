"""pod-pretrain."""
import data_pipelines  # noqa: F401  (first: what must load before TensorFlow, data_pipelines/__init__.py)
