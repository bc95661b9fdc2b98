import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("POD_PRETRAIN_CACHE", os.path.join(tempfile.gettempdir(), "pod_pretrain_test_cache"))
