"""Export a checkpoint for fine-tuning: a HuggingFace model directory, or Flax params in memory.

  python -m pretrain.export --model_dir=DIR [--step=N] --output_dir=OUT [--dtype=float32|bfloat16] \\
      [--skip_check] [--overwrite]
  python -m pretrain.export --model_dir=/tmp/pod_pretrain/bert_tiny_demo --output_dir=/tmp/bert_hf

OUT gets config.json (the family's transformers class, e.g. BertForPreTraining), model.safetensors
and a tokenizer for `transformers.AutoTokenizer`: tokenizer.json + tokenizer_config.json, plus the
run's sentencepiece model as tokenizer.model. It is all written into a sibling directory that takes
OUT's place only after transformers has reloaded it and its logits matched ours on one batch.

The tokenizer splits any text exactly as the run's seqio vocabulary does, "[MASK]" or "[SEP]" typed
in the text included (`split_special_tokens`: special tokens come from the frame, never from text).
By default (`add_special_tokens=True`) it adds the family's pretraining frame, as transformers' own
tokenizers do: [CLS] A [SEP] (B [SEP]) for BERT/ALBERT, A [SEP] (B [SEP]) [CLS] for XLNet (padded on
the left), <s> A </s> for BART. `add_special_tokens=False` gives exactly the seqio ids.

`load_pretrained(model_dir)` returns (flax module, numpy params, seqio vocabulary) for JAX fine-tuning.
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import dataclasses
import os
import re
import shutil
import tempfile
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from etils import epath

from data_pipelines import vocab as vocab_lib
from pretrain import checkpoints, cli, registry, run_files
from pretrain.errors import ConfigError, user_settings
from pretrain.hf_mappings import common
from pretrain.output_dirs import check_output_dir, staged_directory

TOLERANCE = 1e-3  # largest |logit difference| allowed between our model and the exported one
DTYPES = ("float32", "bfloat16")
SPM_FILE = "tokenizer.model"
NEVER_MATCHED = -1e9  # score that keeps control pieces (<pad>, </s>, ...) from matching text, as in sentencepiece


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A validated checkpoint: its step, family, model config and vocabulary."""
  model_dir: str
  step: int
  spec: registry.FamilySpec
  config: object
  vocab_path: str


def open_checkpoint(model_dir: str, step: Optional[int] = None) -> Checkpoint:
  step, run_config = run_files.read_run_config(model_dir, step)
  spec, config = registry.get(run_config.family.name), run_config.family.config
  vocab_path = str(run_files.vocab_path(model_dir))
  with user_settings():  # a vocabulary that is none (damaged, cut short) is the run directory's fault
    vocab_size = vocab_lib.load_vocabulary(vocab_path).vocab_size
  if vocab_size > config.vocab_size:
    raise ConfigError(f"vocabulary {vocab_path} has {vocab_size} pieces, more than the model's "
                      f"vocab_size={config.vocab_size}")
  return Checkpoint(str(model_dir), step, spec, config, vocab_path)


def restore_params(ckpt: Checkpoint) -> dict:
  params = checkpoints.restore_params(ckpt.model_dir, ckpt.step)
  actual = {path: value.shape for path, value in common.flatten_params(params).items()}
  expected = ckpt.spec.param_shapes(ckpt.config)
  if actual != expected:
    differing = sorted(set(actual.items()) ^ set(expected.items()))[:4]
    raise ConfigError(f"params of step {ckpt.step} do not fit the run_config model_config: {differing}")
  return params


def load_pretrained(model_dir: str, step: Optional[int] = None):
  """(flax module, params as numpy host arrays, seqio vocabulary) of a checkpoint; the latest if no step.

  `module.apply({"params": params}, features)` runs it (features as the family's feature converter
  makes them, e.g. input_ids and segment_ids for BERT); no mesh, trainer or gin needed. The module
  has the family's fine-tuning settings, as exports do (XLNet: bi_data off).
  """
  ckpt = open_checkpoint(model_dir, step)
  model = ckpt.spec.family_cls(config=ckpt.spec.finetune_config(ckpt.config)).make_model()
  return model, restore_params(ckpt), vocab_lib.load_vocabulary(ckpt.vocab_path)


