"""pod-pretrain."""
