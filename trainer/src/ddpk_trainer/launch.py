"""ddpk-launch: the pod entrypoint. Resolve the topology, wait for the master, start the local ranks.

Usage: ddpk-launch [--nproc-per-node auto|N] [--rdzv-timeout S] [--num-threads N] [--] TRAINER_ARGS...

Under torchrun (its variables already set) this process is one rank already, so
it runs the trainer in-process. Otherwise it starts nproc_per_node ranks as
`python -m ddpk_trainer`, each in its own process group, and supervises them as
a gang: the first rank to fail takes the others down and its exit code becomes
the launcher's (2, "bad input", stays 2 so the job is not retried).

The launcher never imports torch, so a failed wait costs no import time.

On a node other than the master's, the ranks start as soon as the master's name
resolves: they import torch, read the data and build the model while the
launcher waits for the master's port, and each then waits at a gate (a pipe
named by DDPK_RDZV_FD) until the launcher has seen the port open. Both nodes'
start-ups overlap, and the trainer's collective timeout still starts only once
the master is there; a port that never opens fails the launcher within
--rdzv-timeout as before.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

from . import env as envmod
from .config import OneLineParser
from .errors import EXIT_FAILED, EXIT_USER_ERROR, UserError

GRACE_S = 10.0  # time ranks get to exit after SIGTERM before SIGKILL
POLL_S = 0.05
MAX_BACKOFF_S = 2.0
GATE_BACKOFF_S = 0.25
GATE_ENV = "DDPK_RDZV_FD"  # the read end of the launcher's gate pipe, in the ranks of a non-master node


def parse_args(argv: Sequence[str], environ: Mapping[str, str]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="ddpk-launch",
        description="Start the local DDP ranks of one node; trainer arguments follow '--'.",
    )
    parser.add_argument(
        "--nproc-per-node",
        default=environ.get("DDPK_NPROC_PER_NODE") or "auto",
        help="ranks on this node: 'auto' = one per visible GPU, or 1 without GPUs (default: $DDPK_NPROC_PER_NODE or auto)",
    )
    parser.add_argument("--rdzv-timeout", type=float, default=600.0, help="seconds to wait for the master (default 600)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="intra-op threads per rank (CPU default: $OMP_NUM_THREADS, else cores / local ranks)")
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, trainer = argv[:split], argv[split + 1 :]
        args = parser.parse_args(own)
    else:
        args, trainer = parser.parse_known_args(argv)
    args.trainer_args = trainer
    if args.rdzv_timeout <= 0:
        raise UserError(f"--rdzv-timeout: must be > 0, got {args.rdzv_timeout}")
    if args.num_threads is not None and args.num_threads < 1:
        raise UserError(f"--num-threads: must be >= 1, got {args.num_threads}")
    envmod.parse_nproc(args.nproc_per_node, "--nproc-per-node")
    return args


def visible_gpus(environ: Mapping[str, str]) -> int:
    """GPUs this container may use, without importing torch or CUDA."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    try:
        return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


