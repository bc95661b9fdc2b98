"""pretrain.plan compiles the training step for a TPU topology and reports sane figures; a step too big
for the chip exits with the compiler's out-of-memory line; microbatching, remat and scanned layers
keep the maths.

Run as a script, this file trains a few steps of tiny BERT variants on 4 CPU devices and prints their
losses as JSON (the equivalence tests run it in a subprocess to get 4 devices).
"""
import json
import re
import sys

import numpy as np
import pytest

from helpers import host_devices, run, run_module

RUN = "gin_configs/runs/bert_tiny_demo.gin"
V3_USABLE_GIB = 15.48  # per TensorCore, the compiler's own limit (its out-of-memory message)


def run_plan(*args):
  return run_module("pretrain.plan", f"--gin_file={RUN}", "--topology=v3:2x2", *args, timeout=300)


def figure(pattern, text):
  match = re.search(pattern, text)
  assert match, f"{pattern!r} not in:\n{text}"
  return [float(g) for g in match.groups()]


def bert_forward_matmul_flops(batch, length, predictions, hidden, layers, mlp, vocab):
  """Forward matmuls of BERT pretraining, from the architecture (Devlin et al. 2018)."""
  tokens = batch * length
  per_layer = (2 * tokens * hidden * 3 * hidden  # Q, K, V projections
               + 2 * tokens * length * hidden * 2  # scores and the weighted sum of values, all heads
               + 2 * tokens * hidden * hidden  # attention output projection
               + 2 * tokens * hidden * mlp * 2)  # feed-forward in and out
  pooler_and_nsp = 2 * batch * hidden * hidden + 2 * batch * hidden * 2
  mlm = 2 * batch * predictions * (hidden * hidden + hidden * vocab)  # transform, then tied output projection
  return layers * per_layer + pooler_and_nsp + mlm


TINY_PLAN = ("--gin.MESH_SHAPE={'data': 4, 'model': 2}", "--gin.MICROBATCHES=2", "--gin.bert.BertConfig.vocab_size=2048")


@pytest.fixture(scope="module")
def tiny_plan():
  result = run_plan(*TINY_PLAN)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_plan_of_a_tiny_bert_on_a_v3_8_fits_with_sane_figures(tiny_plan):
  out = tiny_plan
  assert "8 devices (TPU v3)" in out and "microbatches 2" in out, out
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", out)
  assert 0 < total < limit and limit == V3_USABLE_GIB
  arguments, = figure(r"arguments ([\d.]+) GiB", out)
  assert arguments <= total
  compiled, = figure(r"compiled FLOPs per device per step: ([\d.e+]+)", out)
  model, per_device, per_token = figure(r"model FLOPs per step: ([\d.e+]+) = ([\d.e+]+) per device = ([\d.e+]+) per token", out)
  # Defaults of bert_tiny_demo.gin: batch 32, length 128, 20 predictions, 2 layers of 128, FFN 512.
  expected = 3 * bert_forward_matmul_flops(32, 128, 20, 128, 2, 512, 2048)
  assert model == pytest.approx(expected, rel=1e-3)
  assert per_device == pytest.approx(expected / 8, rel=1e-3) and per_token == pytest.approx(expected / 4096, rel=1e-3)
  # The compiler's count holds every matmul plus elementwise and optimizer work; counting the
  # microbatch loop's body once more (or once less) than it runs would double (or halve) it.
  assert per_device < compiled < 2 * per_device
  step, mfu = figure(r"step >= ([\d.e+-]+) s, MFU <= ([\d.]+)%", out)
  assert step > 0 and 0 < mfu <= 100


def test_scanned_layers_are_costed_as_if_unrolled(tiny_plan):
  # XLA counts a scanned stack's body once: with 2 layers, reading its figure as is would halve them.
  result = run_plan(*TINY_PLAN, "--gin.bert.BertConfig.scan_layers=True")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "scanned layers" in result.stdout
  for pattern in (r"compiled FLOPs per device per step: ([\d.e+]+)", r"HBM bytes accessed per device per step: ([\d.e+]+)",
                  r"model FLOPs per step: ([\d.e+]+)"):
    assert figure(pattern, result.stdout) == pytest.approx(figure(pattern, tiny_plan), rel=0.02), pattern
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", result.stdout)
  assert 0 < total < limit


