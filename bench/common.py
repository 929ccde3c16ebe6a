"""What every section shares: result rows, medians, the machine, the tools' paths.

Sections return `Row`s; `__main__` turns them into one markdown table. Nothing here
imports torch, so the CLI section measures ddpk without torch already in memory.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclasses.dataclass
class Row:
    """One line of the results table: a figure, what it is compared with, and its target."""

    section: str
    name: str
    value: float | None
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""


@dataclasses.dataclass
class Section:
    """What one section measured, plus free-text notes (settings, skips, method)."""

    rows: list[Row] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def median(values: list[float]) -> float:
    return statistics.median(values)


def tool(name: str) -> str:
    """A console script of the environment running the bench (ddpk, ddpk-launch, torchrun)."""
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed beside {sys.executable}")
    return found


def timed_run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None,
              timeout: float = 120) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one command, output discarded.

    CPU time is reported beside wall time because it barely moves when other work shares
    the machine, while wall time does. A failure is an error, not a time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=timeout, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {' | '.join(tail)}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"]
                return " ".join(f for f in wanted if f in flags) or "none of avx2/avx512/amx"
    except OSError:
        pass
    return "unknown"


def _mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _git_head() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "unknown"


def machine() -> dict[str, str]:
    """The facts a reader needs to judge the figures: CPU, cores, memory, versions, load."""
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, check=False).stdout.strip() or "not importable"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": f"{_cpu_model()} ({_cpu_flags()})",
        "cores": f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()}",
        "memory": f"{_mem_total_gib():.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch_version,
        "commit": _git_head(),
        "load average at start (1/5/15 min)": load,
    }


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def table(rows: list[Row]) -> str:
    lines = [
        "| section | measurement | value | baseline | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        value = f"{fmt(r.value)} {r.unit}".strip() if r.value is not None else "–"
        base = f"{fmt(r.baseline)} ({r.baseline_name})" if r.baseline is not None else "–"
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "–"
        met = {True: "yes", False: "**no**", None: "–"}[r.met]
        name = f"{r.name} ({r.note})" if r.note else r.name
        lines.append(f"| {r.section} | {name} | {value} | {base} | {ratio} | {r.target or '–'} | {met} |")
    return "\n".join(lines)
