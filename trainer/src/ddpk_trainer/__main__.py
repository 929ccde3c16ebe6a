"""python -m ddpk_trainer: one rank of the trainer (what ddpk-launch starts)."""

import sys

from .train import main

sys.exit(main())
