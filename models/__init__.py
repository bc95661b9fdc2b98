"""Flax linen models: BERT, ALBERT, BART, XLNet. Nothing here knows about data or training."""
