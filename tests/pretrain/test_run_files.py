"""Every pod run file names a layout that its slice can run: the mesh covers the slice's devices (as libtpu
describes them; partitioning.make_mesh refuses any other count), the batch splits into whole rows per
data-parallel group and microbatch, and the model's arrays divide over the mesh. What `pretrain.plan` would
refuse before compiling, checked for each file without compiling."""
from pathlib import Path

import gin
import pytest

from pretrain import cli, partitioning, plan, plan_search, roofline, trainer

RUNS = Path(__file__).resolve().parents[2] / "gin_configs" / "runs"
TOPOLOGIES = ("v3:16x16", "v3:16x32", "v4:4x4x4", "v5e:16x16")  # the slices run files are written for
POD_RUN_FILES = {path.name: topology for topology in TOPOLOGIES  # named <run>_<accelerator type>.gin
                 for path in sorted(RUNS.glob(f"*_{plan.accelerator_type(topology).replace('-', '_')}.gin"))}


def test_every_slice_has_pod_run_files():
  assert set(POD_RUN_FILES.values()) == set(TOPOLOGIES)


@pytest.mark.parametrize("name", sorted(POD_RUN_FILES))
def test_a_pod_run_file_names_a_layout_its_slice_can_run(name):
  gin.clear_config()
  try:
    cli.parse_gin([str(RUNS / name)], [])
    arguments = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
  finally:
    gin.clear_config()
  devices = roofline.slice_devices(POD_RUN_FILES[name], 1)
  mesh = partitioning.make_mesh(arguments["mesh_shape"], devices=devices, num_slices=1)
  family = trainer.fitted_family(arguments["family"], arguments["mixture_or_task_name"],
                                 arguments["task_feature_lengths"])
  setup = roofline.run_setup(arguments, family, mesh)  # refuses rows that do not split (steps.make_setup)
  assert plan_search.state_bytes_per_device(setup) > 0  # raises where an array does not divide over the mesh
