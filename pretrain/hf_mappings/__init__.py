"""Weight mappings between this framework's Flax params and HuggingFace transformers state dicts."""
