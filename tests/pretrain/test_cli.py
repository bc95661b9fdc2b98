"""What a user gets wrong ends pretrain.train with one line naming it and exit code 1; a bug keeps its
traceback. The cases fail before any training, so they run in this process through the program's
own main and error handling. Every program has a --help; a run prints no start-up noise."""
import importlib.util
import json
import os
import re
import runpy
import shlex
import sys
from unittest import mock

import gin
import pytest

from helpers import ROOT, STDERR_FILE, run, run_train
from pretrain import cli, plan, train, trainer

BERT_RUN = "--gin_file=gin_configs/runs/bert_tiny_demo.gin"
XLNET_RUN = "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin"


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.NO_SUCH_MACRO_OR_CONFIG.x=1"], "No configurable matching 'NO_SUCH_MACRO_OR_CONFIG'"),
    ([BERT_RUN, "--gin.BATCH_SIZE=%NOT_SET_ANYWHERE"], "macro NOT_SET_ANYWHERE is not set"),
    ([BERT_RUN, "--gin.PER_DEVICE_BATCH=2"],  # the old name, which gin took and nothing read (#10)
     "PER_DEVICE_BATCH = 2: no setting reads the macro PER_DEVICE_BATCH; similar macros the run reads: BATCH_SIZE"),
    ([BERT_RUN, "--gin_file=gin_configs/data/tfds.gin", "--gin.TRAIN_FILES='/data/*.txt'"],
     "no setting reads the macro TRAIN_FILES: only text_task.train_files, a binding this run does not use"),
    ([BERT_RUN, "--gin_bindings=bert.BertConfig.no_such_field = 1"],
     "Configurable 'bert.BertConfig' doesn't have a parameter named 'no_such_field'"),
    ([BERT_RUN, "--gin.MIXTURE_OR_TASK_NAME='no_such_task'"], "unknown task or mixture 'no_such_task'"),
    ([BERT_RUN, "--gin.TRAIN_FILES='/nonexistent/*.txt'"], "TRAIN_FILES='/nonexistent/*.txt' matches no files"),
    ([BERT_RUN, "--gin.TASK_FEATURE_LENGTHS={'input_ids': 64}"],
     "the bert_mlm_nsp objective takes the lengths ['input_ids', 'masked_positions']"),
    ([XLNET_RUN, "--gin_file=gin_configs/models/bert_tiny.gin"],
     "the bert family trains on bert_mlm_nsp examples, the task gives xlnet_plm examples"),
    ([BERT_RUN, "--gin.MESH_SHAPE={'data': 3}"], "MESH_SHAPE={'data': 3} needs 3 devices, have 1"),
    ([BERT_RUN, "--gin.MESH_SHAPE={'data': 0, 'model': -1}"], "each axis's size must be at least 1, or -1 for the"),
    ([BERT_RUN, "--gin.MICROBATCH_ROWS_PER_GROUP=3"], "MICROBATCH_ROWS_PER_GROUP=3 does not divide the 32 rows"),
    ([BERT_RUN, "--gin.MICROBATCH_ROWS_PER_GROUP=8", "--gin.MICROBATCHES=2"],
     "MICROBATCHES=2 and MICROBATCH_ROWS_PER_GROUP=8: set one of them"),
    (["--gin_file=gin_configs/runs/albert_tiny_demo.gin", "--gin.albert.AlbertConfig.share='bogus'"],
     "share='bogus': expected one of"),
    ([BERT_RUN, "--gin_file=gin_configs/data/wikipedia_books.gin"],
     "VOCAB_MODEL is not set: the TFDS task 'wikipedia/20230601.en:1.0.0' needs the sentencepiece model"),
    ([BERT_RUN, "--gin_file=gin_configs/data/tfds.gin", "--gin.TFDS_DATA_DIR='/nonexistent'",
      "--gin.VOCAB_MODEL='/data/spm.model'"],
     "TFDS dataset 'wikipedia/20230601.en:1.0.0' is not prepared in TFDS_DATA_DIR='/nonexistent'"),
    ([XLNET_RUN, "--gin.DATA_SHARDS=2"],
     "DATA_SHARDS=2 does not apply to 'demo_xlnet_plm': each of its rows reads a stream of its token file"),
    ([XLNET_RUN, "--gin.xlnet.XLNetConfig.reuse_len=32"],
     "xlnet.XLNetConfig.reuse_len=32 differs from the data's TASK_FEATURE_LENGTHS reuse_len=64"),
    ([BERT_RUN, "--no_such_flag"], "unknown arguments ['--no_such_flag']"),
    ([BERT_RUN, "--gin.TRAIN_STEPS=0"], "TRAIN_STEPS=0: must be at least 1"),
    # A count of 0 would divide by zero after the compile (LOG_EVERY_STEPS), or keep no checkpoint (KEEP_CHECKPOINTS).
    ([BERT_RUN, "--gin.LOG_EVERY_STEPS=0"], "LOG_EVERY_STEPS=0: must be at least 1"),
    ([BERT_RUN, "--gin.KEEP_CHECKPOINTS=0"], "KEEP_CHECKPOINTS=0: must be at least 1"),
    ([BERT_RUN, "--gin.EVAL_EVERY_STEPS=-1"], "EVAL_EVERY_STEPS=-1: must be at least 0"),
    ([BERT_RUN, "--gin.MICROBATCHES=0"], "MICROBATCHES=0: must be at least 1"),
    ([BERT_RUN, "--gin.LEARNING_RATE=-1e-3"], "LEARNING_RATE=-0.001: must be at least 0"),
    ([BERT_RUN, "--gin.ADAM_B2=1.0"], "ADAM_B2=1.0: must be at least 0 and below 1"),
    ([BERT_RUN, "--gin.PROFILE_STEPS=(5, 2)"], "PROFILE_STEPS=(5, 2): expected (first, last) with 1 <= first <= last"),
    (["--gin_file=gin_configs/runs/no_such_run.gin"], "--gin_file=gin_configs/runs/no_such_run.gin: no such file"),
])
def test_bad_configuration_fails_with_one_line(args, message, capsys, tmp_path):
  code, last = run_train(capsys, tmp_path, *args)
  assert code == 1
  assert last.startswith("pretrain.train: error:") and message in last, last


