"""Joining a multi-process JAX job: the environment a launcher sets, and the call each process makes.

`launch.local` starts N processes on this machine with these variables; on a multi-host TPU slice
the TPU runtime tells JAX its peers, and on GPU machines SLURM's or Open MPI's environment does. A
single process joins a job of its own on loopback: JAX's preemption service, which turns a SIGTERM
into an agreed step to checkpoint (`multihost_utils.reached_preemption_sync_point`), runs only inside
a job; until training begins, pretrain.signals holds SIGTERM and Ctrl-C.
"""
import os
import socket

from pretrain import signals

COORDINATOR_ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"
COORDINATOR_BIND_ADDRESS_ENV = "JAX_COORDINATOR_BIND_ADDRESS"  # read by jax.distributed.initialize itself
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
LOOPBACK = "127.0.0.1"
CLUSTER_TASK_COUNT_ENVS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")  # set by srun and mpirun


def free_port() -> int:
  with socket.socket() as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


def launched_as_cluster_tasks() -> bool:
  """Whether SLURM (`srun`) or Open MPI (`mpirun`) started this process as one of several tasks: then
  jax.distributed.initialize() reads the coordinator, process count and id from their environment."""
  return any(int(os.environ.get(name, "1")) > 1 for name in CLUSTER_TASK_COUNT_ENVS)


def initialize() -> None:
  """Joins the job this process was launched into (launch.local, a TPU pod slice), or a job of its own.

  Call it first thing in a program, before anything uses JAX.
  """
  import jax

  if COORDINATOR_ADDRESS_ENV in os.environ:
    jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR_ADDRESS_ENV],
                               num_processes=int(os.environ[NUM_PROCESSES_ENV]),
                               process_id=int(os.environ[PROCESS_ID_ENV]))
  elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or launched_as_cluster_tasks():
    jax.distributed.initialize()  # peers from the TPU runtime, or from SLURM's or Open MPI's environment
  else:
    address = f"{LOOPBACK}:{free_port()}"
    jax.distributed.initialize(coordinator_address=address, coordinator_bind_address=address, num_processes=1,
                               process_id=0)
  signals.hold_until_training()  # JAX's preemption service acts only at a step: until then, a signal stops the run


def any_process(flag: bool) -> bool:
  """True on every process of the job if `flag` is true on any: they all take the same branch."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))
