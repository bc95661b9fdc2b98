"""Microbatching, remat, scanned layers and LAMB keep the training step's maths: the same losses as the
plain step, through the trainer's own Setup and jitted step on a 2 × 2 mesh.

Run as a script, this file trains a few steps of tiny BERT variants on 4 CPU devices and prints their
losses as JSON (the tests run it in a subprocess to get 4 devices).
"""
import json
import os
import sys

import numpy as np
import pytest

from helpers import ROOT, host_devices, run

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

RUN = "gin_configs/runs/bert_tiny_demo.gin"
SCAN_REMAT = ["bert.BertConfig.scan_layers = True", "bert.BertConfig.remat_policy = 'full'"]
VARIANTS = {"plain": [], "microbatches": ["MICROBATCHES = 2"], "lamb": ["OPTIMIZER = 'lamb'"],
            # MICROBATCH_ROWS_PER_GROUP 2 of the 4 rows per data-parallel group: 2 microbatches.
            "lamb_scan_remat_microbatches": ["OPTIMIZER = 'lamb'", *SCAN_REMAT, "MICROBATCH_ROWS_PER_GROUP = 2"]}
STEPS, BATCH, LENGTH, PREDICTIONS, VOCAB = 3, 8, 32, 5, 512


def synthetic_batches(shapes, equal_weights: bool):
  """Fixed random batches; with equal_weights every row predicts PREDICTIONS positions, else 1 to PREDICTIONS."""
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(STEPS):
    counts = np.full(BATCH, PREDICTIONS) if equal_weights else rng.integers(1, PREDICTIONS + 1, BATCH)
    batch = {
        "input_ids": rng.integers(7, VOCAB, (BATCH, LENGTH)),
        "segment_ids": (np.arange(LENGTH)[None] >= rng.integers(1, LENGTH, (BATCH, 1))).astype(np.int32),
        "masked_positions": np.sort(rng.permuted(np.tile(np.arange(1, LENGTH), (BATCH, 1)), axis=1)[:, :PREDICTIONS]),
        "masked_ids": rng.integers(7, VOCAB, (BATCH, PREDICTIONS)),
        "masked_weights": (np.arange(PREDICTIONS)[None] < counts[:, None]).astype(np.float32),
        "nsp_label": rng.integers(0, 2, BATCH),
    }
    batches.append({k: v.astype(shapes[k].dtype) for k, v in batch.items()})
  return batches


def train_variants() -> dict:
  """Losses of STEPS steps of each variant on the same batches, through the trainer's own Setup and step.

  Every variant starts from the plain variant's initial weights (scanned variants: the same weights
  stacked), so that only the step's arithmetic differs.
  """
  import flax.linen as nn
  import gin
  import jax

  from pretrain import cli, partitioning, roofline, run_files, steps, trainer
  losses, initial = {}, {}
  for name, bindings in VARIANTS.items():
    gin.clear_config()
    cli.parse_gin([RUN], ["bert.BertConfig.hidden_size = 32", "bert.BertConfig.mlp_dim = 64",
                          "bert.BertConfig.dropout_rate = 0.0",  # a microbatch draws its own dropout masks
                          "LEARNING_RATE = 1e-2", "WARMUP_STEPS = 1",  # steps that change the losses visibly
                          f"TASK_FEATURE_LENGTHS = {{'input_ids': {LENGTH}, 'masked_positions': {PREDICTIONS}}}",
                          f"BATCH_SIZE = {BATCH}", "MESH_SHAPE = {'data': 2, 'model': 2}", *bindings])
    args = cli.bound_arguments(trainer.train, roofline.STEP_ARGUMENTS)
    mesh = partitioning.make_mesh(args["mesh_shape"])
    family = args["family"].fit_to_data(VOCAB, "bert_mlm_nsp", args["task_feature_lengths"])
    setup = steps.make_setup(family, args["task_feature_lengths"], args["batch_size"], mesh, args["optimizer"],
                             args["schedule"], args["microbatches"], args["microbatch_rows_per_group"])
    losses[name] = {"microbatches": setup.microbatches}
    with mesh, nn.logical_axis_rules(setup.rules):
      step = steps.jit_train_step(setup)
      for weights in ("equal", "varying"):
        state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(jax.random.PRNGKey(0))
        initial.setdefault("params", jax.device_get(state.params))
        params = initial["params"]
        params = run_files.in_layout(params, setup.family.config.scan_layers)
        state = state.replace(params=jax.device_put(params, setup.state_shardings.params))
        losses[name][weights] = []
        for batch in synthetic_batches(setup.batch_shapes, weights == "equal"):
          state, metrics = step(state, partitioning.global_batch(batch, mesh))
          losses[name][weights].append(float(metrics["loss"]))
  return losses


@pytest.fixture(scope="module")
def variant_losses():
  # As a script this file's folder, not tests/, leads sys.path: helpers must be found through PYTHONPATH.
  env = {**host_devices(4), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
  result = run([sys.executable, __file__], env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_lamb_with_scan_remat_and_microbatches_gives_the_plain_lamb_steps_losses(variant_losses):
  # The options together, under LAMB (whose per-layer trust ratio tests/models/test_layers.py checks closely;
  # scan and remat alone are checked layer by layer there).
  assert variant_losses["lamb_scan_remat_microbatches"]["microbatches"] == 2
  for weights in ("equal", "varying"):
    np.testing.assert_allclose(variant_losses["lamb_scan_remat_microbatches"][weights],
                               variant_losses["lamb"][weights], rtol=1e-5)
    # LAMB took effect: its steps part from Adam's by far more than the tolerance above.
    lamb, plain = np.array(variant_losses["lamb"][weights]), np.array(variant_losses["plain"][weights])
    assert np.max(np.abs(lamb - plain) / plain) > 20 * 1e-5


def test_microbatching_gives_the_plain_steps_losses(variant_losses):
  # Losses are the same rows' mean, and later steps follow from the accumulated gradients; with
  # "varying" weights the microbatches hold different numbers of masked positions.
  for weights in ("equal", "varying"):
    np.testing.assert_allclose(variant_losses["microbatches"][weights], variant_losses["plain"][weights], rtol=1e-5)


if __name__ == "__main__":
  print(json.dumps(train_variants()))
