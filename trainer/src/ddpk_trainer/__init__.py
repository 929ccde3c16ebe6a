"""ddpk_trainer: the DDP training program that runs in every ddpk pod."""

__version__ = "0.1.0"
