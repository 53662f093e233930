"""Running: the training loop, checkpoints, reports, memory, device set-up and jax.distributed."""
