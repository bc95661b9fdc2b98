"""Text and TFDS sources on bad and unusual input, mixtures of them, and the vocabulary trainer's command line."""
import re
import shutil

import numpy as np
import pytest
import sentencepiece as spm

from helpers import assert_rate, flip_a_bit, restored, run_here, run_train, train
from data_pipelines import input_pipeline, sources, tasks, vocab

LENGTHS = {"input_ids": 128, "masked_positions": 20}  # articles below are shorter: label-0 pairs stay whole
CLS, SEP = 4, 5
TINY_RUN = ["bert.BertConfig.hidden_size = 32", "bert.BertConfig.mlp_dim = 64", "BATCH_SIZE = 4",
            "LOG_EVERY_STEPS = 1", "EVAL_EVERY_STEPS = 0"]


def documents(pattern, setting="TRAIN_FILES"):
  source = sources.TextDocumentSource({"train": pattern}, setting=setting)
  return [d["text"].decode("utf-8") for d in source.get_dataset("train", shuffle=False).as_numpy_iterator()]


def examples(task_name):
  dataset = tasks.get_task_or_mixture(task_name).get_dataset(LENGTHS, split="train", shuffle=False, num_epochs=1,
                                                             seed=0)
  return list(dataset.as_numpy_iterator())


def test_empty_file_is_skipped_and_reported(tmp_path, capsys):
  (tmp_path / "a.txt").write_text("First one.\nFirst two.\n\nSecond.\n")
  (tmp_path / "b_empty.txt").write_bytes(b"")
  (tmp_path / "c.txt").write_text("Third.\n")
  assert documents(str(tmp_path / "*.txt")) == ["First one.\nFirst two.", "Second.", "Third."]
  assert re.search(r"skipping 1 empty file.*b_empty\.txt", capsys.readouterr().out)


def test_only_empty_files_is_an_error_naming_the_pattern(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"")
  pattern = str(tmp_path / "*.txt")
  with pytest.raises(ValueError, match=re.escape(f"TRAIN_FILES={pattern!r}: every matching file is empty")):
    documents(pattern)


def test_glob_matching_nothing_names_the_setting_and_pattern(tmp_path, demo_paths):
  pattern = str(tmp_path / "missing-*.txt")
  with pytest.raises(FileNotFoundError, match=re.escape(f"VALIDATION_FILES={pattern!r} matches no files")):
    documents(pattern, setting="VALIDATION_FILES")
  name = tasks.text_task("bert_mlm_nsp", train_files=pattern, vocab_model=demo_paths["vocab_model"])
  with pytest.raises(FileNotFoundError, match=re.escape(f"TRAIN_FILES={pattern!r} matches no files")):
    examples(name)


def test_blank_and_whitespace_only_lines_separate_documents(tmp_path):
  (tmp_path /
   "a.txt").write_bytes(b"One a.\nOne b.\n\nTwo.\n   \t\nThree.\r\n\r\nFour.\n\n\n\n  Five a.\n Five b. \n \n")
  docs = documents(str(tmp_path / "a.txt"))
  assert [[line.strip() for line in d.split("\n")] for d in docs] == [
      ["One a.", "One b."], ["Two."], ["Three."], ["Four."], ["Five a.", "Five b."]]


def test_non_utf8_bytes_become_replacement_characters(tmp_path, demo_paths):
  (tmp_path / "a.txt").write_bytes(b"Caf\xe9 au lait \xff\xfe is hot.\nIt is served warm.\n")
  assert documents(str(tmp_path / "a.txt")) == ["Caf\ufffd au lait \ufffd\ufffd is hot.\nIt is served warm."]
  name = tasks.text_task("bert_mlm_nsp", train_files=str(tmp_path / "a.txt"), vocab_model=demo_paths["vocab_model"])
  assert len(examples(name)) == 1


