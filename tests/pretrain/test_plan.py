"""pretrain.plan compiles the training step for a TPU topology and reports sane figures; a step too big
for the chip exits with the compiler's out-of-memory line.

The plans run in this process, as `python -m pretrain.plan` runs them (libtpu compiles for the described
topology and opens no TPU): a subprocess would spend a third of each plan importing."""
import contextlib
import io
import os
import re
import subprocess
from unittest import mock

import gin
import pytest

from pretrain import cli, plan

pytestmark = pytest.mark.starts_first  # a long module (tests/conftest.py)

RUN = "gin_configs/runs/bert_tiny_demo.gin"
V3_USABLE_GIB = 15.48  # per TensorCore, the compiler's own limit (its out-of-memory message)
V3_ICI_PER_CORE = 340e12 / 1024 / 2  # bytes/s: Cloud's all-reduce bandwidth per v3 Pod, per chip, per TensorCore


def run_plan(*args, run=RUN) -> subprocess.CompletedProcess:
  argv = ["pretrain.plan", f"--gin_file={run}", "--topology=v3:2x2", *args]
  stdout, stderr, returncode = io.StringIO(), io.StringIO(), 0
  gin.clear_config()
  with mock.patch.dict(os.environ), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
      cli.run("pretrain.plan", lambda: plan.main(argv))
    except SystemExit as e:
      returncode = e.code
  gin.clear_config()
  return subprocess.CompletedProcess(argv, returncode, stdout.getvalue(), stderr.getvalue())


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


# Dropout's random bits are half a TPU compile (benchmarks/README.md, "Start-up"; the tiny plan: 22 s with them,
# 10 s without): plans that test no figure of dropout leave it out; the encoder-decoder plan keeps it.
NO_DROPOUT = ("--gin.bert.BertConfig.dropout_rate=0.0", "--gin.bert.BertConfig.attention_dropout=0.0")
TINY_PLAN = ("--gin.MESH_SHAPE={'data': 4, 'model': 2}", "--gin.MICROBATCHES=2",
             "--gin.bert.BertConfig.vocab_size=2048", *NO_DROPOUT)
# Each layer adds some 7 s to a v3-8 compile of the tiny BERT (15 s with one, 22 with two): plans that test
# no depth-dependent figure compile one layer per stack.
ONE_LAYER = "--gin.bert.BertConfig.num_layers=1"


@pytest.fixture(scope="module")
def tiny_plan_run(tmp_path_factory):
  """(stdout, the entries it left in JAX's persistent compilation cache) of the tiny plan, run with a cache of
  its own."""
  from pretrain import compilation_cache
  cache = tmp_path_factory.mktemp("plan_compilation_cache")
  with compilation_cache.used(str(cache), model_dir=""):
    result = run_plan(*TINY_PLAN)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout, sorted(entry.name for entry in cache.iterdir())


@pytest.fixture(scope="module")
def tiny_plan(tiny_plan_run):
  return tiny_plan_run[0]


def test_the_step_compiled_for_a_topology_stays_out_of_jax_compilation_cache(tiny_plan_run):
  # It could not be loaded back: with no TPU client, JAX warns on reading the entry and compiles again.
  # (The step is the jitted lambda of steps.jit_train_step; the small CPU programs the plan runs may be cached.)
  assert not [name for name in tiny_plan_run[1] if name.startswith("jit__lambda-")], tiny_plan_run[1]


