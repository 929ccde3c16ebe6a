"""The all-reduce share of a DDP training step on CPU (gloo).

Each rank times the same step two ways, alternately: a normal DDP step (backward
launches the bucketed all-reduces and waits for them before the optimizer) and a step
under `no_sync()` (no communication at all). Every timed step starts after a barrier,
so the difference is the communication that backward could not hide, plus waiting for
the slower rank. A share near zero or slightly negative means it is within the noise. Inputs are random tensors already in memory: no data loading.

    torchrun --standalone --nproc-per-node 2 -m bench.allreduce --model resnet18 --out F
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpk_trainer.models import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="convnet")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    model = DDP(build(args.model, num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    images = torch.randn(args.batch_size, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch_size,))

    def step(sync: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            optimizer.zero_grad(set_to_none=True)
            criterion(model(images), labels).backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(2):
        step(True)
        step(False)
    synced, local = [], []
    for _ in range(args.steps):
        synced.append(step(True))
        local.append(step(False))
    params = sum(t.numel() for t in model.parameters())
    if dist.get_rank() == 0:
        t_sync, t_local = statistics.median(synced), statistics.median(local)
        args.out.write_text(json.dumps({
            "step_s": t_sync, "no_sync_step_s": t_local,
            "allreduce_share": 1.0 - t_local / t_sync,
            "grad_mb": params * 4 / 1e6, "world_size": dist.get_world_size(),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
