"""Documents to token arrays: the step every objective starts from."""
import tensorflow as tf


def tokenize_sentences(dataset: tf.data.Dataset, output_features, text_key: str = "text") -> tf.data.Dataset:
  """{'text': sentences joined by '\\n'} -> {'sentences': int32 RaggedTensor [num_sentences, None]}.

  Uses the vocabulary of the task's first output feature. Empty sentences are dropped, and so are
  documents left with none.
  """
  vocabulary = next(iter(output_features.values())).vocabulary

  @tf.autograph.experimental.do_not_convert  # plain TF ops: spares tf.data converting them
  def tokenize(example):
    lines = tf.strings.split(example[text_key], "\n")
    sentences = tf.cast(vocabulary.encode_tf(lines), tf.int32)
    sentences = tf.ragged.boolean_mask(sentences, sentences.row_lengths() > 0)
    return {"sentences": sentences}

  return dataset.map(tokenize, num_parallel_calls=tf.data.AUTOTUNE).filter(
      lambda ex: ex["sentences"].nrows() > 0)



def sentence_blocks(sentences: tf.RaggedTensor, max_tokens) -> tf.RaggedTensor:
  """[num_sentences, None] ids -> [num_blocks, None (sentences), None (ids)]: runs of consecutive
  whole sentences, each block as full as max_tokens allows (fairseq's 'complete_doc' blocks).

  A sentence longer than max_tokens is first cut into pieces of max_tokens (the last shorter), so
  every token lands in exactly one block, in document order.
  """
  lengths = tf.cast(sentences.row_lengths(), tf.int32)
  max_tokens = tf.cast(max_tokens, tf.int32)
  pieces_per_sentence = (lengths + max_tokens - 1) // max_tokens
  sentence_of_piece = tf.repeat(tf.range(tf.size(lengths)), pieces_per_sentence)
  first_piece = tf.repeat(tf.cumsum(pieces_per_sentence, exclusive=True), pieces_per_sentence)
  piece_index = tf.range(tf.size(sentence_of_piece)) - first_piece
  piece_lengths = tf.minimum(max_tokens, tf.gather(lengths, sentence_of_piece) - piece_index * max_tokens)
  pieces = tf.RaggedTensor.from_row_lengths(sentences.flat_values, piece_lengths)

  def add_piece(state, length):
    block, used = state
    starts_new = (used > 0) & (used + length > max_tokens)
    return block + tf.cast(starts_new, tf.int32), tf.where(starts_new, length, used + length)

  block_of_piece, _ = tf.scan(add_piece, piece_lengths, initializer=(tf.constant(0), tf.constant(0)))
  return tf.RaggedTensor.from_value_rowids(pieces, block_of_piece)


def concatenate(dataset: tf.data.Dataset, documents_per_stream: int) -> tf.data.Dataset:
  """{'sentences'} documents -> one {'sentences'} of a single row per `documents_per_stream` consecutive
  documents: their ids joined in order (T5's reduce_concat_tokens), so that short documents fill examples."""

  @tf.autograph.experimental.do_not_convert
  def join(batch):
    ids = batch["sentences"].flat_values
    return {"sentences": tf.RaggedTensor.from_row_lengths(ids, [tf.size(ids, out_type=tf.int64)])}

  return dataset.ragged_batch(documents_per_stream).map(join, num_parallel_calls=tf.data.AUTOTUNE)


def split_into_blocks(dataset: tf.data.Dataset, max_tokens, whole_sentences: bool = True) -> tf.data.Dataset:
  """{'sentences'} documents -> one {'sentences'} example per block of at most max_tokens ids, so
  that no text of a long document is left out. Without whole_sentences a document is one stream
  of ids, cut every max_tokens (T5)."""

  @tf.autograph.experimental.do_not_convert
  def blocks(example):
    sentences = example["sentences"]
    if not whole_sentences:
      sentences = tf.RaggedTensor.from_row_lengths(sentences.flat_values, [tf.size(sentences.flat_values)])
    return tf.data.Dataset.from_tensor_slices({"sentences": sentence_blocks(sentences, max_tokens)})

  return dataset.flat_map(blocks)