def test_a_step_too_big_for_the_chip_exits_with_the_compilers_out_of_memory_line():
  # A 4M-piece vocabulary: its embedding and Adam moments alone exceed a v3 core's HBM.
  result = run_plan("--gin.MESH_SHAPE={'data': 4, 'model': 2}", "--gin.bert.BertConfig.vocab_size=4000000",
                    "--gin.bert.BertConfig.hidden_size=1024")
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.plan: does not fit: RESOURCE_EXHAUSTED") and "Ran out of memory" in last, last
  assert f"{V3_USABLE_GIB}G" in last


def test_two_slices_put_the_replica_axis_across_them():
  result = run_plan("--num_slices=2", "--gin.MESH_SHAPE={'replica': 2, 'data': 4, 'model': 2}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "x 2 slice(s) = 16 devices" in result.stdout and "'replica': 2" in result.stdout
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", result.stdout)
  assert 0 < total < limit


def test_an_unknown_topology_name_fails_with_one_line():
  result = run_plan("--topology=v3-512")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith("pretrain.plan: error: --topology='v3-512'")


# --- microbatching and remat keep the training maths -------------------------------------------

SCAN = "bert.BertConfig.scan_layers = True"
VARIANTS = {"plain": [], "microbatches": ["MICROBATCHES = 2"], "remat": ["bert.BertConfig.remat_policy = 'full'"],
            "scan": [SCAN], "lamb": ["OPTIMIZER = 'lamb'"],
            # PER_DEVICE_BATCH 2 of the 4 rows per batch shard: 2 microbatches.
            "lamb_scan_remat_microbatches": ["OPTIMIZER = 'lamb'", SCAN, "bert.BertConfig.remat_policy = 'full'",
                                             "PER_DEVICE_BATCH = 2"]}
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
  import gin
  import jax
  import flax.linen as nn
  from models import layers
  from pretrain import cli, partitioning, plan, trainer
  losses, initial = {}, {}
  for name, bindings in VARIANTS.items():
    gin.clear_config()
    cli.parse_gin([RUN], ["bert.BertConfig.hidden_size = 32", "bert.BertConfig.mlp_dim = 64",
                          "bert.BertConfig.dropout_rate = 0.0",  # a microbatch draws its own dropout masks
                          "LEARNING_RATE = 1e-2", "WARMUP_STEPS = 1",  # steps that change the losses visibly
                          f"TASK_FEATURE_LENGTHS = {{'input_ids': {LENGTH}, 'masked_positions': {PREDICTIONS}}}",
                          f"BATCH_SIZE = {BATCH}", "MESH_SHAPE = {'data': 2, 'model': 2}", *bindings])
    args = plan.train_arguments()
    mesh = partitioning.make_mesh(args["mesh_shape"])
    setup = trainer.setup_for_run(args["family"], args["task_feature_lengths"], args["batch_size"], mesh,
                                  args["optimizer"], args["schedule"], args["microbatches"], VOCAB,
                                  args["per_device_batch"])
    losses[name] = {"microbatches": setup.microbatches}
    with mesh, nn.logical_axis_rules(setup.rules):
      step = trainer.jit_train_step(setup)
      for weights in ("equal", "varying"):
        state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(jax.random.PRNGKey(0))
        initial.setdefault("params", jax.device_get(state.params))
        params = initial["params"]
        if setup.family.config.scan_layers:
          params = layers.stack_layer_params(params)
        state = state.replace(params=jax.device_put(params, setup.state_shardings.params))
        losses[name][weights] = []
        for batch in synthetic_batches(setup.batch_shapes, weights == "equal"):
          state, metrics = step(state, partitioning.global_batch(batch, mesh))
          losses[name][weights].append(float(metrics["loss"]))
  return losses


@pytest.fixture(scope="module")
def variant_losses():
  result = run([sys.executable, __file__], env=host_devices(4))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_full_remat_gives_the_plain_steps_losses(variant_losses):
  np.testing.assert_allclose(variant_losses["remat"]["equal"], variant_losses["plain"]["equal"], rtol=1e-6)
  np.testing.assert_allclose(variant_losses["remat"]["varying"], variant_losses["plain"]["varying"], rtol=1e-6)


def test_scanned_layers_give_the_plain_steps_losses(variant_losses):
  for weights in ("equal", "varying"):
    np.testing.assert_allclose(variant_losses["scan"][weights], variant_losses["plain"][weights], rtol=1e-5)


def test_lamb_with_scan_remat_and_microbatches_gives_the_plain_lamb_steps_losses(variant_losses):
  # The options together, under LAMB (whose per-layer trust ratio test_scan_layers.py checks closely).
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
