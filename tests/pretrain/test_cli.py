"""What a user gets wrong ends pretrain.train with one line naming it and exit code 1; a bug keeps its
traceback. The cases fail before any training, so they run in this process through the program's
own main and error handling."""
import gin
import pytest

from helpers import run_train
from pretrain import cli, train, trainer

BERT_RUN = "--gin_file=gin_configs/runs/bert_tiny_demo.gin"
XLNET_RUN = "--gin_file=gin_configs/runs/xlnet_tiny_demo.gin"


@pytest.mark.parametrize("args, message", [
    ([BERT_RUN, "--gin.NO_SUCH_MACRO_OR_CONFIG.x=1"], "No configurable matching 'NO_SUCH_MACRO_OR_CONFIG'"),
    ([BERT_RUN, "--gin.BATCH_SIZE=%NOT_SET_ANYWHERE"], "macro NOT_SET_ANYWHERE is not set"),
    ([BERT_RUN, "--gin.MIXTURE_OR_TASK_NAME='no_such_task'"], "unknown task or mixture 'no_such_task'"),
    ([BERT_RUN, "--gin.TRAIN_FILES='/nonexistent/*.txt'"], "TRAIN_FILES='/nonexistent/*.txt' matches no files"),
    ([BERT_RUN, "--gin.TASK_FEATURE_LENGTHS={'input_ids': 64}"],
     "the bert_mlm_nsp objective takes the lengths ['input_ids', 'masked_positions']"),
    ([XLNET_RUN, "--gin_file=gin_configs/models/bert_tiny.gin"],
     "the bert family trains on bert_mlm_nsp examples, the task gives xlnet_plm examples"),
    ([BERT_RUN, "--gin.MESH_SHAPE={'data': 3}"], "MESH_SHAPE={'data': 3} needs 3 devices, have 1"),
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
    ([XLNET_RUN, "--gin.DATA_SHARDS=2"], "DATA_SHARDS=2: xlnet reads one data shard per batch row (BATCH_SIZE=16)"),
    ([XLNET_RUN, "--gin.xlnet.XLNetConfig.reuse_len=32"],
     "xlnet.XLNetConfig.reuse_len=32 differs from the data's TASK_FEATURE_LENGTHS reuse_len=64"),
    ([BERT_RUN, "--no_such_flag"], "unknown arguments ['--no_such_flag']"),
    ([BERT_RUN, "--gin.TRAIN_STEPS=0"], "TRAIN_STEPS=0: expected a positive number of steps"),
    ([BERT_RUN, "--gin.PROFILE_STEPS=(5, 2)"], "PROFILE_STEPS=(5, 2): expected (first, last) with 1 <= first <= last"),
    (["--gin_file=gin_configs/runs/no_such_run.gin"], "--gin_file=gin_configs/runs/no_such_run.gin: no such file"),
])
def test_bad_configuration_fails_with_one_line(args, message, capsys, tmp_path):
  code, last = run_train(capsys, tmp_path, *args)
  assert code == 1
  assert last.startswith("pretrain.train: error:") and message in last, last


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
