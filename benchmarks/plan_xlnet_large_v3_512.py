"""XLNet-Large on a v3-512 slice, planned on this machine: per-core HBM, FLOPs per step, estimated MFU.

  python benchmarks/plan_xlnet_large_v3_512.py [--gin.KEY=VALUE ...]
  python benchmarks/plan_xlnet_large_v3_512.py --gin.MICROBATCHES=8

Compiles gin_configs/runs/xlnet_large_v3_512.gin's training step for libtpu's `v3:16x16` topology
(512 TensorCores) with pretrain.plan; extra --gin.KEY=VALUE flags try other settings, e.g.
--gin.MICROBATCHES=8 or "--gin.MESH_SHAPE={'data': 512}". The compile takes 3-5 minutes and 8-13 GB
of host RAM: run one at a time. Exit code 2 when the step does not fit.
"""
import sys

from pretrain import cli, plan

RUN = "gin_configs/runs/xlnet_large_v3_512.gin"
TOPOLOGY = "v3:16x16"

if __name__ == "__main__":
  cli.start(sys.argv, cli.gin_help(__doc__))
  cli.run("plan_xlnet_large_v3_512", lambda: plan.main([sys.argv[0], f"--gin_file={RUN}", f"--topology={TOPOLOGY}",
                                                         *sys.argv[1:]]))
