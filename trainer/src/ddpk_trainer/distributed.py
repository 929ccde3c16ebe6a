"""The few distributed operations the trainer needs, each a no-op in a single process.

Rank, world and master come from torchrun-style variables (set by ddpk-launch,
torchrun or a PyTorchJob pod). The collective timeout is always explicit so a
rank whose peer vanished fails within --timeout instead of a 30-minute default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import UserError


@dataclass(frozen=True)
class Place:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name) or default)
    except ValueError:
        raise UserError(f"{name}: expected an integer, got {environ.get(name)!r}") from None


def ranks_from_env(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torchrun variables; a lone process is (0, 0, 1)."""
    world = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"RANK/WORLD_SIZE: rank {rank} does not fit world size {world}")
    return rank, local, world


def place(environ: Mapping[str, str], device: str, backend: str) -> Place:
    """Pick this rank's device and the backend: CUDA + NCCL when asked or available, else CPU + gloo."""
    rank, local, world = ranks_from_env(environ)
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise UserError("--device cuda: no CUDA device is visible")
    use_cuda = device == "cuda" or (device == "auto" and cuda)
    if backend == "nccl" and not use_cuda:
        raise UserError("--backend nccl: needs a CUDA device")
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK: {local} but only {torch.cuda.device_count()} CUDA devices are visible")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
    return Place(rank, local, world, dev, chosen)


def init(p: Place, timeout_s: float) -> None:
    if not p.distributed:
        return
    kwargs: dict[str, Any] = dict(backend=p.backend, rank=p.rank, world_size=p.world_size, timeout=timedelta(seconds=timeout_s))
    if p.device.type == "cuda":
        kwargs["device_id"] = p.device
    dist.init_process_group(init_method="env://", **kwargs)


# How gloo, NCCL and c10d sign a failure: gloo prefixes its source path, NCCL and the process
# groups name themselves, and a vanished peer reads as a closed or reset connection or a timeout
# (gloo says "Timed out waiting", or, when its timeout closes the pair mid-broadcast, "Application
# timeout caused pair closure" with no source path).
_PEER_FAILURE = re.compile(
    r"/gloo/|\bGloo\b|\bNCCL\b|ProcessGroup(Gloo|NCCL)|\[c10d\]"
    r"|Connection (closed|reset) by peer|Timed out waiting \d+ ?ms for (send|recv)"
    r"|timeout caused pair closure"
)


def group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_failed(err: BaseException, group_is_up: bool) -> bool:
    """Whether ``err`` is a collective that broke because a peer left or hung, not a bug of this rank.

    torch raises most such failures as DistError; one that breaks inside backward() (DDP's
    all-reduce hooks) arrives as a plain RuntimeError carrying the backend's own message.
    """
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and group_is_up and _PEER_FAILURE.search(str(err)) is not None


def all_reduce_sum(p: Place, tensor: torch.Tensor) -> torch.Tensor:
    if p.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(p: Place, obj: Any) -> list[Any]:
    """Every rank's obj, on every rank (used for per-rank RNG states at checkpoint time)."""
    if not p.distributed:
        return [obj]
    out: list[Any] = [None] * p.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(p: Place, obj: Any) -> Any:
    """rank 0's obj on every rank (the resumed checkpoint: only rank 0 needs to see the files)."""
    if not p.distributed:
        return obj
    box = [obj if p.is_main else None]
    dist.broadcast_object_list(box, src=0, device=p.device if p.device.type == "cuda" else None)
    return box[0]