def quota_cores(cpu_max: str) -> int | None:
    """Whole cores granted by a cgroup v2 `cpu.max` line ("200000 100000"), None when unlimited."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        return max(1, int(int(parts[0]) / int(parts[1])))
    except (ValueError, ZeroDivisionError):
        return None


def cpu_count() -> int:
    """Cores this container may use: its affinity mask, capped by its CPU limit (a pod's or --cpus)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota = quota_cores(f.read())
    except OSError:
        quota = None
    return min(cores, quota) if quota else cores


def threads_per_rank(cores: int, local_ranks: int, gpus: int, requested: int | None, preset: str | None = None) -> int | None:
    """OMP threads for each rank: the flag; else an OMP_NUM_THREADS already in the environment (the
    operator's choice, e.g. several emulated nodes sharing one machine); else on CPU an even split of
    the cores. None leaves the environment as it is."""
    if requested is not None:
        return requested
    if preset or gpus > 0:
        return None
    return max(1, cores // local_ranks)


def rank_env(base: Mapping[str, str], topo: envmod.Topology, local_rank: int, threads: int | None) -> dict[str, str]:
    nproc = topo.nproc_per_node or 1
    env = dict(base)
    env.pop(GATE_ENV, None)  # only this launcher's own gate, never one inherited from outside
    env.update(
        RANK=str(topo.node_rank * nproc + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(topo.nnodes * nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(topo.node_rank),
        MASTER_ADDR=topo.master_addr,
        MASTER_PORT=str(topo.master_port),
        PYTHONUNBUFFERED="1",
    )
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _resolve_within(host: str, port: int, timeout: float) -> bool:
    # getaddrinfo cannot be interrupted; a daemon thread keeps a slow resolver inside the deadline.
    result: list[bool] = []

    def attempt() -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            result.append(True)
        except (OSError, UnicodeError):
            result.append(False)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def _connect_within(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=max(0.05, timeout)):
            return True
    except OSError:
        return False


_PROBES = {"resolve": (_resolve_within, "did not resolve"), "connect": (_connect_within, "accepted no connection on port")}


def wait_for_master(host: str, port: int, timeout: float, stage: str, deadline: float,
                    max_backoff: float = MAX_BACKOFF_S) -> None:
    """Bounded exponential backoff until the master's name resolves ("resolve", the pod DNS race)
    or its port accepts a connection ("connect"), by the monotonic ``deadline``; ``timeout`` is
    the --rdzv-timeout that set it, for the message."""
    probe, failure = _PROBES[stage]
    delay = 0.1
    while True:
        remaining = deadline - time.monotonic()
        if remaining > 0 and probe(host, port, min(remaining, max_backoff)):
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            what = failure + (f" {port}" if stage == "connect" else "")
            raise TimeoutError(f"ddpk-launch: master host {host!r} {what} within {timeout:g}s (--rdzv-timeout)")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_backoff)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # A rank must not outlive a launcher that was SIGKILLed (no orphans holding ports or GPUs).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def wait_at_gate(environ: Mapping[str, str]) -> None:
    """In a rank: block until the launcher has seen the master's port open (no-op without a gate)."""
    fd = environ.get(GATE_ENV)
    if not fd:
        return
    try:
        opened = os.read(int(fd), 1)
    finally:
        os.close(int(fd))
    if not opened:
        raise RuntimeError("ddpk-launch closed the rendezvous gate without opening it")


class PortWatch:
    """Waits for the master's port in a thread, so the ranks can start meanwhile."""

    def __init__(self, host: str, port: int, timeout: float, deadline: float):
        self.error: TimeoutError | None = None
        self.done = threading.Event()

        def watch() -> None:
            try:
                # Ready ranks wait on this, so look often: a refused connect costs next to nothing.
                wait_for_master(host, port, timeout, "connect", deadline, max_backoff=GATE_BACKOFF_S)
            except TimeoutError as err:
                self.error = err
            self.done.set()

        threading.Thread(target=watch, daemon=True).start()


class Gang:
    """The local ranks, each in its own process group, started and stopped together."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], gate: int | None = None):
        fds = () if gate is None else (gate,)
        self.procs = [
            subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent, pass_fds=fds)
            for cmd, env in zip(commands, envs, strict=True)
        ]

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace: float = GRACE_S) -> None:
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        # SIGKILL the groups too, so helpers of a rank (data workers) go with it.
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def supervise(self, interrupted: list[int], watch: PortWatch | None = None, gate: int | None = None) -> int:
        """Wait for all ranks. The first failure (or a forwarded signal) stops the rest.

        With a port ``watch``, its success opens the ``gate`` (one byte per rank) and its
        timeout stops the ranks and fails the launcher."""
        while True:
            if interrupted:
                self.stop()
                return 128 + interrupted[0]
            if watch is not None and watch.done.is_set():
                if watch.error is not None:
                    print(str(watch.error), file=sys.stderr, flush=True)
                    self.stop()
                    return EXIT_FAILED
                try:
                    os.write(gate, b"1" * len(self.procs))
                except BrokenPipeError:
                    pass  # every rank has exited already: the checks below report how
                os.close(gate)
                watch = None
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                self.stop()
                return exit_code(failed[0])
            if all(c == 0 for c in codes):
                self.signal_all(signal.SIGKILL)
                return 0
            time.sleep(POLL_S)


def _run_in_process(trainer_args: list[str]) -> int:
    from .train import main as train_main

    return train_main(trainer_args)


def launch(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    args = parse_args(argv, environ)
    topo = envmod.resolve(environ, args.nproc_per_node)
    if topo.source == "torchrun":
        print(f"ddpk-launch: {topo.describe()} (ranks started by torchrun)", flush=True)
        return _run_in_process(args.trainer_args)
    gpus = visible_gpus(environ)
    if topo.nproc_per_node is None:
        topo = envmod.Topology(topo.source, topo.node_rank, topo.nnodes, max(1, gpus), topo.master_addr, topo.master_port)
    if topo.master_port == 0:
        topo = envmod.Topology(topo.source, topo.node_rank, topo.nnodes, topo.nproc_per_node, topo.master_addr, free_port())
    print(f"ddpk-launch: {topo.describe()}", flush=True)
    watch, read_end, write_end = None, None, None
    if topo.nnodes > 1:
        deadline = time.monotonic() + args.rdzv_timeout
        wait_for_master(topo.master_addr, topo.master_port, args.rdzv_timeout, "resolve", deadline)
        if topo.node_rank != 0:
            read_end, write_end = os.pipe()  # neither end is inherited unless passed
            watch = PortWatch(topo.master_addr, topo.master_port, args.rdzv_timeout, deadline)

    nproc = topo.nproc_per_node or 1
    threads = threads_per_rank(cpu_count(), nproc, gpus, args.num_threads, environ.get("OMP_NUM_THREADS"))
    command = [sys.executable, "-m", "ddpk_trainer", *args.trainer_args]
    if args.num_threads is not None:
        command += ["--num-threads", str(args.num_threads)]

    interrupted: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        interrupted.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    gate_env = {} if read_end is None else {GATE_ENV: str(read_end)}
    envs = [{**rank_env(environ, topo, i, threads), **gate_env} for i in range(nproc)]
    gang = Gang([command] * nproc, envs, gate=read_end)
    if read_end is not None:
        os.close(read_end)  # the ranks hold it now; the gate reads as closed once they all exit
    return gang.supervise(interrupted, watch, write_end)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = launch(sys.argv[1:] if argv is None else argv, os.environ)
    except UserError as err:
        print(f"ddpk-launch: {err}", file=sys.stderr, flush=True)
        code = EXIT_USER_ERROR
    except TimeoutError as err:
        print(str(err), file=sys.stderr, flush=True)
        code = EXIT_FAILED
    sys.exit(code)