@pytest.mark.parametrize("objective", ["bert_mlm_nsp", "albert_mlm_sop"])
def test_one_sentence_documents_take_segment_b_from_another_document(objective, tmp_path, demo_paths, demo_vocab):
  """As google-research/bert and ALBERT do: a one-sentence document pairs with another document's text,
  labelled 1 (random next, or out of order). One document alone has no other: no pair, and a one-line error."""
  (tmp_path / "a.txt").write_text("\n\n".join(f"Lonely sentence number {i}." for i in range(20)))
  name = tasks.register_task(f"test_single_{objective}", sources.TextDocumentSource({"train": str(tmp_path / "a.txt")}),
                             objective, demo_paths["vocab_model"])
  found = examples(name)
  assert len(found) >= 15, len(found)  # NSP's shuffled copy may hand a document itself back: skipped
  label = "nsp_label" if objective == "bert_mlm_nsp" else "sop_label"
  for example in found:
    numbers = re.findall(r"number (\d+)", demo_vocab.tokenizer.decode_ids(restored(example).tolist()))
    assert example[label] == 1 and len(numbers) == 2 and numbers[0] != numbers[1], numbers
  (tmp_path / "a.txt").write_text("One line and no line break")
  lone = tasks.register_task(f"test_lone_{objective}", sources.TextDocumentSource({"train": str(tmp_path / "a.txt")}),
                             objective, demo_paths["vocab_model"])
  with pytest.raises(ValueError, match=re.escape(
      f"{objective} makes no example from the train text of {lone} ('{tmp_path}/a.txt', 1 file(s)): its 1 "
      "document(s), 1 different, hold at most 1 sentence(s) and 10 token(s); ")):
    input_pipeline.task_examples(tasks.get_task_or_mixture(lone), LENGTHS, "train")


def test_vocab_cli_trains_a_model_with_the_documented_special_ids(tmp_path, demo_paths):
  (tmp_path / "text").mkdir()
  (tmp_path / "text" / "corpus.txt").write_text(open(demo_paths["validation"], encoding="utf-8").read())
  result = run_here("data_pipelines.vocab", f"--input={tmp_path}/text/*.txt", "--vocab_size=300",
                    f"--output={tmp_path}/out/spm")
  assert result.returncode == 0, result.stderr[-2000:]
  model = str(tmp_path / "out" / "spm.model")
  processor = spm.SentencePieceProcessor(model_file=model)
  assert processor.get_piece_size() == 300
  # The ids vocab.py's docstring documents: <pad>=0 </s>=1 <unk>=2 <s>=3 [CLS]=4 [SEP]=5 [MASK]=6.
  assert [processor.id_to_piece(i) for i in range(7)] == ["<pad>", "</s>", "<unk>", "<s>", "[CLS]", "[SEP]", "[MASK]"]
  assert vocab.special_ids(vocab.load_vocabulary(model)) == vocab.SpecialIds(
      pad=0, eos=1, unk=2, bos=3, cls=4, sep=5, mask=6)
  assert 6 in processor.encode_as_ids("a [MASK] here")  # user-defined pieces are matched in text


def test_vocab_cli_glob_matching_nothing_is_a_one_line_error(tmp_path):
  pattern = f"{tmp_path}/nothing-*.txt"
  result = run_here("data_pipelines.vocab", f"--input={pattern}", "--vocab_size=300", f"--output={tmp_path}/spm")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == f"vocab: error: --input={pattern!r} matches no files"
  assert "Traceback" not in result.stderr


ARTICLES = 40


