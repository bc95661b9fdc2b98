"""Start `pretrain.train` commands on machines: Cloud TPU slices (tpu.py) or local processes (local.py)."""
