"""Joining a multi-process JAX job: the environment a launcher sets, and the call each process makes.

`launch.local` starts N processes on this machine with these variables; on a multi-host TPU slice
the TPU runtime tells JAX its peers and no variable is needed.
"""
import os

COORDINATOR_ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"
COORDINATOR_BIND_ADDRESS_ENV = "JAX_COORDINATOR_BIND_ADDRESS"  # read by jax.distributed.initialize itself
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


def initialize() -> None:
  """Joins the job this process was launched into, if any (launch.local, or a TPU pod slice)."""
  import jax

  if COORDINATOR_ADDRESS_ENV in os.environ:
    jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR_ADDRESS_ENV],
                               num_processes=int(os.environ[NUM_PROCESSES_ENV]),
                               process_id=int(os.environ[PROCESS_ID_ENV]))
  elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):  # a multi-host TPU VM slice
    jax.distributed.initialize()
