"""ddpk: render, submit, follow and recover PyTorch DDP jobs."""

__version__ = "0.1.0"
