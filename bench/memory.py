"""Section 5: peak RSS per rank with cifar10-shaped data at batch 256.

The trainer reads real-format CIFAR-10 pickle batches of random images (50,000 train +
10,000 test) and runs a few steps on 2 ranks; each rank's ru_maxrss comes from wait4
on that rank's process. The same run on a 1,000 + 1,000-image copy of the files is the
floor (interpreter, torch, model, activations at batch 256), so the difference is what
the data costs, set against its uint8 size. `import torch` alone is reported beside it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from .cifar_files import IMAGE_BYTES
from .common import Row, Section
from .training import Workspace, child_env

NAME = "memory"
BATCH = 256
FULL = (50_000, 10_000)
SMALL = (1_000, 1_000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_per_rank(ws: Workspace, n_train: int, n_test: int, steps: int) -> list[float]:
    """Peak RSS in MB of each rank of one 2-rank trainer run.

    The bench starts the two ranks itself, with the variables torchrun would set, as
    ddpk-launch does, so that each rank is its own child and wait4 hands back that
    child's rusage: ru_maxrss is the kernel's high-water mark for the process, transient
    peaks included, however the rank exits."""
    data = ws.data(n_train, n_test)
    out = ws.run_dir()
    cmd = [sys.executable, "-m", "ddpk_trainer",
           "--model", "convnet", "--dataset", "cifar10", "--data-dir", str(data),
           "--batch-size", str(BATCH), "--epochs", "1", "--max-steps", str(steps), "--num-threads", "1",
           "--metrics-file", str(out / "metrics.jsonl"), "--resume", "none"]
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(child_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0", OMP_NUM_THREADS="1")
        log = (out / f"rank-{rank}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT))
    peaks, codes = [], []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        codes.append(proc.returncode)
        peaks.append(usage.ru_maxrss * 1024 / 1e6)
    if any(codes):
        tail = " | ".join((out / "rank-0.log").read_text().strip().splitlines()[-4:])
        raise RuntimeError(f"memory run ranks exited {codes}: {tail}")
    return peaks


def import_torch_rss() -> float:
    code = "import resource, torch; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out) * 1024 / 1e6


def run(ws: Workspace, quick: bool) -> Section:
    sec = Section()
    steps = 2 if quick else 5
    full = peak_rss_per_rank(ws, *FULL, steps)
    floor = peak_rss_per_rank(ws, *SMALL, steps)
    torch_only = import_torch_rss()
    data_mb = (FULL[0] + FULL[1]) * IMAGE_BYTES / 1e6
    extra_mb = (FULL[0] + FULL[1] - SMALL[0] - SMALL[1]) * IMAGE_BYTES / 1e6
    cost = max(full) - max(floor)
    ratio = cost / extra_mb
    sec.rows.append(Row(NAME, f"peak RSS per rank, cifar10 50k+10k, batch {BATCH}, convnet, 2 ranks",
                        max(full), "MB", note=f"ranks {', '.join(f'{m:.0f}' for m in full)} MB; "
                                              f"uint8 train+test {data_mb:.0f} MB; "
                                              f"`import torch` alone {torch_only:.0f} MB"))
    sec.rows.append(Row(NAME, "what the data adds to peak RSS per rank: 50k+10k run − 1k+1k run", cost, "MB",
                        extra_mb, "uint8 size of the extra 58k images", ratio,
                        "≤ 1.0× (no more than uint8)", ratio <= 1.05,
                        note=f"1k+1k peak {max(floor):.0f} MB"))
    sec.notes.append("memory: each rank's ru_maxrss from wait4 (the bench starts the ranks with torchrun's "
                     f"variables, as ddpk-launch does), {steps} steps; the floor run differs "
                     "only in a 1,000 + 1,000-image copy of the files. Up to 5 % over 1.0× is allocator "
                     "noise; 2× would mean a second copy of the set at the peak.")
    return sec
