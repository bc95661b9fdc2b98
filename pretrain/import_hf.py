"""Import a HuggingFace model to continue pretraining it with this framework.

  python -m pretrain.import_hf --hf_dir=DIR --model_dir=OUT [--overwrite]
  python -m pretrain.import_hf --hf_dir=/tmp/bert_hf --model_dir=/tmp/bert_continued

DIR holds one of the registry's classes (BertForPreTraining, AlbertForPreTraining, XLNetLMHeadModel,
BartForConditionalGeneration): config.json, model.safetensors or pytorch_model.bin and, if the
tokenizer is sentencepiece-based, its model (tokenizer.model, spiece.model or sentencepiece.bpe.model).

OUT gets a weights-only checkpoint at step 0 (params and run_config; no optimizer state, carry or
data position, which depend on the run's optimizer and batch), OUT/vocab.model and OUT/import.gin with
the model's architecture. Training in OUT starts from these weights with a fresh optimizer at step 0:

  python -m pretrain.train --gin_file=<a run file of the family> --gin_file=OUT/import.gin \\
      --gin.MODEL_DIR="'OUT'" --gin.TRAIN_FILES="'/data/*.txt'"
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import dataclasses
import io
import json
import sys
from typing import Dict, Optional

import numpy as np
import sentencepiece as spm
from absl import flags, logging
from etils import epath

from data_pipelines import vocab as vocab_lib
from pretrain import checkpoints, cli, registry, run_files
from pretrain.errors import ConfigError, one_line
from pretrain.hf_mappings import common
from pretrain.output_dirs import check_output_dir, staged_directory

SPM_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
# Config fields a pretraining run chooses (gin macros of the run files), not properties of the weights.
RUN_CHOICES = ("dtype", "remat_policy", "scan_layers", "dropout_rate", "attention_dropout", "activation_dropout",
               "mem_len", "reuse_len", "bi_data", "clamp_len", "attention_implementation", "dropout_masks",
               "gelu_gradient")


def read_hf_weights(hf_dir: epath.Path) -> Dict[str, np.ndarray]:
  """The state dict as float32 numpy arrays, from model.safetensors or pytorch_model.bin."""
  import pickle

  import torch
  from safetensors import SafetensorError
  from safetensors.torch import load

  try:
    if (hf_dir / "model.safetensors").exists():
      state = load((hf_dir / "model.safetensors").read_bytes())
    elif (hf_dir / "pytorch_model.bin").exists():
      state = torch.load(io.BytesIO((hf_dir / "pytorch_model.bin").read_bytes()), map_location="cpu",
                         weights_only=True)
    else:
      raise FileNotFoundError(f"--hf_dir={hf_dir}: neither model.safetensors nor pytorch_model.bin")
  except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError) as e:  # cut short, damaged, not weights
    raise ConfigError(f"--hf_dir={hf_dir}: its weights cannot be read ({one_line(e)})") from e
  return {key: value.float().numpy() for key, value in state.items()}


def gin_bindings(config, vocab_model: Optional[str]) -> str:
  """import.gin: the model's architecture for any run file of its family, and its vocabulary."""
  package, name = type(config).__module__.rsplit(".", 1)  # e.g. models, bert
  lines = ["# Written by pretrain.import_hf: the imported model's architecture. Add after the family's run file.",
           "from __gin__ import dynamic_registration", f"from {package} import {name}", ""]
  lines += [f"{name}.{type(config).__name__}.{field.name} = {getattr(config, field.name)!r}"
            for field in dataclasses.fields(config) if field.name not in RUN_CHOICES]
  if vocab_model:
    lines.append(f"VOCAB_MODEL = {vocab_model!r}  # for your own TRAIN_FILES")
  return "\n".join(lines) + "\n"


def check_vocabulary(path: str, vocab_size: int, source: str) -> Optional[str]:
  """Fails if the vocabulary (a copy of `source`) is none or does not fit the embedding; returns why a run could not
  use it, if so."""
  try:
    pieces = spm.SentencePieceProcessor(model_file=path).get_piece_size()
  except RuntimeError as e:  # "could not parse ModelProto from PATH": cut short or damaged
    raise ConfigError(f"{source} is not a sentencepiece model ({one_line(e).replace(path, source)})") from e
  if pieces > vocab_size:
    raise ConfigError(f"the sentencepiece model has {pieces} pieces, more than the model's vocab_size={vocab_size}")
  try:
    vocab_lib.load_vocabulary(path)
  except ValueError as e:  # e.g. a HuggingFace ALBERT spiece.model: other special ids than ours
    return str(e)
  return None


def import_hf(hf_dir: str, model_dir: str, overwrite: bool = False) -> dict:
  """Writes the weights-only checkpoint; returns {family, model_dir, vocab_model, vocab_warning}."""
  out = check_output_dir(model_dir, overwrite)
  hf_path = epath.Path(hf_dir)
  if not (hf_path / "config.json").exists():
    raise FileNotFoundError(f"--hf_dir={hf_dir}: no config.json")
  try:
    hf_config = json.loads((hf_path / "config.json").read_text())
  except ValueError as e:  # not UTF-8, or not JSON
    raise ConfigError(f"--hf_dir={hf_dir}: config.json is not JSON ({e})") from e
  spec = registry.from_hf_config(hf_config)
  config = spec.mapping.config_from_hf(hf_config)
  params = common.from_hf(read_hf_weights(hf_path), spec.mapping.rules(config), spec.param_shapes(config))
  spm_path = next((hf_path / name for name in SPM_FILES if (hf_path / name).exists()), None)
  run_config = run_files.RunConfig(spec.family_cls(config=config), imported_from=str(hf_dir))
  vocab_model, vocab_warning = (str(run_files.vocab_path(out)) if spm_path else None), None
  with staged_directory(out) as staging:
    if spm_path:
      run_files.vocab_path(staging).write_bytes(spm_path.read_bytes())
      vocab_warning = check_vocabulary(str(run_files.vocab_path(staging)), config.vocab_size, str(spm_path))
    (epath.Path(staging) / "import.gin").write_text(gin_bindings(config, vocab_model))
    checkpoints.save_weights(staging, params, run_config.to_json())
  return {"family": spec.name, "model_dir": str(out), "vocab_model": vocab_model, "vocab_warning": vocab_warning}


def main(argv) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unknown arguments {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
  if not FLAGS.hf_dir or not FLAGS.model_dir:
    raise ConfigError("--hf_dir and --model_dir are required")
  summary = import_hf(FLAGS.hf_dir, FLAGS.model_dir, FLAGS.overwrite)
  out = summary["model_dir"]
  vocab = (f"vocabulary {summary['vocab_model']}" if summary["vocab_model"] else
           "no sentencepiece model found: give the run a VOCAB_MODEL of the same pieces")
  if summary["vocab_warning"]:
    print(f"warning: {summary['vocab_warning']}", file=sys.stderr)
  print(f"imported {summary['family']} into {out} (step 0, weights only; {vocab}). Continue pretraining with\n"
        f"  python -m pretrain.train --gin_file=<a {summary['family']} run file> --gin_file={out}/import.gin "
        f"--gin.MODEL_DIR=\"'{out}'\"")


if __name__ == "__main__":
  FLAGS = flags.FLAGS
  flags.DEFINE_string("hf_dir", None, "HuggingFace model directory (config.json + weights).")
  flags.DEFINE_string("model_dir", None, "New training directory (MODEL_DIR) to write.")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --model_dir.")
  startup.run_absl(lambda argv: cli.run("pretrain.import_hf", lambda: main(argv)))
