"""datastates: lazy asynchronous checkpointing for PyTorch."""
