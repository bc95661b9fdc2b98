"""The fixed ids of the special pieces that every vocabulary of this framework has (`data_pipelines.vocab`
trains them in). A module of its own: the model side (HF mappings, batch checks, benchmarks on machines
without TensorFlow) reads them without loading the data pipeline."""
PAD_ID, EOS_ID, UNK_ID, BOS_ID = 0, 1, 2, 3
FIRST_NORMAL_ID = 7  # ids below are special pieces (those above and [CLS], [SEP], [MASK]): never a random replacement
