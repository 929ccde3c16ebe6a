"""The baseline: a DDP loop written the way the public PyTorch multi-GPU tutorials write it.

torchrun starts the ranks; each joins a gloo process group, wraps the model in DDP and
reads CIFAR-shaped uint8 images through a DataLoader with a DistributedSampler and the
tutorials' per-sample torchvision transforms (PIL image → RandomCrop(32, padding=4) →
RandomHorizontalFlip → ToTensor → Normalize), and reads the loss with `.item()` every
step. The network is the trainer's own, built by the trainer's model constructor, so
both sides train the identical model.

Rank 0 appends one JSON line per epoch to --metrics-file with the epoch's global
samples/s, timed from the first batch request to the last optimizer step.

    torchrun --standalone --nproc-per-node 2 -m bench.baseline_tutorial \
        --data-dir DIR --model convnet --batch-size 128 --epochs 3 --num-workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from ddpk_trainer.models import build

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class CifarBatches(Dataset):
    """What torchvision.datasets.CIFAR10 does with the pickle batches, less its md5 check
    (the bench's files hold random images, so the published checksums cannot match)."""

    def __init__(self, folder: Path, transform):
        data, labels = [], []
        for i in range(1, 6):
            with (folder / f"data_batch_{i}").open("rb") as f:
                entry = pickle.load(f, encoding="latin1")
            data.append(entry["data"])
            labels.extend(entry["labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        self.targets = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True, help="folder holding cifar-10-batches-py/")
    p.add_argument("--model", default="convnet")
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank")
    p.add_argument("--num-threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--metrics-file", type=Path, required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)

    transform = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
    ])
    dataset = CifarBatches(args.data_dir / "cifar-10-batches-py", transform)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, persistent_workers=args.num_workers > 0,
                        drop_last=True)

    model = build(args.model, num_classes=10)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running_loss, seen = 0.0, 0
        start = time.perf_counter()
        for images, labels in loader:
            if args.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            seen += images.size(0)
        elapsed = time.perf_counter() - start
        if rank == 0:
            line = {"epoch": epoch + 1, "samples_per_sec": seen * world / elapsed,
                    "train_loss": running_loss / max(1, len(loader)), "world_size": world,
                    "elapsed_s": elapsed}
            with args.metrics_file.open("a") as f:
                f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