def hf_tokenizer(spm_model: bytes, layout: registry.TokenizerLayout, model_max_length: Optional[int]):
  """A transformers fast tokenizer that reproduces sentencepiece's segmentation of any text."""
  import transformers
  from sentencepiece import sentencepiece_model_pb2
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

  proto = sentencepiece_model_pb2.ModelProto.FromString(spm_model)
  piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece
  if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
    pieces = [(p.piece, p.score if p.type in (piece_type.NORMAL, piece_type.USER_DEFINED) else NEVER_MATCHED)
              for p in proto.pieces]
    model = models.Unigram(pieces, unk_id=proto.trainer_spec.unk_id, byte_fallback=proto.trainer_spec.byte_fallback)
  else:  # BPE: merges ordered by piece score; whole pre-tokens found in the vocabulary are kept, as sentencepiece does
    from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor
    with tempfile.NamedTemporaryFile(suffix=".model") as f:
      f.write(spm_model)
      f.flush()
      ids, _, merges = SentencePieceExtractor(f.name).extract()
    model = models.BPE(ids, merges, unk_token=proto.trainer_spec.unk_piece, fuse_unk=True, ignore_merges=True,
                       byte_fallback=proto.trainer_spec.byte_fallback)
  tokenizer = Tokenizer(model)
  # sentencepiece: its normalization table, whitespace trimmed and collapsed, then "▁" before every word.
  charsmap = proto.normalizer_spec.precompiled_charsmap
  tokenizer.normalizer = normalizers.Sequence(([normalizers.Precompiled(charsmap)] if charsmap else [])
                                              + [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")])
  splits = [pre_tokenizers.Metaspace("▁", prepend_scheme="always", split=True)]
  user_symbols = [p.piece for p in proto.pieces if p.type == piece_type.USER_DEFINED]  # [CLS] [SEP] [MASK]
  if user_symbols:  # sentencepiece matches them anywhere, even inside a word
    splits.append(pre_tokenizers.Split(Regex("|".join(map(re.escape, user_symbols))), behavior="isolated"))
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
  tokenizer.decoder = decoders.Metaspace("▁", prepend_scheme="always")
  piece_ids = {p.piece: i for i, p in enumerate(proto.pieces)}
  framing = {token.split(":")[0] for token in f"{layout.single} {layout.pair}".split() if not token.startswith("$")}
  tokenizer.post_processor = processors.TemplateProcessing(
      single=layout.single, pair=layout.pair, special_tokens=[(t, piece_ids[t]) for t in sorted(framing)])
  return transformers.TokenizersBackend(
      tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
      cls_token=vocab_lib.CLS_PIECE, sep_token=vocab_lib.SEP_PIECE, mask_token=vocab_lib.MASK_PIECE,
      split_special_tokens=True, padding_side=layout.padding_side, model_input_names=list(layout.input_names),
      model_max_length=model_max_length)


def write_hf(ckpt: Checkpoint, config, params, directory: str, dtype: str) -> None:
  import torch
  import transformers
  from safetensors.torch import save_file

  kwargs = dict(ckpt.spec.mapping.hf_config(config))
  hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
  hf_config.dtype = getattr(torch, dtype)
  hf_config.save_pretrained(directory)
  state = common.to_hf(params, ckpt.spec.mapping.rules(config))
  weights = os.path.join(directory, "model.safetensors")
  save_file({key: torch.from_numpy(value).to(getattr(torch, dtype)).contiguous() for key, value in state.items()},
            weights, metadata={"format": "pt"})
  shutil.copymode(os.path.join(directory, "config.json"), weights)  # safetensors makes it 0600, readable by no one else
  spm_model = epath.Path(ckpt.vocab_path).read_bytes()
  hf_tokenizer(spm_model, ckpt.spec.layout, getattr(config, "max_position_embeddings", None)
               ).save_pretrained(directory)
  with open(os.path.join(directory, SPM_FILE), "wb") as f:
    f.write(spm_model)


def compare_with_hf(spec: registry.FamilySpec, config, params, directory: str, dtype: str) -> Dict[str, float]:
  """Largest |logit difference| per output between our model and the saved HF model, in fp32.

  A bfloat16 export is compared with our model run on the same bf16-rounded weights, so the
  comparison checks the conversion, not the rounding, and keeps the fp32 tolerance.
  """
  import torch
  import transformers

  if dtype != "float32":
    params = jax.tree.map(lambda p: np.asarray(p).astype(jnp.dtype(dtype)).astype(np.float32), params)
  batch = spec.check_batch(config)
  model = spec.family_cls(config=dataclasses.replace(config, dtype=jnp.float32)).make_model()
  ours = model.apply({"params": params}, batch.features)
  hf_model, info = getattr(transformers, spec.hf_class).from_pretrained(directory, output_loading_info=True)
  if info["missing_keys"] or info["unexpected_keys"]:
    raise ValueError(f"transformers reloaded {directory} with missing weights {sorted(info['missing_keys'])[:4]} "
                     f"and unexpected weights {sorted(info['unexpected_keys'])[:4]}")
  as_torch = lambda x: torch.from_numpy(x).long() if x.dtype.kind == "i" else torch.from_numpy(x)
  with torch.no_grad():
    theirs = hf_model.eval().float()(**{k: as_torch(v) for k, v in batch.hf_inputs.items()})
  return {key: float(np.abs(np.asarray(ours[key]) - getattr(theirs, hf_key).numpy())[mask].max())
          for key, hf_key, mask in batch.outputs}


def export(model_dir: str, output_dir: str, step: Optional[int] = None, dtype: str = "float32",
           check: bool = True, overwrite: bool = False) -> dict:
  """Writes the HuggingFace directory; returns {step, family, output_dir, max_logit_diff (None unchecked)}."""
  if dtype not in DTYPES:
    raise ConfigError(f"--dtype={dtype!r}: expected one of {DTYPES}")
  ckpt = open_checkpoint(model_dir, step)
  out = check_output_dir(output_dir, overwrite)
  params = restore_params(ckpt)
  config = ckpt.spec.finetune_config(ckpt.config)
  diffs = None
  with staged_directory(out) as staging:
    # HuggingFace keeps weights per layer: a scanned stack's are unstacked. The check below runs the
    # model as it was trained (scanned or not) against the export.
    write_hf(ckpt, dataclasses.replace(config, scan_layers=False), run_files.in_layout(params, scan_layers=False),
             staging, dtype)
    if check:
      diffs = compare_with_hf(ckpt.spec, config, params, staging, dtype)
      worst = max(diffs, key=diffs.get)
      if diffs[worst] > TOLERANCE:
        raise ConfigError(f"exported {ckpt.spec.hf_class} disagrees with the checkpoint: max |{worst} difference| "
                          f"= {diffs[worst]:.2e} > {TOLERANCE}")
  return {"step": ckpt.step, "family": ckpt.spec.name, "output_dir": str(out), "max_logit_diff": diffs}


def main(argv) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unknown arguments {argv[1:]}")
  from transformers.utils import logging as transformers_logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
  transformers_logging.disable_progress_bar()
  if not FLAGS.model_dir or not FLAGS.output_dir:
    raise ConfigError("--model_dir and --output_dir are required")
  summary = export(FLAGS.model_dir, FLAGS.output_dir, FLAGS.step, FLAGS.dtype, not FLAGS.skip_check, FLAGS.overwrite)
  diffs = summary["max_logit_diff"]
  checked = ("not checked (--skip_check)" if diffs is None else
             "max |logit difference| vs ours " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
             + (" (both on the bf16-rounded weights)" if FLAGS.dtype != "float32" else ""))
  print(f"exported {summary['family']} step {summary['step']} to {summary['output_dir']} ({FLAGS.dtype}); {checked}")


if __name__ == "__main__":
  FLAGS = flags.FLAGS
  flags.DEFINE_string("model_dir", None, "Training directory (MODEL_DIR) holding checkpoints/ and vocab.model.")
  flags.DEFINE_integer("step", None, "Checkpoint step; the latest if unset.")
  flags.DEFINE_string("output_dir", None, "HuggingFace directory to write (local or gs://).")
  flags.DEFINE_enum("dtype", "float32", DTYPES, "Weight dtype in model.safetensors.")
  flags.DEFINE_bool("skip_check", False, "Do not reload the export and compare its logits with ours.")
  flags.DEFINE_bool("overwrite", False, "Replace a non-empty --output_dir.")
  startup.run_absl(lambda argv: cli.run("pretrain.export", lambda: main(argv)))