def plan_main(args):
  plan.main(["pretrain.plan", "--topology=v3:2x2", *args])


def input_pipeline_main(args):
  runpy.run_path(str(ROOT / "benchmarks" / "input_pipeline.py"))["main"](args)


@pytest.mark.parametrize("program, main", [("pretrain.plan", plan_main), ("input_pipeline", input_pipeline_main)])
def test_the_other_gin_programs_refuse_a_setting_nothing_reads(program, main, capsys):
  """They parse gin through pretrain.cli too, and stop there, before libtpu or any data."""
  gin.clear_config()
  with mock.patch.dict(os.environ), pytest.raises(SystemExit) as exited:  # plan sets libtpu's variables
    cli.run(program, lambda: main([BERT_RUN, "--gin.PER_DEVICE_BATCH=2"]))
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert exited.value.code == 1 and last.startswith(f"{program}: error: PER_DEVICE_BATCH = 2: no setting reads"), last


def test_an_include_found_nowhere_is_named_with_the_file_that_includes_it(capsys, tmp_path):
  run_file = tmp_path / "mine.gin"
  run_file.write_text("include 'gin_configs/runs/bert_tiny_demo.gin'\ninclude 'nowhere/x.gin'\n")
  code, last = run_train(capsys, tmp_path, f"--gin_file={run_file}")
  assert code == 1 and last.startswith("pretrain.train: error: Unable to open file: nowhere/x.gin. Searched config ")
  assert last.endswith(f'In file "{run_file}", line 2'), last


