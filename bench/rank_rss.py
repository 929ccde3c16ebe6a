"""One trainer rank that records its own peak RSS when it ends.

    torchrun --standalone --nproc-per-node 2 -m bench.rank_rss OUT_DIR TRAINER_ARGS...

The rank runs the trainer in-process, as `ddpk-launch` does under torchrun, then writes
`OUT_DIR/rank-<RANK>.maxrss` with getrusage's ru_maxrss (KiB): the kernel's high-water
mark of the process, transient peaks included, with no sampling to miss them.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from ddpk_trainer.train import main as train_main


def main() -> int:
    out, trainer_args = Path(sys.argv[1]), sys.argv[2:]
    code = train_main(trainer_args)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (out / f"rank-{os.environ['RANK']}.maxrss").write_text(f"{peak_kib}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
