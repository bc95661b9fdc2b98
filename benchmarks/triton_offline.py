"""The GPU kernels of models/flash_dropout.py compiled for an NVIDIA GPU without one: registers, spills, shared memory.

  python benchmarks/triton_offline.py --triton_python=PYTHON [--arch=90] [--batch=32] [--length=512] [--heads=16]
      [--head_dim=64] [--rate=0.1] [--causal | --bias] [--tilings=64x64/4/2,128x64/8/2]

JAX lowers the kernels' forward and backward (BERT-Large's attention by default: bf16, head_dim 64, the recipe's
dropout 0.1) to Triton's IR on this machine, as it does for a GPU; then PYTHON, an interpreter with the `triton`
package (`python -m venv /tmp/triton && /tmp/triton/bin/pip install triton`: about 1 GB, so not one of the
project's dependencies), compiles each kernel to PTX for compute capability --arch (90: H100 and H200) with the
warps and stages JAX would ask for, and Triton's ptxas assembles it. A kernel that fails here would fail on the
GPU; one that spills registers would be slow there. `--tilings` (flash_dropout.Tiling: queries x keys per tile /
warps / stages; default the kernels' own) compiles each; `--bias` the kernels with an additive bias and its
gradient (XLNet's relative attention); which is fastest needs the GPU (benchmarks/attention.py
--tilings).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_OF_ARCH = {80: "NVIDIA A100", 86: "NVIDIA A10", 89: "NVIDIA L4", 90: "NVIDIA H100", 100: "NVIDIA B200"}

# Run by --triton_python: compile each IR file, assemble its PTX with ptxas -v, print one line per kernel.
COMPILE = r"""
import glob, json, os, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
arch, directory = int(sys.argv[1]), sys.argv[2]
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = sorted(glob.glob(os.path.join(bin_dir, "ptxas*")))[-1]  # ptxas-blackwell reads the newest PTX
for path in sorted(glob.glob(os.path.join(directory, "*", "*.ttir"))):
  options = json.load(open(path[:-5] + ".json"))
  kernel = triton.compile(path, target=GPUTarget("cuda", arch, 32), options=options)
  ptx = path[:-5] + ".ptx"
  open(ptx, "w").write(kernel.asm["ptx"])
  report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx, "-o", ptx + ".cubin"], capture_output=True,
                          text=True, check=True).stderr
  print(json.dumps({"kernel": os.path.basename(path)[:-5], "tiling": os.path.basename(os.path.dirname(path)),
                    "shared_bytes": kernel.metadata.shared,
                    "ptxas": report, **options}))
