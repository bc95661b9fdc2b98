"""NVIDIA GPUs described to XLA's GPU compiler, so that a step compiles for them on a machine without one.

`pretrain.plan --topology=h100:8` (one machine of 8 H100s) or `h200:4x8` (4 machines of 8) compiles the run's
step as XLA would on those GPUs: jax's CUDA plugin compiles for a device described by its properties (a
"target config"), with no GPU and no driver. It needs the plugin and cuDNN (`pip install -e ".[gpu-plan]"`, or
`.[gpu]` on a GPU machine); compiling without a device, nothing is autotuned, so XLA uses its default kernels.
"""
import dataclasses
import os
import re
import sys

from pretrain.errors import ConfigError

# jax preallocates this fraction of a GPU's memory for its programs unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (jax's GPU memory allocation docs).
DEFAULT_MEMORY_FRACTION = 0.75
_TOPOLOGY = re.compile(r"([a-z]\d+):(?:(\d+)x)?(\d+)(?:@(\d+(?:\.\d+)?))?")  # h100:4x8@200: 200 Gbit/s per GPU


@dataclasses.dataclass(frozen=True)
class Gpu:
  """What XLA's GPU compiler needs to know of a GPU, and its bandwidths (its peak FLOP/s: roofline.GPUS)."""
  device_kind: str  # as jax names the device
  compute_capability: tuple
  multiprocessors: int
  memory_bytes: int  # what the driver reports (nvidia-smi's MiB)
  memory_bandwidth: float  # bytes/s
  l2_cache_bytes: int
  clock_ghz: float
  shared_memory_per_multiprocessor: int  # bytes
  shared_memory_per_block_optin: int  # bytes
  nvlink_bandwidth: float  # bytes/s one GPU sends over NVLink, one direction
  network_bandwidth: float  # bytes/s one GPU sends to other machines, one direction: its own network adapter's

  def target_config(self) -> str:
    """The GPU as the text of XLA's GpuTargetConfig proto."""
    major, minor = self.compute_capability
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_multiprocessor} threads_per_core_limit: 2048
  core_count: {self.multiprocessors} fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {int(self.memory_bandwidth)} l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{self.device_kind}"
"""


# NVIDIA's datasheets and architecture whitepapers (A100: "NVIDIA A100 Tensor Core GPU Architecture"; H100:
# "NVIDIA H100 Tensor Core GPU Architecture"; H200: the H200 datasheet), SXM parts: boost clocks, L2, shared
# memory per SM, memory bandwidth; memory as the driver reports it (nvidia-smi's MiB); NVLink 600 GB/s (A100)
# and 900 GB/s (H100, H200) in both directions together. Between machines, a network adapter per GPU as NVIDIA's
# DGX systems have them (the DGX A100, H100 and H200 datasheets): 200 Gbit/s (ConnectX-6) for an A100, 400 Gbit/s
# (ConnectX-7) for an H100 or H200. Clouds' GPU machines may have fewer or slower adapters: a topology's @<Gbit/s>
# gives theirs.
GPUS = {
    "a100": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 81920 * 2**20, 2039e9, 40 * 2**20, 1.41, 167936, 166912,
                600e9 / 2, 200e9 / 8),
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 81559 * 2**20, 3.35e12, 50 * 2**20, 1.98, 233472, 232448,
                900e9 / 2, 400e9 / 8),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 143771 * 2**20, 4.8e12, 50 * 2**20, 1.98, 233472, 232448,
                900e9 / 2, 400e9 / 8),
}


def is_gpu_topology(name: str) -> bool:
  match = _TOPOLOGY.fullmatch(name)
  return bool(match) and match.group(1) in GPUS


def parse(name: str) -> tuple:
  """'h100:8' -> (Gpu, machines 1, GPUs per machine 8); 'h200:4x8' -> (Gpu, 4, 8); 'h100:4x8@200' -> (an H100 that
  sends 200 Gbit/s to other machines, 4, 8)."""
  match = _TOPOLOGY.fullmatch(name)
  if not match or match.group(1) not in GPUS:
    raise ConfigError(f"--topology={name!r}: expected <gpu>:<GPUs> or <gpu>:<machines>x<GPUs per machine>[@<Gbit/s "
                      f"per GPU between machines>], e.g. h100:8 or h100:4x8@200 (GPUs {', '.join(GPUS)})")
  machines, per_machine = int(match.group(2) or 1), int(match.group(3))
  if not 1 <= per_machine <= 8 or machines < 1:
    raise ConfigError(f"--topology={name!r}: 1 to 8 GPUs per machine, at least one machine")
  gpu = GPUS[match.group(1)]
  if match.group(4) is not None:
    if float(match.group(4)) <= 0:
      raise ConfigError(f"--topology={name!r}: a network of 0 Gbit/s joins no machines")
    gpu = dataclasses.replace(gpu, network_bandwidth=float(match.group(4)) * 1e9 / 8)
  return gpu, machines, per_machine


def usable_memory_fraction() -> float:
  """The fraction of a GPU's memory jax lets programs use: XLA_PYTHON_CLIENT_MEM_FRACTION where set."""
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  try:
    fraction = float(value) if value else DEFAULT_MEMORY_FRACTION
  except ValueError:
    fraction = -1.0
  if not 0 < fraction <= 1:
    raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: expected a number above 0, at most 1")
  return fraction


def environment() -> dict:
  """Where a step compiles for described GPUs: on the CPU, with the CUDA plugin's check of the installed CUDA
  libraries against a driver skipped (there may be no driver)."""
  return {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def devices(name: str) -> list:
  """The JAX devices of the GPUs `name` describes, described, not opened."""
  gpu, machines, per_machine = parse(name)
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=gpu.target_config(),
                                        topology=f"1x{machines}x{per_machine}").devices
  except (NotImplementedError, RuntimeError) as e:  # jax: no plugin registered for "cuda"
    if "cuda" not in str(e):
      raise
    raise ConfigError(f"--topology={name}: compiling for GPUs needs jax's CUDA plugin and cuDNN: "
                      "pip install -e \".[gpu-plan]\" (no GPU needed)") from None


def gpu_of(device_kind: str) -> Gpu:
  return next(gpu for gpu in GPUS.values() if gpu.device_kind == device_kind)


def compiled(lowered):
  """A lowered step compiled for described GPUs. Without autotuning XLA may find no Triton tiling for a product
  (seen in XLNet-Large's step); then every product goes to cuBLAS, and a line on stderr says so."""
  try:
    return lowered.compile()
  except Exception as e:  # XLA's compile errors are runtime errors of jaxlib's own type
    if "Couldn't find output tile sizes" not in str(e):
      raise
  print("pretrain.plan: XLA found no Triton tiling for a matrix product without autotuning on a GPU; compiled "
        "with every product in cuBLAS instead (its memory figures may differ from the GPU's by some 10%)",
        file=sys.stderr, flush=True)
  return lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})


def memory_note() -> str:
  """Where a plan's usable GPU memory comes from."""
  source = ("XLA_PYTHON_CLIENT_MEM_FRACTION" if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ
            else "jax default; XLA_PYTHON_CLIENT_MEM_FRACTION sets it")
  return f"{usable_memory_fraction():g} of its memory usable ({source})"