@pytest.fixture(scope="module")
def tiny_wiki_dir(tmp_path_factory):
  """A TFDS dataset `tiny_wiki:1.0.0` prepared on disk from generated wikipedia-like articles."""
  import tensorflow_datasets as tfds  # slow to import: only for this test

  class TinyWiki(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"title": tfds.features.Text(), "text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      del dl_manager  # nothing to download
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i in range(ARTICLES):
        yield i, {"title": f"Topic {i}", "text": article(i)}

  data_dir = tmp_path_factory.mktemp("tfds")
  TinyWiki(data_dir=str(data_dir)).download_and_prepare()
  return str(data_dir)


def article(i):
  """Wikipedia style: a paragraph per line, several sentences per paragraph."""
  return (f"Topic {i} is a town in the north. It was founded in {1800 + i}. The town has {i + 3} bridges.\n\n"
          f"Its economy relies on fishing. Tourists visit topic {i} every summer!")


def test_tfds_dataset_on_disk_yields_valid_examples(tiny_wiki_dir, demo_paths, demo_vocab):
  name = tasks.tfds_task("bert_mlm_nsp", "tiny_wiki:1.0.0", demo_paths["vocab_model"], data_dir=tiny_wiki_dir)
  processor = demo_vocab.tokenizer
  # Decoding normalises text slightly (spacing): compare with each sentence encoded and decoded.
  texts = [" ".join(processor.decode_ids(processor.encode_as_ids(s)) for s in re.split(r"(?<=[.!])\s+", article(i)))
           for i in range(ARTICLES)]
  found = examples(name)
  assert len(found) >= ARTICLES  # every article has 5 sentences: at least one pair each
  for example in found:
    ids = restored(example)
    seps = np.flatnonzero(ids == SEP)
    assert ids[0] == CLS and len(seps) == 2 and np.all(ids[seps[1] + 1:] == 0)
    np.testing.assert_array_equal(example["segment_ids"][:seps[1] + 1], np.arange(seps[1] + 1) > seps[0])
    a, b = processor.decode_ids(ids[1:seps[0]].tolist()), processor.decode_ids(ids[seps[0] + 1:seps[1]].tolist())
    assert any(a in t for t in texts) and any(b in t for t in texts), (a, b)
    if example["nsp_label"] == 0:
      assert any(f"{a} {b}" in t for t in texts), (a, b)


def test_a_run_trains_from_tfds_through_the_gin_switch(tiny_wiki_dir, demo_paths, tmp_path):
  summary = train("bert_tiny_demo", tmp_path, 2, [
      *TINY_RUN, "TFDS_NAME = 'tiny_wiki:1.0.0'", f"TFDS_DATA_DIR = '{tiny_wiki_dir}'",
      f"VOCAB_MODEL = '{demo_paths['vocab_model']}'"], gin_files=["gin_configs/data/tfds.gin"])
  assert np.isfinite(summary["last_loss"])
  assert (tmp_path / "checkpoints" / "2").exists()



def test_a_corrupted_tfds_record_stops_the_run_naming_its_file(tiny_wiki_dir, demo_paths, tmp_path, capsys):
  """tf.data says only 'corrupted record at OFFSET'; the line names the file too (a real bit flipped in a record's
  data on disk, in a copy of the prepared dataset)."""
  data_dir = tmp_path / "tfds"
  shutil.copytree(tiny_wiki_dir, data_dir)
  record_file, = data_dir.glob("tiny_wiki/1.0.0/*.tfrecord*")
  flip_a_bit(record_file)
  code, last = run_train(capsys, tmp_path / "run", "--gin_file=gin_configs/runs/bert_tiny_demo.gin",
                         "--gin_file=gin_configs/data/tfds.gin",
                         *[f"--gin_bindings={b}" for b in TINY_RUN], "--gin.TFDS_NAME='tiny_wiki:1.0.0'",
                         f"--gin.TFDS_DATA_DIR='{data_dir}'", f"--gin.VOCAB_MODEL='{demo_paths['vocab_model']}'",
                         "--gin.TRAIN_STEPS=2")
  named = (rf"{re.escape(str(record_file))} is damaged: the record whose data starts at byte \d+ fails its checksum; "
           "restore the file, or prepare the dataset again")
  assert code == 1
  assert re.fullmatch(rf"pretrain\.train: error: the train input failed to make the batch of step 1 \(DamagedFile: "
                      rf"{named}\); no checkpoint yet in .*", last), last



def test_only_the_file_whose_record_fails_its_checksum_is_named(tmp_path):
  """Among TFRecord files written by TensorFlow alike, at the offset tf.data gives for a bit flipped in a record's
  data."""
  import tensorflow as tf

  from data_pipelines import record_files
  paths = [str(tmp_path / f"records-{index}.tfrecord") for index in range(3)]
  for index, path in enumerate(paths):
    with tf.io.TFRecordWriter(path) as writer:
      for record in range(60):
        writer.write(b"x" * (100 + record * (index + 1) % 37 * 10))
  flip_a_bit(tmp_path / "records-1.tfrecord")
  with pytest.raises(tf.errors.DataLossError) as failed:
    for _ in tf.data.TFRecordDataset(paths[1]):
      pass
  offset = int(re.search(r"corrupted record at (\d+)", str(failed.value)).group(1))
  assert record_files.corrupted_record_file(paths, offset) == paths[1]
  assert record_files.corrupted_record_file([paths[0], paths[2]], offset) is None


def test_a_text_file_that_failed_to_read_is_mended_once_it_reads_whole_again(tmp_path):
  """The file a tf.data read error names, among the text files read; gone, it is not mended; back, it is."""
  import tensorflow as tf
  files = [tmp_path / f"part-{index}.txt" for index in range(3)]
  for file in files:
    file.write_text("One sentence.\n")
  paths = [str(file) for file in files]
  files[1].rename(tmp_path / "away.txt")
  with pytest.raises(tf.errors.NotFoundError) as failed:
    for _ in tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file):
      pass
  iterators = input_pipeline.ShardIterators({}, 1, text_paths=lambda: paths)
  assert iterators.mended_file(failed.value) is None
  (tmp_path / "away.txt").rename(paths[1])
  assert iterators.mended_file(failed.value) == paths[1]
  assert input_pipeline.ShardIterators({}, 1, text_paths=lambda: [paths[0], paths[2]]).mended_file(failed.value) is None


