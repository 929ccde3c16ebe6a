"""Resolve the node topology from the environment a launcher finds itself in.

Pure: every function takes the environment as a mapping and returns values or
raises UserError; nothing here reads os.environ, resolves names or spawns.
The order is fixed (first match wins): torchrun, Indexed Job, Kubeflow
PyTorchJob, Slurm, a single process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from .errors import UserError

DEFAULT_MASTER_PORT = 29500
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Topology:
    """Where this node sits in the job. nproc_per_node is None when it is still "auto"."""

    source: str  # torchrun | indexed-job | pytorchjob | slurm | single
    node_rank: int
    nnodes: int
    nproc_per_node: int | None
    master_addr: str
    master_port: int  # 0 means "any free port" (single process only)

    def describe(self) -> str:
        nproc = "auto" if self.nproc_per_node is None else str(self.nproc_per_node)
        world = "?" if self.nproc_per_node is None else str(self.nnodes * self.nproc_per_node)
        return (
            f"environment={self.source} node_rank={self.node_rank} nnodes={self.nnodes} "
            f"nproc_per_node={nproc} world_size={world} master={self.master_addr}:{self.master_port}"
        )


def _int(env: Mapping[str, str], name: str, default: int | None = None, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"{name}: required but not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise UserError(f"{name}: must be >= {minimum}, got {value}")
    return value


def parse_nproc(raw: str | None, name: str) -> int | None:
    """"auto" (or unset) -> None; otherwise a positive integer."""
    if raw is None or raw == "" or raw == "auto":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name}: expected 'auto' or a positive integer, got {raw!r}") from None
    if value < 1:
        raise UserError(f"{name}: expected 'auto' or a positive integer, got {raw!r}")
    return value


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    port = _int(env, name, default)
    if not 0 < port < 65536:
        raise UserError(f"{name}: not a TCP port: {port}")
    return port


def _fixed_nnodes(raw: str, name: str) -> int:
    # torchrun accepts "MIN:MAX" for elastic jobs; a static rendezvous needs one size.
    lo, _, hi = raw.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"{name}: expected N or N:N, got {raw!r}") from None
    if lo_n != hi_n or lo_n < 1:
        raise UserError(f"{name}: elastic ranges are not supported, got {raw!r}")
    return lo_n


def _torchrun(env: Mapping[str, str]) -> Topology:
    world = _int(env, "WORLD_SIZE", minimum=1)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1, minimum=1)
    rank = _int(env, "RANK")
    return Topology(
        source="torchrun",
        node_rank=_int(env, "GROUP_RANK", rank // local_world),
        nnodes=max(1, world // local_world),
        nproc_per_node=local_world,
        master_addr=env.get("MASTER_ADDR") or LOCALHOST,
        master_port=_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
    )


def _indexed_job(env: Mapping[str, str], nproc: str | None) -> Topology:
    nnodes = _int(env, "DDPK_NNODES", 1, minimum=1)
    index = _int(env, "JOB_COMPLETION_INDEX")
    if index >= nnodes:
        raise UserError(f"JOB_COMPLETION_INDEX: {index} is not below DDPK_NNODES={nnodes}")
    return Topology(
        source="indexed-job",
        node_rank=index,
        nnodes=nnodes,
        nproc_per_node=parse_nproc(nproc, "--nproc-per-node"),
        master_addr=env.get("MASTER_ADDR") or LOCALHOST,
        master_port=_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
    )


def _pytorchjob(env: Mapping[str, str], nproc: str | None) -> Topology:
    # The operator counts RANK/WORLD_SIZE per pod; PET_* (torchrun-style) win when present.
    if env.get("PET_NNODES"):
        nnodes = _fixed_nnodes(env["PET_NNODES"], "PET_NNODES")
    else:
        nnodes = _int(env, "WORLD_SIZE", minimum=1)
    node_rank = _int(env, "PET_NODE_RANK") if env.get("PET_NODE_RANK") else _int(env, "RANK")
    if node_rank >= nnodes:
        raise UserError(f"RANK: node rank {node_rank} is not below the node count {nnodes}")
    pet_nproc = env.get("PET_NPROC_PER_NODE")
    return Topology(
        source="pytorchjob",
        node_rank=node_rank,
        nnodes=nnodes,
        nproc_per_node=parse_nproc(pet_nproc if pet_nproc else nproc, "PET_NPROC_PER_NODE" if pet_nproc else "--nproc-per-node"),
        master_addr=env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or LOCALHOST,
        master_port=_port(env, "PET_MASTER_PORT" if env.get("PET_MASTER_PORT") else "MASTER_PORT", DEFAULT_MASTER_PORT),
    )


def _slurm(env: Mapping[str, str], nproc: str | None) -> Topology:
    ntasks = _int(env, "SLURM_NTASKS", minimum=1)
    procid = _int(env, "SLURM_PROCID")
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    nnodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", len(hosts) or 1, minimum=1), minimum=1)
    # MASTER_ADDR may be exported by the sbatch script; otherwise the first host of the allocation.
    master = env.get("MASTER_ADDR") or (hosts[0] if hosts else LOCALHOST)
    port = _port(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    if ntasks > nnodes:
        # Several tasks per node: each Slurm task is one rank, and the launcher starts just it.
        return Topology("slurm", procid, ntasks, 1, master, port)
    node_rank = _int(env, "SLURM_NODEID", procid)
    if node_rank >= nnodes:
        raise UserError(f"SLURM_NODEID: {node_rank} is not below the node count {nnodes}")
    return Topology("slurm", node_rank, nnodes, parse_nproc(nproc, "--nproc-per-node"), master, port)


def resolve(env: Mapping[str, str], nproc_per_node: str | None = None) -> Topology:
    """The topology for this node. nproc_per_node is the launcher's flag ("auto", "N" or None)."""
    if env.get("LOCAL_RANK") and env.get("RANK") and env.get("WORLD_SIZE"):
        return _torchrun(env)
    if env.get("JOB_COMPLETION_INDEX"):
        return _indexed_job(env, nproc_per_node)
    if env.get("PET_NNODES") or (env.get("RANK") and env.get("WORLD_SIZE")):
        return _pytorchjob(env, nproc_per_node)
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        return _slurm(env, nproc_per_node)
    port = _port(env, "MASTER_PORT", 0) if env.get("MASTER_PORT") else 0
    return Topology("single", 0, 1, parse_nproc(nproc_per_node, "--nproc-per-node"), LOCALHOST, port)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"SLURM_JOB_NODELIST: unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise UserError(f"SLURM_JOB_NODELIST: unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_range_list(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise UserError(f"SLURM_JOB_NODELIST: bad range {item!r} in {whole!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UserError(f"SLURM_JOB_NODELIST: descending range {item!r} in {whole!r}")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    tails = _expand_one(rest, whole)
    return [prefix + n + t for n in _expand_range_list(body, whole) for t in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as "gpu[01-03,07],cpu5" without calling scontrol."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    return hosts