def test_a_model_dir_that_is_a_file_fails_with_one_line(capsys, tmp_path):
  (tmp_path / "a_file").write_text("not a directory")
  code, last = run_train(capsys, tmp_path, BERT_RUN, f"--gin.MODEL_DIR='{tmp_path / 'a_file'}'")
  assert code == 1 and last.startswith(f"pretrain.train: error: MODEL_DIR='{tmp_path / 'a_file'}' is a file"), last


def test_a_bug_is_not_reported_as_a_user_error(monkeypatch, tmp_path):
  """A KeyError or TypeError from inside the run is the framework's fault: it keeps its traceback."""
  def broken(*args, **kwargs):
    raise KeyError("masked_ids")

  monkeypatch.setattr(trainer, "fitted_family", broken)
  gin.clear_config()
  with pytest.raises(KeyError, match="masked_ids"):
    cli.run("pretrain.train", lambda: train.main(["pretrain.train", BERT_RUN, f"--gin.MODEL_DIR='{tmp_path}'"]))


# Every command-line program and a flag its --help must list.
PROGRAMS = {
    "pretrain.train": "--gin_file", "pretrain.plan": "--topology", "pretrain.export": "--output_dir",
    "pretrain.import_hf": "--hf_dir", "pretrain.demo": "--train_steps", "data_pipelines.vocab": "--vocab_size",
    "data_pipelines.split_text": "--num_files", "data_pipelines.preview": "--num_examples",
    "data_pipelines.tokenize": "--vocab_model", "pretrain.op_profile": "--hlo",
    "launch.local": "--num_processes", "launch.tpu": "--accelerator_type",
    "benchmarks/input_pipeline.py": "--step_seconds", "benchmarks/checkpoint_checksums.py": "--millions",
    "benchmarks/plan_xlnet_large_v3_512.py": "--gin.KEY=VALUE", "benchmarks/train_step.py": "--repeats",
    "benchmarks/convergence.py": "--eval_every",
}
GIN_PROGRAMS = ("pretrain.train", "pretrain.plan", "benchmarks/input_pipeline.py",
                "benchmarks/plan_xlnet_large_v3_512.py")
# TensorFlow's and absl's start; gin's misses of an include under a search path that does not hold it.
START_UP_NOISE = re.compile(r"cuInit|cuda_|absl::InitializeLog|rebuild TensorFlow|oneDNN|Path not found")

# Runs `PROGRAM --help` for each program given, as `python -m` or `python FILE` would, all in one process
# (their imports are shared); prints {program: [exit code, stdout]} as JSON. Then, with TensorFlow loaded by
# them, it imports transformers' PyTorch BERT (which loads Triton) and prints the Triton it found.
HELP_OF_EACH = r"""
import json, sys
sys.path.append("tests")
from helpers import run_here

ran = {program: run_here(program, "--help") for program in sys.argv[1:]}
print(json.dumps({program: [result.returncode, result.stdout] for program, result in ran.items()}))
assert "tensorflow" in sys.modules
import transformers
transformers.BertForPreTraining
print(json.dumps(sys.modules["triton"].__version__))
"""


@pytest.fixture(scope="module")
def every_programs_help():
  """The run of HELP_OF_EACH over PROGRAMS, in a new process. TF_ENABLE_ONEDNN_OPTS=1: TensorFlow, imported by
  data_pipelines.startup on the way, logs "oneDNN custom operations are on" here as it does by default on CPUs
  with AVX-512 VNNI; the line must not show."""
  return run([sys.executable, "-c", HELP_OF_EACH, *PROGRAMS], env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=300)