"""


def lower(directory: str, batch: int, length: int, heads: int, head_dim: int, rate: float, causal: bool = False,
          tiling=None, bias: bool = False, arch: int = 90) -> None:
  """Writes each Triton kernel of the attention's forward and backward as IR text (<name>.ttir) and the warps and
  stages it asks for (<name>.json) into `directory`, tiled as `tiling` says (None: the kernels' own), for a GPU of
  compute capability `arch` (a key of GPU_OF_ARCH)."""
  import json

  import jax
  import jax.numpy as jnp
  from jax._src.lib import triton as jaxlib_triton  # the Triton dialect jaxlib bundles, to print the IR
  from jax._src.lib.mlir import ir

  from models import flash_dropout

  rows = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16)

  def gradients(q, k, v, key_valid, seed, scores_bias):
    attend = lambda q, k, v, scores_bias: flash_dropout.attention(
        q, k, v, key_valid=key_valid, causal=causal, rate=rate, seed=seed, bias=scores_bias,
        tiling=tiling or flash_dropout.TILING, interpret=False).astype(jnp.float32).sum()
    return jax.grad(attend, argnums=(0, 1, 2, 3))(q, k, v, scores_bias)

  scores = jax.ShapeDtypeStruct((batch, heads, length, length), jnp.bfloat16) if bias else None
  # With no GPU here, JAX 0.11 lowers a Triton kernel for the GPU that the abstract mesh names (JAX 0.10 ignores
  # it and lowers for compute capability 9.0).
  gpu = jax.sharding.AbstractDevice(device_kind=GPU_OF_ARCH[arch], num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=gpu)):
    lowered = jax.jit(gradients).trace(rows, rows, rows, jax.ShapeDtypeStruct((batch, length), jnp.int32),
                                       jax.ShapeDtypeStruct((2,), jnp.uint32), scores
                                       ).lower(lowering_platforms=("cuda",))
  configs = []

  def collect(operation):
    for region in operation.regions:
      for block in region.blocks:
        for inner in block.operations:
          if "mhlo.backend_config" in inner.attributes and "ir" in inner.attributes["mhlo.backend_config"]:
            configs.append(inner.attributes["mhlo.backend_config"])
          collect(inner)

  collect(lowered.compiler_ir().operation)
  for config in configs:
    name = ir.StringAttr(config["name"]).value
    with ir.Context() as context:
      jaxlib_triton.dialect.register_dialect(context)
      module = ir.Module.parse(bytes(ir.StringAttr(config["ir"]).value_bytes))
      with open(os.path.join(directory, name + ".ttir"), "w") as f:
        f.write(module.operation.get_asm(enable_debug_info=False))
    with open(os.path.join(directory, name + ".json"), "w") as f:
      json.dump({key: ir.IntegerAttr(config[key]).value for key in ("num_warps", "num_stages")}, f)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--triton_python", required=True, help="a Python interpreter that can import triton")
  parser.add_argument("--arch", type=int, default=90, choices=sorted(GPU_OF_ARCH),
                      help="compute capability x 10 (90: H100, H200)")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--rate", type=float, default=0.1, help="attention dropout")
  parser.add_argument("--causal", action="store_true", help="a causal mask (a decoder's self-attention)")
  parser.add_argument("--bias", action="store_true", help="an additive [batch, heads, q, k] bias, differentiated "
                                                          "(XLNet's relative attention)")
  parser.add_argument("--tilings", default="", help="comma-separated QUERIESxKEYS/WARPS/STAGES (default: the "
                                                     "kernels' own, flash_dropout.TILING)")
  args = parser.parse_args(argv)
  import json

  from models import flash_dropout
  try:
    tilings = [flash_dropout.Tiling.parse(text) for text in args.tilings.split(",") if text.strip()]
  except ValueError as e:
    parser.error(f"--tilings: {e}")
  with tempfile.TemporaryDirectory() as directory:
    for tiling in tilings or [flash_dropout.TILING]:
      tiled = os.path.join(directory, str(tiling).replace("/", "-"))
      os.mkdir(tiled)
      lower(tiled, args.batch, args.length, args.heads, args.head_dim, args.rate, args.causal, tiling, args.bias,
            args.arch)
    done = subprocess.run([args.triton_python, "-c", COMPILE, str(args.arch), directory], capture_output=True,
                          text=True)
    if done.returncode:
      print(f"triton_offline: compiling with {args.triton_python} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
      return 1
  print(f"flash_dropout at batch {args.batch}, length {args.length}, {args.heads} heads of {args.head_dim}, bf16, "
        f"dropout {args.rate}{', causal' if args.causal else ''}{', bias' if args.bias else ''}; Triton -> "
        f"sm_{args.arch}a")
  print(f"{'tiles':<10}{'kernel':<18}{'warps':>6}{'stages':>7}{'registers':>10}{'spilled bytes':>14}"
        f"{'shared KiB':>11}")
  for line in done.stdout.splitlines():
    kernel = json.loads(line)
    registers = re.search(r"Used (\d+) registers", kernel["ptxas"]).group(1)
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", kernel["ptxas"]))
    tiles = kernel["tiling"].split("-")[0]
    print(f"{tiles:<10}{kernel['kernel']:<18}{kernel['num_warps']:>6}{kernel['num_stages']:>7}{registers:>10}"
          f"{spilled:>14}{kernel['shared_bytes'] / 1024:>11.1f}")
  return 0


if __name__ == "__main__":
  sys.path.insert(0, REPO)
  sys.exit(main())
