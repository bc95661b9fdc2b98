"""Which TPU software version (runtime) `launch.tpu create` asks for, chosen by the accelerator type's chip.

Google's table of TPU software versions for JAX and PyTorch (https://cloud.google.com/tpu/docs/runtimes): v4 and
older run tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, Trillium (v6e) v2-alpha-tpuv6e.
"""

# Keyed by the accelerator type's chip, the part before its size: v3-512 -> v3. The TPU API calls v5e v5litepod.
RUNTIME_BY_CHIP = {
    "v2": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


def chip(accelerator_type: str) -> str:
  return accelerator_type.rsplit("-", 1)[0]


def runtime_for(accelerator_type: str) -> str | None:
  """The runtime Google lists for this accelerator type's chip; None for a chip not in the table."""
  return RUNTIME_BY_CHIP.get(chip(accelerator_type))
