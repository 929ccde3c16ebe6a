"""Training FLOPs per image and the figures bench/gpu.sh prints for one trainer run.

    python -m bench.gpu_report --model resnet50 --batch-size 256 --images 50000 \
        --metrics-file M.jsonl --label eager [--peak-tflops 989]

FLOPs are counted by torch.utils.flop_counter.FlopCounterMode over one forward and
backward pass of the same network on meta tensors (shapes only, nothing is computed),
so the count is exact for the convolutions and matrix products and costs no device
time. The optimizer and element-wise work are not counted, as is usual for MFU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from ddpk_trainer.models import build


def train_flops_per_image(model_name: str, batch: int) -> float:
    with torch.device("meta"):
        model = build(model_name, num_classes=10).to(memory_format=torch.channels_last)
        x = torch.empty(batch, 3, 32, 32).to(memory_format=torch.channels_last)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    return counter.get_total_flops() / batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--metrics-file", type=Path, required=True)
    p.add_argument("--images", type=int, required=True, help="training images per epoch")
    p.add_argument("--label", required=True)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    args = p.parse_args()

    flops = train_flops_per_image(args.model, args.batch_size)
    epochs = [json.loads(line) for line in args.metrics_file.read_text().splitlines() if line.strip()]
    for e in epochs:
        # The trainer's samples_per_sec is the epoch's images over its training-loop time.
        rate = float(e["samples_per_sec"])
        tflops = flops * rate / 1e12
        mfu = f"{100 * tflops / args.peak_tflops:4.1f} % of {args.peak_tflops:.0f}" if args.peak_tflops else "peak unknown"
        print(f"{args.model:12s} {args.label:7s} epoch {int(e['epoch'])}: {args.images / rate:7.2f} s  "
              f"{rate:9.0f} images/s  {tflops:7.1f} TFLOP/s ({mfu})  [{flops / 1e9:.2f} GFLOP/image fwd+bwd]")

if __name__ == "__main__":
    main()
