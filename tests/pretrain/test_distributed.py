"""Which launch a process joins: SLURM's srun and Open MPI's mpirun tasks go to jax.distributed.initialize()
with no arguments (jax reads their environment); a lone process joins a job of its own."""
from pretrain import distributed


def test_srun_and_mpirun_tasks_are_told_from_a_lone_process(monkeypatch):
  for name in distributed.CLUSTER_TASK_COUNT_ENVS:
    monkeypatch.delenv(name, raising=False)
  assert not distributed.launched_as_cluster_tasks()
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # srun of one task: a job of its own
  assert not distributed.launched_as_cluster_tasks()
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
  assert distributed.launched_as_cluster_tasks()
  monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
  assert distributed.launched_as_cluster_tasks()