ARTICLE_WORDS = ("town", "founded", "economy", "Tourists")  # every sentence of article() has one
CHAPTER_WORDS = ("Chapter", "sailors", "Storms", "ship")  # every sentence of chapter() has one


def chapter(i):
  """A book-like document: a sentence per line, none of the articles' words."""
  return (f"Chapter {i} opens at sea.\nThe sailors sing all night.\nStorms come from the west.\n"
          f"The ship reaches port {i}.")


@pytest.fixture(scope="module")
def books_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("books") / "books.txt"
  path.write_text("\n\n".join(chapter(i) for i in range(ARTICLES)) + "\n")
  return str(path)


def wiki_and_books(tiny_wiki_dir, books_file, vocab_model, rates):
  wiki = tasks.tfds_task("bert_mlm_nsp", "tiny_wiki:1.0.0", vocab_model, data_dir=tiny_wiki_dir)
  books = tasks.text_task("bert_mlm_nsp", train_files=books_file, vocab_model=vocab_model, corpus="books")
  return tasks.mixture("wiki_books_bert_mlm_nsp", [wiki, books], rates)


def test_a_mixture_draws_whole_examples_from_its_tasks_at_their_rates(tiny_wiki_dir, books_file, demo_paths,
                                                                      demo_vocab):
  from data_pipelines.input_pipeline import InputPipeline
  from models.bert import BertConfig
  from pretrain.families.bert import BertFamily
  name = wiki_and_books(tiny_wiki_dir, books_file, demo_paths["vocab_model"], rates=[3, 1])
  shapes = BertFamily(BertConfig()).feature_shapes(1, LENGTHS)
  batch_size, batches, shards = 20, 100, 2
  pipeline = InputPipeline(name, LENGTHS, batch_size, {k: (s.shape[1:], s.dtype) for k, s in shapes.items()},
                           num_data_shards=shards, process_index=0, process_count=1)
  from_wiki = []
  for batch in pipeline.take("train", batches):
    assert set(batch) == set(shapes)  # the objective's targets and labels come through the mixture
    for row in range(batch_size):
      ids = restored({name: values[row] for name, values in batch.items()})
      text = demo_vocab.tokenizer.decode_ids(ids.tolist())
      wiki, books = (any(word in text for word in words) for words in (ARTICLE_WORDS, CHAPTER_WORDS))
      assert wiki != books, text  # a pair never joins two corpora
      from_wiki.append(wiki)
  from_wiki = np.array(from_wiki).reshape(batches, shards, batch_size // shards)
  assert_rate(from_wiki.sum(), from_wiki.size, 3 / 4, "rows from wikipedia")
  # Each shard draws its own sequence of tasks: the rows of a batch do not all switch corpus together.
  assert not np.array_equal(from_wiki[:, 0], from_wiki[:, 1])


def test_a_mixtures_data_position_continues_exactly_on_another_number_of_processes(tiny_wiki_dir, books_file,
                                                                                   demo_paths, tmp_path):
  """Each data shard's position is saved on its own (as pretrain.checkpoints saves it), so one process
  continues the batches that two processes were reading, the two halves side by side, and two continue
  what one was reading."""
  import tensorflow as tf

  from data_pipelines.input_pipeline import InputPipeline
  name = wiki_and_books(tiny_wiki_dir, books_file, demo_paths["vocab_model"], rates=[3, 1])

  def pipeline(process_index, process_count, data_shards=2):
    return InputPipeline(name, LENGTHS, 8, {"input_ids": ((LENGTHS["input_ids"],), tf.int32)},
                         num_data_shards=data_shards, process_index=process_index, process_count=process_count)

  # Each pipeline builds its tasks' tf.data graphs (about a second per task and data shard): the test reuses them.
  halves = [pipeline(index, 2).iterator() for index in (0, 1)]
  for iterator in halves:
    for _ in range(3):
      next(iterator)
    iterator.save(tmp_path)
  expected = [np.concatenate([next(half)["input_ids"] for half in halves]) for _ in range(3)]
  resumed = pipeline(0, 1).iterator()
  assert resumed.restore(tmp_path) is None
  for batch in expected:
    np.testing.assert_array_equal(next(resumed)["input_ids"], batch)
  assert "no position of data shard 0 of 4" in pipeline(0, 4, data_shards=4).iterator().restore(tmp_path)

  resumed.save(tmp_path / "one")  # after the 6th batch: two processes take over (the halves, moved back)
  expected = [next(resumed)["input_ids"] for _ in range(2)]
  for half in halves:
    next(half)  # past the saved position, so that only restoring can give the expected batches
  assert [half.restore(tmp_path / "one") for half in halves] == [None, None]
  for batch in expected:
    np.testing.assert_array_equal(np.concatenate([next(half)["input_ids"] for half in halves]), batch)


def test_a_mixture_needs_one_positive_rate_per_task(demo_paths):
  with pytest.raises(ValueError, match=r"mixture 'm': expected one positive rate per task"):
    tasks.mixture("m", ["demo_bert_mlm_nsp", "demo_albert_mlm_sop"], rates=[1])
  with pytest.raises(ValueError, match=r"unknown task or mixture 'no_such_task'"):
    tasks.mixture("m", ["demo_bert_mlm_nsp", "no_such_task"])


def test_xlnet_streams_cannot_be_mixed_by_example(demo_paths):
  from data_pipelines.input_pipeline import InputPipeline
  name = tasks.mixture("xlnet_mixture", ["demo_xlnet_plm"])
  with pytest.raises(ValueError, match="mixture 'xlnet_mixture' mixes tasks whose examples continue one text stream"):
    InputPipeline(name, {}, global_batch_size=2, model_features={}, process_index=0, process_count=1)


def test_a_run_trains_from_wikipedia_and_books_through_the_gin_file(tiny_wiki_dir, books_file, demo_paths, tmp_path):
  summary = train("bert_tiny_demo", tmp_path, 2, [
      *TINY_RUN, "TFDS_NAME = 'tiny_wiki:1.0.0'", f"TFDS_DATA_DIR = '{tiny_wiki_dir}'", f"BOOKS_FILES = '{books_file}'",
      f"VOCAB_MODEL = '{demo_paths['vocab_model']}'"], gin_files=["gin_configs/data/wikipedia_books.gin"])
  assert np.isfinite(summary["last_loss"])
  assert (tmp_path / "checkpoints" / "2").exists()


def test_a_vocabulary_without_train_files_is_an_error_not_the_demo_text(demo_paths):
  with pytest.raises(ValueError, match="VOCAB_MODEL='.*' is set but the 'books' corpus has no train files"):
    tasks.text_task("bert_mlm_nsp", vocab_model=demo_paths["vocab_model"], corpus="books")


def test_split_text_writes_whole_documents_in_order_in_even_parts(tmp_path, demo_paths):
  rng = np.random.default_rng(0)
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for f in range(3):
    docs = ["\n".join(f"File {f} document {d} sentence {s}." for s in range(rng.integers(1, 8)))
            for d in range(100)]
    (corpus / f"{f}.txt").write_bytes("\n\n  \n".join(docs).encode() + b" \xff bytes.\n")
  result = run_here("data_pipelines.split_text", f"--input={corpus}/*.txt", f"--output_dir={tmp_path}/parts",
                    "--num_files=16")
  assert result.returncode == 0, result.stderr[-2000:]
  parts = sorted((tmp_path / "parts").iterdir())
  assert [p.name for p in parts] == [f"part-{i:05d}-of-00016.txt" for i in range(16)]
  assert documents(str(tmp_path / "parts" / "*.txt")) == documents(str(corpus / "*.txt"))
  sizes = np.array([p.stat().st_size for p in parts])
  largest_document = max(len(d) for d in documents(str(corpus / "*.txt")))
  assert sizes.max() - sizes.min() <= 2 * largest_document
  again = run_here("data_pipelines.split_text", f"--input={corpus}/*.txt", f"--output_dir={tmp_path}/parts",
                   "--num_files=8")
  assert again.returncode != 0 and again.stderr.strip().splitlines()[-1].endswith("is not empty: parts of another "
                                                                                  "split would mix with these")
  # Fewer documents than files: the parts' names count the parts there are.
  (tmp_path / "two.txt").write_text("One document.\n\nAnother one.\n")
  few = run_here("data_pipelines.split_text", f"--input={tmp_path}/two.txt", f"--output_dir={tmp_path}/few",
                 "--num_files=5")
  assert few.returncode == 0, few.stderr[-2000:]
  assert "too few documents for 5 files: wrote 2" in few.stdout
  assert sorted(p.name for p in (tmp_path / "few").iterdir()) == ["part-00000-of-00002.txt", "part-00001-of-00002.txt"]


def test_a_pipeline_warns_when_its_shards_reread_a_few_files(tmp_path, demo_paths, monkeypatch, capsys):
  from data_pipelines import input_pipeline
  monkeypatch.setattr(input_pipeline, "REREAD_WARNING_BYTES", 0)
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "a.txt").write_text(chapter(0) + "\n\n" + chapter(1) + "\n")
  name = tasks.text_task("bert_mlm_nsp", train_files=str(tmp_path / "one" / "*.txt"),
                         vocab_model=demo_paths["vocab_model"])
  input_pipeline.InputPipeline(name, LENGTHS, 4, {}, num_data_shards=4, process_index=0, process_count=1)
  warning = capsys.readouterr().out
  assert "reads 1 file(s)" in warning and "python -m data_pipelines.split_text --num_files=4" in warning
  input_pipeline.InputPipeline(name, LENGTHS, 4, {}, num_data_shards=1, process_index=0, process_count=1)
  assert capsys.readouterr().out == ""
