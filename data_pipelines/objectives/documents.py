"""Documents to token arrays: the step every objective starts from."""
import tensorflow as tf


def tokenize_sentences(dataset: tf.data.Dataset, output_features, text_key: str = "text") -> tf.data.Dataset:
  """{'text': sentences joined by '\\n'} -> {'sentences': int32 RaggedTensor [num_sentences, None]}.

  Uses the vocabulary of the task's first output feature. Empty sentences are dropped, and so are
  documents left with none.
  """
  vocabulary = next(iter(output_features.values())).vocabulary

  def tokenize(example):
    lines = tf.strings.split(example[text_key], "\n")
    sentences = tf.cast(vocabulary.encode_tf(lines), tf.int32)
    sentences = tf.ragged.boolean_mask(sentences, sentences.row_lengths() > 0)
    return {"sentences": sentences}

  return dataset.map(tokenize, num_parallel_calls=tf.data.AUTOTUNE).filter(
      lambda ex: ex["sentences"].nrows() > 0)

