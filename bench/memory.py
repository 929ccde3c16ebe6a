"""Section 5: peak RSS per rank with cifar10-shaped data at batch 256, and what the data costs.

The trainer reads real-format CIFAR-10 pickle batches of random images (50,000 train +
10,000 test). What reading the set costs is measured on its own: a process that has
imported torch and numpy loads the set through the trainer's own data.load, and its peak
RSS after the load, less its RSS before, is set against the set's uint8 size. A rank's
peak over a short 2-rank training run is reported beside it (each rank's ru_maxrss from
wait4), and so is that peak less the peak of the same run on 1,000 training images: the
latter is the old way of judging the data and mixes in the training phase's allocator
noise of some tens of MB, so it is reported, not held to the target.
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
SMALL = (1_000, 10_000)  # the same test set, so both runs evaluate the same batches
LOAD = """
import resource, sys
import numpy, torch
from ddpk_trainer import data

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

before = rss_kb()
ds = data.load("cifar10", sys.argv[1], False, 32, torch.device("cpu"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, peak, len(ds.train) + len(ds.test))
"""


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


def load_cost_mb(ws: Workspace, n_train: int, n_test: int) -> tuple[float, int]:
    """Peak RSS after loading the set less RSS before it, in MB, and the images loaded."""
    data = ws.data(n_train, n_test)
    proc = subprocess.run([sys.executable, "-c", LOAD, str(data)], env=child_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"loading {data} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    before_kb, peak_kb, images = (int(x) for x in proc.stdout.split())
    return (peak_kb - before_kb) * 1024 / 1e6, images


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
    load_mb, images = load_cost_mb(ws, *FULL)
    data_mb = images * IMAGE_BYTES / 1e6
    extra_mb = (FULL[0] - SMALL[0]) * IMAGE_BYTES / 1e6
    cost = max(full) - max(floor)
    sec.rows.append(Row(NAME, f"peak RSS per rank, cifar10 50k+10k, batch {BATCH}, convnet, 2 ranks",
                        max(full), "MB", note=f"ranks {', '.join(f'{m:.0f}' for m in full)} MB; "
                                              f"uint8 train+test {data_mb:.0f} MB; "
                                              f"`import torch` alone {torch_only:.0f} MB"))
    ratio = load_mb / data_mb
    sec.rows.append(Row(NAME, "what reading the set adds to peak RSS: data.load of 50k+10k, "
                              "peak after − RSS before",
                        load_mb, "MB", data_mb, "uint8 size of the 60k images", ratio,
                        "≤ 1.0× (no more than uint8)", ratio <= 1.05))
    sec.rows.append(Row(NAME, "training-run peak per rank, 50k+10k − 1k+10k", cost, "MB",
                        extra_mb, "uint8 size of the extra 49k images", cost / extra_mb, "report",
                        note=f"1k+10k peak {max(floor):.0f} MB"))
    sec.notes.append("memory: the load row is one process that imports torch and numpy, then calls the "
                     "trainer's data.load('cifar10'); up to 5 % over 1.0× is allocator noise, 2× would mean "
                     "a second copy of the set at the peak. The training rows are each rank's ru_maxrss from "
                     f"wait4 (the bench starts the ranks with torchrun's variables, as ddpk-launch does), {steps} "
                     "steps and the end-of-run evaluation; the floor run differs only in a 1,000-image train "
                     "set, and the two peaks move by some tens of MB from run to run.")
    return sec