def test_plan_of_a_tiny_bert_on_a_v3_8_fits_with_sane_figures(tiny_plan):
  out = tiny_plan
  assert "8 devices (TPU v3)" in out and "microbatches 2" in out, out
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", out)
  assert 0 < total < limit and limit == V3_USABLE_GIB
  arguments, = figure(r"arguments ([\d.]+) GiB", out)
  assert arguments <= total
  compiled, = figure(r"compiled FLOPs per device per step: ([\d.e+]+)", out)
  model, per_device, per_token = figure(
      r"model FLOPs per step: ([\d.e+]+) = ([\d.e+]+) per device = ([\d.e+]+) per token", out)
  # Defaults of bert_tiny_demo.gin: batch 32, length 128, 20 predictions, 2 layers of 128, FFN 512.
  expected = 3 * bert_forward_matmul_flops(32, 128, 20, 128, 2, 512, 2048)
  assert model == pytest.approx(expected, rel=1e-3)
  assert per_device == pytest.approx(expected / 8, rel=1e-3) and per_token == pytest.approx(expected / 4096, rel=1e-3)
  # The compiler's count holds every matmul plus elementwise and optimizer work; counting the
  # microbatch loop's body once more (or once less) than it runs would double (or halve) it.
  assert per_device < compiled < 2 * per_device
  step, mfu = figure(r"step >= ([\d.e+-]+) s, MFU <= ([\d.]+)%", out)
  assert step > 0 and 0 < mfu <= 100


def collective_figures(out):
  """({kind: bytes}, total bytes, seconds) of a plan's collectives line."""
  line = next(line for line in out.splitlines() if line.startswith("collectives: bytes sent per device per step:"))
  by_kind = {kind: float(sent) for kind, sent in re.findall(r"([a-z-]+) ([\d.]+e[+-]\d+)", line.split("; total")[0])}
  total, seconds = figure(r"; total ([\d.e+]+) .* -> ([\d.e+-]+) s at", line)
  return by_kind, total, seconds


def test_the_tiny_plan_counts_the_data_parallel_gradient_reduction_and_times_it_at_ici_bandwidth(tiny_plan):
  by_kind, total, seconds = collective_figures(tiny_plan)
  assert total == pytest.approx(sum(by_kind.values()), rel=1e-3)
  # Mesh data 4 x model 2: every device holds at least half the parameters' f32 gradients (the rest is
  # split over `model`), reduced over its 4 data-parallel peers. However XLA does it, each device sends
  # at least (4 - 1) / 4 of them; a ring all-reduce sends twice that.
  parameters, = figure(r"([\d.]+)M parameters", tiny_plan)
  assert by_kind.get("all-reduce", 0) + by_kind.get("reduce-scatter", 0) >= 3 / 4 * 4 * parameters * 1e6 / 2
  assert seconds == pytest.approx(total / V3_ICI_PER_CORE, rel=1e-2)
  assert f"{V3_ICI_PER_CORE / 1e9:.0f} GB/s ICI" in tiny_plan
  compute, hbm, communication, step = figure(
      r"compute ([\d.e+-]+) s, HBM ([\d.e+-]+) s, communication ([\d.e+-]+) s per step .* step >= ([\d.e+-]+) s",
      tiny_plan)
  assert communication == pytest.approx(seconds, rel=1e-2)
  assert step == pytest.approx(max(compute, hbm, communication), rel=1e-2)  # the headline assumes overlap
  serial, = figure(r"collectives do not overlap .* step >= ([\d.e+-]+) s", tiny_plan)
  assert serial == pytest.approx(max(compute, hbm) + communication, rel=1e-2)


def test_scanned_layers_are_costed_as_if_unrolled(tiny_plan):
  # XLA counts a scanned stack's body once: with 2 layers, reading its figure as is would halve them.
  result = run_plan(*TINY_PLAN, "--gin.bert.BertConfig.scan_layers=True")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "scanned layers" in result.stdout
  for pattern in (r"compiled FLOPs per device per step: ([\d.e+]+)",
                  r"HBM bytes accessed per device per step: ([\d.e+]+)",
                  r"model FLOPs per step: ([\d.e+]+)"):
    assert figure(pattern, result.stdout) == pytest.approx(figure(pattern, tiny_plan), rel=0.02), pattern
  # The scanned program's collectives sit in a loop over layers inside the loop over microbatches, each
  # body counted as often as it runs. It all-reduces each layer's gradients in every microbatch, where
  # the unrolled program does so once after the microbatch loop: here 2 x 2 x 0.59 MB more, +10%.
  # Counting either loop's body once would come out well under the unrolled program's figure.
  scanned, unrolled = collective_figures(result.stdout)[1], collective_figures(tiny_plan)[1]
  assert 0.95 * unrolled < scanned < 1.25 * unrolled
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", result.stdout)
  assert 0 < total < limit


