"""Sentencepiece vocabularies: training one from text files, loading it for seqio, special tokens.

Every vocabulary this framework trains has the same fixed ids for the pieces objectives need, so
objectives take ids, not strings:  <pad>=0  </s>=1  <unk>=2  <s>=3  [CLS]=4  [SEP]=5  [MASK]=6.

  python -m data_pipelines.vocab --input='/data/*.txt' --vocab_size=32000 --output=/data/spm
"""
from data_pipelines import startup  # first, before TensorFlow and JAX load: they start quietly

import dataclasses
import functools
import glob
import io

import numpy as np
import sentencepiece as spm
import seqio
from absl import flags
from etils import epath
from google.protobuf import message

from data_pipelines import storage
from data_pipelines.background import Background
from data_pipelines.pieces import BOS_ID, EOS_ID, FIRST_NORMAL_ID, PAD_ID, UNK_ID  # noqa: F401 (the vocabulary's ids)
CLS_PIECE, SEP_PIECE, MASK_PIECE = "[CLS]", "[SEP]", "[MASK]"
USER_SYMBOLS = (CLS_PIECE, SEP_PIECE, MASK_PIECE)
WORD_START = "\u2581"  # sentencepiece's word-boundary marker


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  pad: int
  eos: int
  unk: int
  bos: int
  cls: int
  sep: int
  mask: int


def train_sentencepiece(input_files, vocab_size: int, output_prefix: str, model_type: str = "unigram",
                        max_sentences: int = 5_000_000) -> str:
  """Trains a sentencepiece model with this framework's special ids; returns the .model path."""
  files = [str(f) for f in input_files]
  if not files:
    raise ValueError("no input files to train a vocabulary on")
  path = epath.Path(output_prefix + ".model")
  path.parent.mkdir(parents=True, exist_ok=True)  # before training: an output that cannot be made fails first
  model = io.BytesIO()
  # in a thread: in the main thread, sentencepiece's native training would hold a Ctrl-C until it ends
  training = Background(lambda: spm.SentencePieceTrainer.train(
      input=files, model_writer=model, vocab_size=vocab_size, model_type=model_type,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=BOS_ID,
      user_defined_symbols=list(USER_SYMBOLS), character_coverage=1.0,
      input_sentence_size=max_sentences, shuffle_input_sentence=True, minloglevel=2), name="sentencepiece-training")
  training.result()
  path.write_bytes(model.getvalue())
  return str(path)


@functools.lru_cache(maxsize=None)
def load_vocabulary(model_path: str, extra_ids: int = 0) -> seqio.SentencePieceVocabulary:
  path = epath.Path(model_path)
  if not path.exists():
    raise FileNotFoundError(f"VOCAB_MODEL={model_path!r}: no such sentencepiece model")
  if path.is_dir():
    raise ValueError(f"VOCAB_MODEL={model_path!r} is a directory: expected the .model file of a sentencepiece model")
  vocabulary = seqio.SentencePieceVocabulary(storage.tf_readable(model_path), extra_ids=extra_ids)  # TF reads it
  try:
    special_ids(vocabulary)  # fail early on a model trained without our special pieces
  except (message.DecodeError, RuntimeError) as e:  # seqio reads the file on first use
    raise ValueError(f"VOCAB_MODEL={model_path!r} is not a sentencepiece model "
                     f"({str(e).strip().splitlines()[0]})") from e
  return vocabulary


def special_ids(vocabulary: seqio.SentencePieceVocabulary) -> SpecialIds:
  processor = vocabulary.tokenizer
  ids = {piece: processor.piece_to_id(piece) for piece in USER_SYMBOLS}
  problems = [f"no {piece} piece" for piece, i in ids.items() if i == processor.unk_id()]
  problems += [f"{name} id {actual}, not {expected}" for name, actual, expected in
               (("pad", processor.pad_id(), PAD_ID), ("eos", processor.eos_id(), EOS_ID)) if actual != expected]
  if problems:
    raise ValueError(f"VOCAB_MODEL={vocabulary.sentencepiece_model_file!r} was not trained with this framework's "
                     f"special pieces ({', '.join(problems)}): train one with `python -m data_pipelines.vocab`")
  return SpecialIds(pad=PAD_ID, eos=EOS_ID, unk=processor.unk_id(), bos=processor.bos_id(),
                    cls=ids[CLS_PIECE], sep=ids[SEP_PIECE], mask=ids[MASK_PIECE])


def word_start_table(vocabulary: seqio.SentencePieceVocabulary) -> np.ndarray:
  """bool[vocab_size]: True where a piece begins a word (whole-word and n-gram masking use it).

  Control and special pieces count as word starts so that a word never spans them.
  """
  processor = vocabulary.tokenizer
  table = np.ones(vocabulary.vocab_size, dtype=bool)
  for i in range(processor.get_piece_size()):
    piece = processor.id_to_piece(i)
    normal = not (processor.is_control(i) or processor.is_unknown(i) or piece in USER_SYMBOLS)
    table[i] = (not normal) or piece.startswith(WORD_START)
  return table


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags; defined only when it runs, as importing this module (tasks do) must define none."""
  flags.DEFINE_string("input", None, "Glob of plain-text files (one sentence per line).")
  flags.DEFINE_integer("vocab_size", 32000, "Number of pieces.")
  flags.DEFINE_string("output", None, "Output prefix; writes PREFIX.model.")
  flags.DEFINE_enum("model_type", "unigram", ["unigram", "bpe"], "Sentencepiece algorithm.")


def main():
  if not FLAGS.input or not FLAGS.output:
    raise ValueError("--input and --output are required")
  files = sorted(glob.glob(FLAGS.input))
  if not files:
    raise ValueError(f"--input={FLAGS.input!r} matches no files")
  print(f"training a {FLAGS.vocab_size}-piece {FLAGS.model_type} vocabulary on {len(files)} file(s)", flush=True)
  try:
    path = train_sentencepiece(files, FLAGS.vocab_size, FLAGS.output, FLAGS.model_type)
  except RuntimeError as e:  # sentencepiece reports bad settings (e.g. vocab too large) this way
    raise ValueError(f"sentencepiece training failed: {str(e).strip().splitlines()[-1]}") from None
  print(f"wrote {path} ({FLAGS.vocab_size} pieces from {len(files)} files)")


if __name__ == "__main__":
  define_flags()
  startup.run_program(main, "vocab", interrupted="no vocabulary was written")