def test_every_program_has_a_help_with_its_flags_and_an_example(every_programs_help):
  result = every_programs_help
  assert result.returncode == 0, result.stderr[-3000:]
  helps = json.loads(result.stdout.splitlines()[-2])
  for program, flag in PROGRAMS.items():
    code, text = helps[program]
    assert code == 0, (program, code, text[-500:])
    command = f"python {program}" if program.endswith(".py") else f"python -m {program}"
    assert re.search(rf"^ +{re.escape(command)} [-\w]", text, re.MULTILINE), (program, "no example", text)
    assert flag in text and "--logtostderr" not in text, (program, text)  # its own flags, not absl's
    if program in GIN_PROGRAMS:
      for listed in ("--gin_file=", "--gin.KEY=VALUE", "--gin_bindings=", "MODEL_DIR", "TRAIN_STEPS", "BATCH_SIZE"):
        assert listed in text, (program, listed)
  assert not START_UP_NOISE.search(result.stderr), result.stderr[-3000:]


def test_transformers_loads_triton_in_a_program_that_loaded_tensorflow(every_programs_help):
  """As `pretrain.export` does: a Triton loaded after TensorFlow would crash the process (SIGSEGV), but the
  programs have loaded it first (data_pipelines/__init__.py)."""
  assert every_programs_help.returncode == 0, every_programs_help.stderr[-3000:]
  assert json.loads(every_programs_help.stdout.splitlines()[-1]).startswith("3.")


def test_the_macros_the_help_names_are_set_in_gin_configs():
  text = "\n".join(path.read_text() for path in (ROOT / "gin_configs").rglob("*.gin"))
  defined = set(re.findall(r"^([A-Z][A-Z0-9_]*) *=", text, re.MULTILINE))
  named = set(re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b|\b[A-Z]{4,}\b", cli.GIN_MACROS))
  assert named and named <= defined, named - defined


def test_a_cpu_run_prints_no_start_up_noise(bert_on_eight_devices):
  """TensorFlow's CUDA probing and absl's early-logging warning stay off stderr (data_pipelines.startup)."""
  stderr = (bert_on_eight_devices.parent / STDERR_FILE).read_text()
  assert not [line for line in stderr.splitlines() if START_UP_NOISE.search(line)], stderr[-3000:]


def test_jaxs_cuda_plugin_counts_among_the_plugins_that_complain_on_a_machine_without_accelerators(monkeypatch):
  """With jax's CUDA plugin installed (the gpu-plan extra: on this worker's path) and no GPU, JAX left to choose its
  platform prints the plugin's traceback ("Unable to load cuPTI") before it falls back to the CPU; so, like libtpu,
  the plugin makes a program's start choose the CPU where the machine has no accelerator (data_pipelines.startup;
  whether it has one is read from its PCI devices)."""
  from data_pipelines import startup
  find_spec = importlib.util.find_spec

  def without(*hidden):
    return lambda name, *args: None if name in hidden else find_spec(name, *args)

  monkeypatch.setattr(importlib.util, "find_spec", without("libtpu"))
  assert startup._accelerator_plugin_installed()
  cuda_plugins = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
  monkeypatch.setattr(importlib.util, "find_spec", without("libtpu", *cuda_plugins))
  assert not startup._accelerator_plugin_installed()


def readme_gin_commands():
  """(gin files, bindings) of every command in README.md's code blocks that takes gin files; files that
  exist only on the reader's machine (an imported model's import.gin) are left out."""
  text = (ROOT / "README.md").read_text()
  commands = []
  for block in re.findall(r"^```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
    for line in block.replace("\\\n", " ").splitlines():
      if "--gin_file" in line:
        files, bindings, _ = cli.split_gin_args(shlex.split(line))
        commands.append(([f for f in files if (ROOT / f).exists()], bindings))
  return commands


def test_every_run_file_and_readme_command_reads_all_its_settings():
  """The check that refuses settings nothing reads takes every committed run file and README command."""
  runs = [([str(path.relative_to(ROOT))], []) for path in sorted((ROOT / "gin_configs" / "runs").glob("*.gin"))]
  commands = readme_gin_commands()
  assert len(runs) >= 15 and len(commands) >= 8
  for files, bindings in runs + commands:
    gin.clear_config()
    cli.parse_gin(files, bindings)