def test_a_step_too_big_for_the_chip_exits_with_the_compilers_out_of_memory_line():
  # A 4M-piece vocabulary: its embedding and Adam moments alone exceed a v3 core's HBM.
  result = run_plan("--gin.MESH_SHAPE={'data': 4, 'model': 2}", "--gin.bert.BertConfig.vocab_size=4000000",
                    "--gin.bert.BertConfig.hidden_size=1024", ONE_LAYER, *NO_DROPOUT)
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.plan: does not fit: RESOURCE_EXHAUSTED") and "Ran out of memory" in last, last
  assert f"{V3_USABLE_GIB}G" in last


def test_a_step_compiles_to_fit_the_hbm_limit_given_and_is_refused_below_what_it_needs():
  fits = run_plan(*TINY_PLAN, ONE_LAYER, "--hbm_limit_gib=1")
  assert fits.returncode == 0, fits.stderr[-3000:]
  assert f"1.00 GiB HBM usable (--hbm_limit_gib; the chip's {V3_USABLE_GIB:.2f})" in fits.stdout, fits.stdout
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", fits.stdout)
  assert limit == 1.0 and 0 < total < limit
  refused = run_plan(*TINY_PLAN, ONE_LAYER, "--hbm_limit_gib=0.001")  # 1 MiB: less than the parameters alone
  assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
  last = refused.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.plan: does not fit: RESOURCE_EXHAUSTED") and "(1.00M)" in last, last
  beyond = run_plan(*TINY_PLAN, "--hbm_limit_gib=16")
  assert beyond.returncode == 1
  assert beyond.stderr.strip().splitlines()[-1] == (f"pretrain.plan: error: --hbm_limit_gib=16: more than the "
                                                    f"{V3_USABLE_GIB:.2f} GiB a device of v3:2x2 has")


H100_MEMORY_GIB = 81559 / 1024  # nvidia-smi's 81559 MiB of an H100 SXM 80GB
H100_NVLINK_ONE_WAY = 900e9 / 2  # bytes/s: NVLink 4's 900 GB/s per GPU is both directions together
H100_NETWORK_ONE_WAY = 400e9 / 8  # bytes/s: a DGX H100 has a 400 Gbit/s ConnectX-7 adapter per GPU
GPU_PLAN = ("--topology=h100:2x4", "--gin.MESH_SHAPE={'data': 4, 'model': 2}", "--gin.MICROBATCHES=2",
            "--gin.bert.BertConfig.vocab_size=2048", "--gin.bert.BertConfig.dtype='bfloat16'", *NO_DROPOUT)


