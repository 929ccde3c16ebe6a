"""Trainer flags, their defaults (the demo), and validation that touches no state.

Every check that can fail on bad input lives here or in the data readers and
runs before anything is created or any rank rendezvouses, so bad input gives
exit 2 with one line on every rank and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Mapping, Sequence

from .errors import UserError

DATASETS = ("synthetic", "cifar10", "imagefolder", "fake")
BUILTIN_MODELS = ("convnet", "resnet18", "resnet34", "resnet50")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a UserError (one line, exit 2) instead of usage text,
    and no abbreviations: a mistyped flag must not silently become another one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(message)


def _int_at_least(minimum: int):
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _float_at_least(minimum: float, strict: bool = False):
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {raw}")
        return value

    return parse


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    p = OneLineParser(prog="ddpk-train", description="DDP image classification trainer (defaults: the 2-rank demo).")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="convnet", help="convnet, resnet18, resnet34, resnet50 or tv:<torchvision name>")
    g.add_argument("--dataset", default="synthetic", choices=DATASETS)
    g.add_argument("--data-dir", default=environ.get("DDPK_DATA_DIR") or None, help="default: $DDPK_DATA_DIR")
    g.add_argument("--download", action="store_true", help="fetch CIFAR-10 into --data-dir if absent (cifar10 only)")
    g.add_argument("--image-size", type=_int_at_least(8), default=224, help="imagefolder crop size (default 224)")
    g = p.add_argument_group("schedule")
    g.add_argument("--epochs", type=_int_at_least(1), default=2)
    g.add_argument("--max-steps", type=_int_at_least(1), default=None, help="stop after this many optimizer steps")
    g.add_argument("--batch-size", type=_int_at_least(1), default=64, help="per rank")
    g.add_argument("--lr", type=_float_at_least(0.0, strict=True), default=0.1, help="peak learning rate")
    g.add_argument("--momentum", type=_float_at_least(0.0), default=0.9)
    g.add_argument("--weight-decay", type=_float_at_least(0.0), default=5e-4)
    g.add_argument("--lr-schedule", default="cosine", choices=("constant", "cosine", "step"))
    g.add_argument("--warmup-epochs", type=_float_at_least(0.0), default=0.0)
    g.add_argument("--label-smoothing", type=_float_at_least(0.0), default=0.0)
    g.add_argument("--grad-accum", type=_int_at_least(1), default=1, help="micro-batches per optimizer step")
    g.add_argument("--eval-every", type=_int_at_least(1), default=1, help="epochs between evaluations")
    g = p.add_argument_group("speed")
    g.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"))
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile the DDP-wrapped model")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks")
    g.add_argument("--strategy", default="ddp", choices=("ddp", "dp"), help="dp = nn.DataParallel baseline, one process")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=environ.get("DDPK_CHECKPOINT_DIR") or None, help="default: $DDPK_CHECKPOINT_DIR")
    g.add_argument("--checkpoint-every", type=_int_at_least(1), default=None, help="steps (epoch ends always checkpoint)")
    g.add_argument("--keep-checkpoints", type=_int_at_least(1), default=3)
    g.add_argument("--resume", default="auto", help="auto (newest loadable), none, or a checkpoint PATH")
    g = p.add_argument_group("output and system")
    g.add_argument("--metrics-file", default=environ.get("DDPK_METRICS_FILE") or None, help="default: $DDPK_METRICS_FILE")
    g.add_argument("--seed", type=_int_at_least(0), default=0)
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--num-threads", type=_int_at_least(1), default=None, help="intra-op threads (default: $OMP_NUM_THREADS)")
    g.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    g.add_argument("--timeout", type=_float_at_least(0.0, strict=True), default=300.0, help="collective timeout, seconds")
    return p


def _check_writable_dir(flag: str, path: str) -> None:
    """The folder exists and takes files, or it can be created; creates nothing."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise UserError(f"{flag}: {path} is not a writable directory ({probe} is not a directory)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{flag}: {path} is not writable")
    if probe == os.path.abspath(path):
        # Root ignores permission bits; a read-only mount still refuses, so try a file that vanishes at once.
        try:
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError as err:
            raise UserError(f"{flag}: {path} is not writable ({err.strerror})") from None


def validate(args: argparse.Namespace, world_size: int, rank: int) -> None:
    """Reject conflicting or impossible settings, naming the flag.

    Checkpoint and metrics paths matter to rank 0 only (it alone writes and reads them),
    so a node without the shared volume mounted is not refused.
    """
    if not (args.model in BUILTIN_MODELS or (args.model.startswith("tv:") and len(args.model) > 3)):
        raise UserError(f"--model: unknown model {args.model!r} (choose {', '.join(BUILTIN_MODELS)} or tv:<name>)")
    if args.download and args.dataset != "cifar10":
        raise UserError("--download: only the cifar10 dataset can be downloaded")
    if args.dataset in ("cifar10", "imagefolder") and not args.data_dir:
        raise UserError(f"--data-dir: required for --dataset {args.dataset}")
    if args.data_dir and args.dataset in ("cifar10", "imagefolder") and not args.download:
        if not os.path.isdir(args.data_dir):
            raise UserError(f"--data-dir: {args.data_dir} is not a directory")
    if args.strategy == "dp" and world_size > 1:
        raise UserError(f"--strategy dp: nn.DataParallel runs in one process, but WORLD_SIZE={world_size}")
    if args.backend == "nccl" and args.device == "cpu":
        raise UserError("--backend nccl: needs --device cuda")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise UserError("--checkpoint-every: needs --checkpoint-dir (or $DDPK_CHECKPOINT_DIR)")
    if args.label_smoothing >= 1.0:
        raise UserError(f"--label-smoothing: must be < 1, got {args.label_smoothing}")
    if rank != 0:
        return
    if args.resume not in ("auto", "none"):
        if not os.path.isfile(args.resume):
            raise UserError(f"--resume: no checkpoint file at {args.resume}")
    if args.checkpoint_dir:
        _check_writable_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.metrics_file:
        _check_writable_dir("--metrics-file", os.path.dirname(os.path.abspath(args.metrics_file)))
        if os.path.isdir(args.metrics_file):
            raise UserError(f"--metrics-file: {args.metrics_file} is a directory")


def parse(argv: Sequence[str], environ: Mapping[str, str], world_size: int, rank: int) -> argparse.Namespace:
    args = build_parser(environ).parse_args(list(argv))
    validate(args, world_size, rank)
    return args
