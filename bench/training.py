"""Runs the trainer and the tutorial baseline on the same files and reads their epoch metrics.

Both sides write one JSON line per epoch with the epoch's global samples/s. The data set
is sized so that one epoch is a fixed number of steps; the first epoch (process start,
data loading, worker start-up, allocator warm-up) is discarded on both sides, and the
figure is the median over the remaining epochs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from collections.abc import Callable

from .cifar_files import write_cifar10
from .common import REPO, median, tool


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much work one measurement does: per-rank batch, steps per epoch at 2 ranks, epochs."""

    model: str
    batch: int
    steps: int
    epochs: int


def plans(quick: bool) -> dict[str, Plan]:
    if quick:
        return {"convnet": Plan("convnet", 128, 6, 2), "resnet18": Plan("resnet18", 32, 2, 2)}
    return {"convnet": Plan("convnet", 128, 25, 4), "resnet18": Plan("resnet18", 32, 5, 3)}


ROUNDS = 3
"""Alternating rounds behind every side-by-side training ratio (1 with --quick)."""


@dataclasses.dataclass
class Rounds:
    """Steady samples/s of each side, one figure per round; the sides ran one after another
    in every round, in alternating order (A B C, then C B A, ...)."""

    rates: dict[str, list[float]]

    def median(self, side: str) -> float:
        return median(self.rates[side])

    def ratio(self, a: str, b: str, scale: float = 1.0) -> tuple[float, float, float]:
        """Median, lowest and highest of the per-round ratios scale * a / b.

        Each round's ratio compares runs seconds apart, so slow drift of the host's speed
        cancels out in it instead of landing on whichever side happened to run later."""
        each = [scale * x / y for x, y in zip(self.rates[a], self.rates[b])]
        return median(each), min(each), max(each)

    def spread(self, a: str, b: str, scale: float = 1.0) -> str:
        mid, low, high = self.ratio(a, b, scale)
        n = len(self.rates[a])
        return f"median of {n} alternating rounds, {low:.2f}–{high:.2f}×" if n > 1 else "1 round"


def alternate(sides: dict[str, Callable[[int], list[dict]]], rounds: int) -> Rounds:
    """Run every side once per round (the round is its ``repeat``), reversing the order each round.

    The runs are cached by repeat, so a later section asking for a side another one measured
    in the same rounds gets those runs back instead of new ones."""
    names = list(sides)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rates[name].append(steady_rate(sides[name](r)))
    return Rounds(rates)


class Workspace:
    """Temporary data sets shared by the sections of one bench run."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="ddpk-bench-")
        self.root = Path(self._tmp.name)
        self._data: dict[tuple[int, int], Path] = {}
        self._runs = 0
        self.cache: dict[tuple, list[dict]] = {}

    def data(self, n_train: int, n_test: int) -> Path:
        key = (n_train, n_test)
        if key not in self._data:
            folder = self.root / f"cifar-{n_train}-{n_test}"
            write_cifar10(folder, n_train, n_test)
            self._data[key] = folder
        return self._data[key]

    def run_dir(self) -> Path:
        self._runs += 1
        folder = self.root / f"run-{self._runs}"
        folder.mkdir()
        return folder

    def close(self) -> None:
        self._tmp.cleanup()


def plan_data(ws: Workspace, plan: Plan) -> Path:
    # One epoch at 2 ranks is exactly `steps` full batches; a small test split keeps eval cheap.
    n_train = 2 * plan.batch * plan.steps
    return ws.data(n_train, 5 * 64)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The bench package itself must be importable by the baseline's ranks.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("DDPK_METRICS_FILE", None)
    env.pop("DDPK_CHECKPOINT_DIR", None)
    env.pop("DDPK_DATA_DIR", None)
    return env


def _read_metrics(path: Path, cmd: list[str], proc: subprocess.CompletedProcess) -> list[dict]:
    if proc.returncode != 0 or not path.exists():
        tail = proc.stdout.strip().splitlines()[-6:]
        raise RuntimeError(f"{' '.join(cmd[:6])} … exited {proc.returncode}:\n    " + "\n    ".join(tail))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trainer_cmd(ws: Workspace, plan: Plan, ranks: int, threads: int, extra: tuple[str, ...],
                 epochs: int | None, metrics: Path) -> list[str]:
    return [tool("ddpk-launch"), "--nproc-per-node", str(ranks), "--num-threads", str(threads), "--",
            "--model", plan.model, "--dataset", "cifar10", "--data-dir", str(plan_data(ws, plan)),
            "--batch-size", str(plan.batch), "--epochs", str(epochs or plan.epochs),
            "--num-threads", str(threads), "--metrics-file", str(metrics), "--resume", "none", *extra]


def run_trainer(ws: Workspace, plan: Plan, ranks: int, threads: int = 1,
                extra: tuple[str, ...] = (), epochs: int | None = None, repeat: int = 0) -> list[dict]:
    """ddpk-launch with `ranks` local ranks, as a pod would start it; its epoch metrics.

    No checkpoint folder: epoch-end checkpoints fall outside the timed loop anyway, and
    leaving them out keeps disk writes from disturbing the next epoch."""
    key = ("trainer", plan, ranks, threads, extra, epochs, repeat)
    if key in ws.cache:
        return ws.cache[key]
    out = ws.run_dir()
    metrics = out / "metrics.jsonl"
    cmd = _trainer_cmd(ws, plan, ranks, threads, extra, epochs, metrics)
    proc = subprocess.run(cmd, env=child_env(), cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900, check=False)
    ws.cache[key] = _read_metrics(metrics, cmd, proc)
    return ws.cache[key]


def run_trainer_side_by_side(ws: Workspace, plan: Plan, copies: int = 2) -> list[list[dict]]:
    """`copies` independent single-rank trainers at once: what the cores give two processes
    that never wait for each other, the ceiling for per-rank throughput of a 2-rank job."""
    outs = [ws.run_dir() for _ in range(copies)]
    cmds = [_trainer_cmd(ws, plan, 1, 1, (), None, out / "metrics.jsonl") for out in outs]
    procs = [subprocess.Popen(cmd, env=child_env(), cwd=out, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd, out in zip(cmds, outs)]
    results = []
    for cmd, out, proc in zip(cmds, outs, procs):
        stdout, _ = proc.communicate(timeout=900)
        done = subprocess.CompletedProcess(cmd, proc.returncode, stdout)
        results.append(_read_metrics(out / "metrics.jsonl", cmd, done))
    return results


def run_baseline(ws: Workspace, plan: Plan, ranks: int, workers: int, threads: int = 1,
                 channels_last: bool = False, repeat: int = 0) -> list[dict]:
    """The tutorial loop under torchrun with `ranks` ranks; its epoch metrics."""
    key = ("baseline", plan, ranks, workers, threads, channels_last, repeat)
    if key in ws.cache:
        return ws.cache[key]
    out = ws.run_dir()
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "bench.baseline_tutorial", "--data-dir", str(plan_data(ws, plan)),
           "--model", plan.model, "--batch-size", str(plan.batch), "--epochs", str(plan.epochs),
           "--num-workers", str(workers), "--num-threads", str(threads), "--metrics-file", str(metrics)]
    if channels_last:
        cmd.append("--channels-last")
    env = child_env()
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900, check=False)
    ws.cache[key] = _read_metrics(metrics, cmd, proc)
    return ws.cache[key]


def steady_rate(epochs: list[dict]) -> float:
    """Median global samples/s over the epochs after the first."""
    rates = [float(e["samples_per_sec"]) for e in epochs[1:]] or [float(epochs[-1]["samples_per_sec"])]
    return median(rates)