@pytest.fixture(scope="module")
def gpu_plan():
  result = run_plan(*GPU_PLAN)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_a_plan_for_described_gpus_counts_every_microbatch_and_times_collectives_by_the_links_they_cross(gpu_plan):
  """Compiled for two machines of 4 described H100s by jax's CUDA plugin, with no GPU here. XLA gives no cost
  analysis there: the figures are the program's kernels' (pretrain.hlo_costs). The mesh's `model` pairs sit within
  a machine, its `data` groups of 4 span both."""
  assert "= 8 GPUs (NVIDIA H100 80GB HBM3) in 2 machines" in gpu_plan and "microbatches 2" in gpu_plan, gpu_plan
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", gpu_plan)
  assert limit == pytest.approx(0.75 * H100_MEMORY_GIB, abs=0.01)  # what jax takes of a GPU by default
  assert 0 < total < limit
  compiled, = figure(r"compiled FLOPs per device per step: ([\d.e+]+)", gpu_plan)
  _, per_device, _ = figure(r"model FLOPs per step: ([\d.e+]+) = ([\d.e+]+) per device = ([\d.e+]+)", gpu_plan)
  # The microbatch loop's body counted once would give half the model's FLOPs.
  assert per_device <= compiled < 1.5 * per_device
  by_kind, total_sent, seconds = collective_figures(gpu_plan)
  parameters, = figure(r"([\d.]+)M parameters", gpu_plan)
  gradients = 3 / 4 * 4 * parameters * 1e6 / 2  # at least half of each f32 gradient, reduced over 4 data peers
  assert by_kind.get("all-reduce", 0) + by_kind.get("reduce-scatter", 0) >= gradients
  between_machines, = figure(r"([\d.e+]+) of it in collectives between machines", gpu_plan)
  assert gradients <= between_machines < total_sent  # `model`'s collectives stay within a machine
  assert seconds == pytest.approx((total_sent - between_machines) / H100_NVLINK_ONE_WAY
                                  + between_machines / H100_NETWORK_ONE_WAY, rel=1e-2)
  # Kernels one after another, each at its own roofline, take at least what all FLOPs or all bytes take.
  serial, = figure(r"collectives do not overlap .* step >= ([\d.e+-]+) s", gpu_plan)
  overlapped, kernels, mfu = figure(
      r"one after another, .* step >= ([\d.e+-]+) s with collectives overlapped, ([\d.e+-]+) s without, "
      r"MFU <= ([\d.]+)%", gpu_plan)
  assert serial <= kernels and seconds <= overlapped <= kernels and 0 < mfu <= 100


def test_a_step_beyond_the_gpu_memory_jax_takes_does_not_fit():
  with mock.patch.dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.0001"):  # 8 MiB of an H100
    result = run_plan(*GPU_PLAN, ONE_LAYER)
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
  assert "0.0001 of its memory usable (XLA_PYTHON_CLIENT_MEM_FRACTION)" in result.stdout
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("pretrain.plan: does not fit: the compiled step needs ") and "0.01 GiB usable" in last, last


def test_the_triton_attention_kernels_are_planned_as_triton_kernels_with_their_products_counted():
  """models/flash_dropout.py's kernels are interpreted where the program is for a CPU. A plan traces on a CPU for
  GPUs: it gets them as Triton kernels, not as the interpreter's loops, and counts their products: the forward
  kernel's two, the dk/dv kernel's four and the dq kernel's three, where XLA's attention does two and four. So the
  step computes the model's FLOPs plus three products of every head's scores (q·k·head_dim, 2 FLOPs each)."""
  result = run_plan("--topology=h100:1", "--gin.MESH_SHAPE={'data': 1}", "--gin.bert.BertConfig.vocab_size=2048",
                    "--gin.bert.BertConfig.dtype='bfloat16'", "--gin.bert.BertConfig.attention_implementation='triton'",
                    ONE_LAYER)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "unknown FLOPs" not in result.stdout, result.stdout
  batch, tokens = figure(r"global batch (\d+) \((\d+) tokens\)", result.stdout)
  length, heads, head_dim = tokens / batch, 2, 64  # bert_tiny: hidden 128 in 2 heads
  compiled, = figure(r"compiled FLOPs per device per step: ([\d.e+]+)", result.stdout)
  model, = figure(r"model FLOPs per step: ([\d.e+]+)", result.stdout)
  assert compiled == pytest.approx(model + 3 * 2 * batch * heads * length * length * head_dim, rel=2e-3)


def test_a_gpu_topology_may_give_its_machines_network():
  from pretrain import roofline
  dgx, _ = roofline.parse_topology("h100:2x4")
  cloud, gpus = roofline.parse_topology("h100:2x4@100")
  assert (dgx.network_bandwidth, cloud.network_bandwidth, gpus) == (H100_NETWORK_ONE_WAY, 100e9 / 8, 8)
  assert cloud.ici_bandwidth == dgx.ici_bandwidth == H100_NVLINK_ONE_WAY  # NVLink, within a machine


