"""Joining a multi-process JAX job: the environment a launcher sets, and the call each process makes.

`launch.local` starts N processes on this machine with these variables; on a multi-host TPU slice
the TPU runtime tells JAX its peers, and on GPU machines SLURM's or Open MPI's environment does. A
single process joins a job of its own on loopback: JAX's preemption service, which turns a SIGTERM
into an agreed step to checkpoint (`multihost_utils.reached_preemption_sync_point`), runs only inside
a job; until training begins, pretrain.signals holds SIGTERM and Ctrl-C, and the processes of a job stop
together (`StartUpStops`).
"""
import os
import socket
import threading
import time
from typing import Optional, Tuple

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


class StartUpStops:
  """How the processes of a job stop together before training begins, through the job's key-value store.

  The process a signal stops tells the others (`announce`), which stop too, as if they had the signal; a
  process that the launcher would only signal once this one has ended could not: process 0's end takes the
  job's coordination service with it, and JAX aborts every process still connected to it. For the same
  reason no process ends before all are ending (`end_together`), and then they leave the job cleanly.
  """
  _STOPPED = "pod_pretrain/stopped_in_start_up"  # "<signal> <process>", set once per job
  _ENDING = "pod_pretrain/ending/"  # + process index

  def __init__(self, client, process_index: int, process_count: int):
    self._client, self._index, self._count = client, process_index, process_count

  def announce(self, signum: int) -> None:
    try:
      self._client.key_value_set(self._STOPPED, f"{signum} {self._index}")
    except Exception:  # set already (another process was stopped first), or the job is gone: nothing to tell
      pass

  def stopped_process(self, seconds: float) -> Optional[Tuple[int, int]]:
    """(signal, process) of the stop announced in the job, waiting up to `seconds` for one; None if none came."""
    import jax

    try:
      value = self._client.blocking_key_value_get(self._STOPPED, int(seconds * 1000))
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" in str(e):
        return None
      raise
    signum, process = value.split()
    return int(signum), int(process)

  def end_together(self, seconds: float) -> None:
    """Returns once every process has come here too and the job is shut down, or after `seconds` of waiting for
    either. The caller ends the process next (os._exit): a shutdown still under way then is left behind."""
    import jax

    deadline = time.monotonic() + seconds
    try:
      self._client.key_value_set(f"{self._ENDING}{self._index}", "1")
      for process in range(self._count):
        self._client.blocking_key_value_get(f"{self._ENDING}{process}",
                                            max(1, int(1000 * (deadline - time.monotonic()))))
    except Exception:  # one did not come (it may be gone already): end without waiting longer
      return
    leaving = threading.Thread(target=jax.distributed.shutdown, daemon=True, name="job-shutdown")
    leaving.start()
    leaving.join(seconds)  # moments, all being here; a hang (one killed meanwhile) is bounded


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
  # JAX's preemption service acts only at a step: until then, a signal stops the run.
  signals.hold_until_training(_start_up_stops())


def _start_up_stops() -> Optional[StartUpStops]:
  """The job's StartUpStops if it has several processes. JAX keeps its key-value store client private; orbax
  reads it from the same place. (jax.process_count() would start the backends, which a program may configure
  after joining.)"""
  from jax._src import distributed as jax_distributed

  state = jax_distributed.global_state
  if state.num_processes < 2:
    return None
  return StartUpStops(state.client, state.process_id, state.num_processes)


def any_process(flag: bool) -> bool:
  """True on every process of the job if `flag` is true on any: they all take the same branch."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))
