"""pod-pretrain's input: from text to each host's batches, in TensorFlow (tf.data, seqio), for any model.

Importing the package loads Triton, where it is installed, before TensorFlow can load: TensorFlow 2.20 and later
load their library with RTLD_GLOBAL, and a Triton (3.7 and later) loaded after it binds its LLVM to
TensorFlow's and crashes the interpreter as it loads (tensorflow/tensorflow#124205). transformers loads it
through PyTorch (Linux wheels from PyPI), so export, import and the parity tests would crash where both are
installed, as on a GPU machine. Loaded first, Triton keeps its own; TensorFlow stays as it was (its custom ops
need RTLD_GLOBAL: with RTLD_LOCAL, seqio's tf.data iterators could no longer be saved).
"""
import importlib.util
import sys

if "tensorflow" not in sys.modules and importlib.util.find_spec("triton") is not None:
  import triton  # noqa: F401