def test_an_unknown_topology_name_fails_with_one_line():
  for name in ("v3-512", "h100:9", "x100:8", "h100:2x4@0", "h100:2x4@fast"):
    result = run_plan(f"--topology={name}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"pretrain.plan: error: --topology='{name}'"), name


def test_an_encoder_decoder_model_plans_on_two_slices_with_the_replica_axis_across_them():
  # BART's tasks have encoder and decoder token features, no `input_ids`, and bart_tiny leaves vocab_size unset.
  result = run_plan("--num_slices=2", "--gin.MESH_SHAPE={'replica': 2, 'data': 8}", "--gin.BATCH_SIZE=16",
                    "--gin.TASK_FEATURE_LENGTHS={'encoder_input_ids': 32, 'decoder_input_ids': 32}",
                    "--gin.bart.BartConfig.encoder_layers=1", "--gin.bart.BartConfig.decoder_layers=1",
                    run="gin_configs/runs/bart_tiny_demo.gin")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "run: bart," in result.stdout
  assert "x 2 slice(s) = 16 devices" in result.stdout and "'replica': 2" in result.stdout
  total, limit = figure(r"total ([\d.]+) GiB of ([\d.]+) GiB", result.stdout)
  assert 0 < total < limit
  # The gradients are reduced over `replica` too, between the slices (libtpu's sends over DCN), each device's
  # eighth of them after a reduce-scatter over `data`, whose collectives stay within each slice.
  _, sent, _ = collective_figures(result.stdout)
  between_slices, = figure(r"([\d.e+]+) of it in collectives between slices", result.stdout)
  parameters, = figure(r"([\d.]+)M parameters", result.stdout)
  gradient_eighth = 4 * parameters * 1e6 / 8 * 0.99  # f32; the parameter count has 2 digits
  assert 2 * 1 / 2 * gradient_eighth <= between_slices < sent / 2


@pytest.mark.parametrize("kernel, kernels, products", [
    pytest.param("pallas", 3, 4 + 8 + 6, marks=pytest.mark.slow),  # not 'auto's choice: `make test-all` compiles it
    ("splash", 2, 4 + 10)])
def test_pallas_attention_runs_per_device_in_the_step_of_a_v4_slice(kernel, kernels, products):
  """XLA does not partition a Mosaic kernel: traced under the run's mesh (jax.set_mesh), Pallas flash or splash
  attention runs per device in shard_map, the batch split over `data` and the heads over `model` (init's
  one-row example whole). Compiled for a v4-8, the step holds the kernels, forward and backward."""
  from pretrain import roofline
  with mock.patch.object(roofline, "step_figures", wraps=roofline.step_figures) as figures:
    result = run_plan("--topology=v4:2x2x1", "--gin.MESH_SHAPE={'data': 4, 'model': 2}",
                      "--gin.bert.BertConfig.vocab_size=2048", *NO_DROPOUT,
                      f"--gin.bert.BertConfig.attention_implementation='{kernel}'", ONE_LAYER)
  assert result.returncode == 0, result.stderr[-3000:]
  program = figures.call_args.args[0].as_text()
  assert program.count('custom_call_target="tpu_custom_call"') >= 2, program[:3000]  # 1 layer, fwd + bwd
  # Costed from the algorithm (pretrain.kernel_costs), not the kernels' own estimates: flash's forward, dk/dv
  # and dq kernels of the one layer do 4 + 8 + 6 products of q·k·d per head, splash's forward and fused
  # backward 4 + 10, on each device's 32 / 4 rows and 2 / 2 heads of 128 positions.
  counted, flops = figure(r"Pallas attention: (\d+) kernels, counted from their blocks: ([\d.e+]+) FLOPs",
                          result.stdout)
  assert counted == kernels
  assert flops == pytest.approx(products * 8 * 1 * 128 * 128 * 64, rel=1e-3)  # printed to 4 digits
  assert "of unknown algorithm" not in result.stdout
