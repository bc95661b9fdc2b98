"""Every pod run file names a layout that its slice can run: the mesh covers the slice's devices (as libtpu
describes them), the batch splits into whole rows per data-parallel group and microbatch, and the model's
arrays divide over the mesh. What `pretrain.plan` would refuse before compiling, checked for each file
without compiling."""
from pathlib import Path

import gin
import pytest

from pretrain import cli, partitioning, plan_search, roofline, trainer

RUNS = Path(__file__).resolve().parents[2] / "gin_configs" / "runs"
SLICES = {"v3_512": "v3:16x16", "v3_1024": "v3:16x32", "v4_128": "v4:4x4x4", "v5litepod_256": "v5e:16x16"}
POD_RUN_FILES = sorted(path.name for path in RUNS.glob("*.gin") if any(path.stem.endswith(s) for s in SLICES))


def test_every_slice_has_pod_run_files():
  assert {next(s for s in SLICES if name[:-4].endswith(s)) for name in POD_RUN_FILES} == set(SLICES)


@pytest.mark.parametrize("name", POD_RUN_FILES)
def test_a_pod_run_file_names_a_layout_its_slice_can_run(name):
  topology = next(SLICES[s] for s in SLICES if name[:-4].endswith(s))
  gin.clear_config()
  try:
    cli.parse_gin([f"gin_configs/runs/{name}"], [])
    arguments = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
  finally:
    gin.clear_config()
  devices = roofline.slice_devices(topology, 1)
  mesh = partitioning.make_mesh(arguments["mesh_shape"], devices=devices, num_slices=1)
  assert mesh.devices.size == len(devices), f"{name}: mesh {dict(mesh.shape)} on {len(devices)} devices"
  family = trainer.fitted_family(arguments["family"], arguments["mixture_or_task_name"],
                                 arguments["task_feature_lengths"])
  setup = roofline.run_setup(arguments, family, mesh)  # refuses rows that do not split (steps.make_setup)
  assert plan_search.state_bytes_per_device(setup) > 0  # every array divides over the mesh
