"""Kill one replica of a running 2-replica job and watch the whole gang recover.

Each case submits a job with the real ``ddpk`` command, waits for its first
checkpoint, SIGKILLs one replica mid-epoch (replica 1, then replica 0, which
hosts the rendezvous), and waits for the job. It must finish with the planned
final step, resume from exactly the newest checkpoint written before the
restart, and take no longer than an uninterrupted run of the same job
(measured in the same session) plus the restart overhead plus 60 s. The
recovery time (kill -> the trainer resumed and training) is printed for
docs/fault-tolerance.md.

How the victim dies:
- local, ``process-group``: SIGKILL to the replica's launcher process group and
  its rank processes (the pid the supervisor recorded in state.json), as a
  node losing the pod would.
- docker, ``docker-kill``: ``docker kill --signal KILL <job>-<i>``, the
  container killed from outside, as a pod is deleted or evicted.
- docker, ``crash``: SIGKILL to the container's main process from the host,
  as the OOM killer or a crash ends it; the engine sees a failed container.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

REPLICAS = 2
PLANNED_STEPS = 300
CHECKPOINT_EVERY = 25
TRAINER_ARGS = [
    "--model", "convnet", "--dataset", "synthetic", "--batch-size", "32", "--num-threads", "1",
    "--max-steps", str(PLANNED_STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--timeout", "60",
]
RDZV_TIMEOUT_S = 120
STOP_GRACE_S = 10
"""How long the local supervisor and docker give a survivor to stop before SIGKILL."""
FIRST_CHECKPOINT_TIMEOUT_S = 240
JOB_TIMEOUT_S = 400
KILL_AFTER_CHECKPOINT_S = 1.0
"""The kill lands between two checkpoints, in the middle of training steps."""
ALLOWANCE_S = 60

RESUMED = re.compile(r"ddpk-train: resumed from (\S+) at epoch (\d+) step_in_epoch (\d+) global_step (\d+)")
STARTED = re.compile(r"ddpk-train: world_size=")
PROGRESS = re.compile(r"ddpk-train: epoch \d+/\d+ step (\d+)/\d+ ")
DONE = re.compile(r"ddpk-train: done steps=(\d+) .*eval_acc=[0-9.]+\s*$")
CHECKPOINT = re.compile(r"^ckpt-(\d+)\.pt$")
LOG_LINE = re.compile(r"^\[rank (\d+)\] (\S+) (.*)$")


def ddpk_exe() -> str:
    """The console script beside the interpreter running the tests (same venv), else PATH's."""
    beside = Path(sys.executable).parent / "ddpk"
    found = str(beside) if beside.exists() else shutil.which("ddpk")
    assert found, "the ddpk console script is not installed (pip install -e cli)"
    return found


def cli(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDPK_HOME": str(home), "NO_COLOR": "1"}
    return subprocess.run([ddpk_exe(), *args], capture_output=True, text=True, env=env, timeout=timeout)


def epoch_seconds(ts: str) -> float:
    from ddpk.logs import parse_timestamp

    return parse_timestamp(ts) / 1e9


class CheckpointWatch(threading.Thread):
    """Records when each checkpoint step first appears in the checkpoint folder."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder = folder
        self.first_seen: dict[int, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                names = os.listdir(self.folder)
            except FileNotFoundError:
                names = []
            now = time.time()
            for name in names:
                m = CHECKPOINT.match(name)
                if m:
                    self.first_seen.setdefault(int(m.group(1)), now)
            time.sleep(0.1)

    def newest_before(self, moment: float) -> int | None:
        steps = [step for step, seen in self.first_seen.items() if seen < moment]
        return max(steps, default=None)


@dataclasses.dataclass
class Run:
    name: str
    code: int
    wait_output: str
    wall_s: float
    submitted: float
    log: list[tuple[float, str]]
    """Rank 0's lines as (epoch seconds, text)."""
    watch: CheckpointWatch
    killed_at: float | None = None

    def tail(self) -> str:
        return "\n".join(text for _, text in self.log[-40:]) + "\n" + self.wait_output

    def first(self, pattern: re.Pattern, after: float = 0.0) -> tuple[float, re.Match] | None:
        for ts, text in self.log:
            m = pattern.search(text)
            if m and ts > after:
                return ts, m
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the launcher's ranks and their helpers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_local(home: Path, name: str, index: int) -> None:
    state = json.loads((home / "runs" / name / "state.json").read_text())
    pid = state["replicas"][index]["pid"]
    assert pid, f"replica {index} has no recorded pid: {state}"
    victims = [pid, *descendants(pid)]
    os.killpg(pid, signal.SIGKILL)
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_docker(home: Path, name: str, index: int) -> None:
    subprocess.run(["docker", "kill", "--signal", "KILL", f"{name}-{index}"], check=True,
                   capture_output=True, timeout=60)


def crash_docker(home: Path, name: str, index: int) -> None:
    pid = subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", f"{name}-{index}"], check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    assert pid.isdigit() and int(pid) > 0, f"{name}-{index} is not running (pid {pid!r})"
    os.kill(int(pid), signal.SIGKILL)


KILLS = {"process-group": kill_local, "docker-kill": kill_docker, "crash": crash_docker}


def run_job(scheduler: str, image: str | None, home: Path, folder: Path, victim: int | None = None,
            how: str | None = None) -> Run:
    name = f"ft-{scheduler[:2]}-{uuid.uuid4().hex[:6]}"
    folder.mkdir(parents=True, exist_ok=True)
    # Containers write as the image's non-root UID, like pods with fsGroup on a volume.
    os.chmod(folder, 0o777)
    submit = ["submit", "-s", scheduler, "--name", name, "--replicas", str(REPLICAS), "--nproc-per-node", "1",
              "--checkpoint-pvc", str(folder), "--rdzv-timeout", str(RDZV_TIMEOUT_S), "--max-restarts", "2"]
    if image:
        submit += ["--image", image, "--image-pull-policy", "Never"]
    watch = CheckpointWatch(folder)
    started = time.time()
    result = cli(*submit, "--", *TRAINER_ARGS, home=home)
    assert result.returncode == 0, f"submit failed ({result.returncode}): {result.stderr}"
    watch.start()
    killed_at = None
    try:
        if victim is not None:
            deadline = time.monotonic() + FIRST_CHECKPOINT_TIMEOUT_S
            while not watch.first_seen:
                assert time.monotonic() < deadline, f"{name} wrote no checkpoint in {FIRST_CHECKPOINT_TIMEOUT_S} s"
                time.sleep(0.2)
            time.sleep(KILL_AFTER_CHECKPOINT_S)
            killed_at = time.time()
            KILLS[how](home, name, victim)
        waited = cli("wait", name, "-s", scheduler, "--timeout", f"{JOB_TIMEOUT_S}s", home=home,
                     timeout=JOB_TIMEOUT_S + 60)
        wall = time.time() - started
        logs = cli("logs", name, "-s", scheduler, "--rank", "0", "--timestamps", home=home)
    finally:
        watch.done.set()
        watch.join()
        cli("delete", name, "-s", scheduler, home=home)
    lines = []
    for raw in logs.stdout.splitlines():
        m = LOG_LINE.match(raw)
        if m:
            lines.append((epoch_seconds(m.group(2)), m.group(3)))
    return Run(name, waited.returncode, waited.stderr + logs.stderr, wall, started, lines, watch, killed_at)


def check_completed(run: Run, hint: str = "") -> None:
    assert run.code == 0, f"job {run.name} did not succeed (ddpk wait exit {run.code}){hint}:\n{run.tail()}"
    done = run.first(DONE)
    assert done, f"no final summary line from rank 0:\n{run.tail()}"
    assert int(done[1].group(1)) == PLANNED_STEPS, done[1].group(0)
    metrics = [json.loads(x) for x in (run.watch.folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert metrics[-1]["step"] == PLANNED_STEPS, metrics[-1]


_baselines: dict[str, Run] = {}


@pytest.fixture
def baseline(tmp_path_factory):
    """An uninterrupted run of the same job on the same scheduler, once per session."""

    def get(scheduler: str, image: str | None) -> Run:
        if scheduler not in _baselines:
            root = tmp_path_factory.mktemp(f"baseline-{scheduler}")
            run = run_job(scheduler, image, root / "home", root / "checkpoints")
            check_completed(run)
            assert run.first(RESUMED) is None, f"an uninterrupted run resumed:\n{run.tail()}"
            _baselines[scheduler] = run
        return _baselines[scheduler]

    return get


NOT_RESTARTED_BY_DOCKER = (
    "; Docker applies no restart policy to a container stopped with docker kill or docker stop "
    "(it counts as stopped by hand), so the docker scheduler must start the killed replica again itself"
)


@pytest.mark.parametrize("victim", [1, 0], ids=["replica-1", "replica-0"])
@pytest.mark.parametrize(("scheduler", "how"), [
    pytest.param("local", "process-group", marks=pytest.mark.integration, id="local-process-group"),
    pytest.param("docker", "docker-kill", marks=pytest.mark.e2e, id="docker-kill"),
    pytest.param("docker", "crash", marks=pytest.mark.e2e, id="docker-crash"),
])
def test_gang_recovers_from_the_last_checkpoint(request, scheduler, how, victim, baseline, tmp_path, capsys):
    image = request.getfixturevalue("cpu_image") if scheduler == "docker" else None
    planned = baseline(scheduler, image)
    run = run_job(scheduler, image, tmp_path / "home", tmp_path / "checkpoints", victim, how)

    check_completed(run, NOT_RESTARTED_BY_DOCKER if how == "docker-kill" else "")
    resumed = run.first(RESUMED, after=run.killed_at)
    assert resumed, f"rank 0 never printed a resume line after the kill:\n{run.tail()}"
    resumed_at, m = resumed
    expected = run.watch.newest_before(resumed_at)
    assert expected is not None and expected >= CHECKPOINT_EVERY, (expected, run.watch.first_seen)
    assert int(m.group(4)) == expected, (
        f"resumed at global_step {m.group(4)} from {m.group(1)}, but the newest checkpoint was step {expected}")
    assert Path(m.group(1)).name == f"ckpt-{expected:09d}.pt", m.group(0)

    started = planned.first(STARTED)
    assert started, planned.tail()
    overhead = (started[0] - planned.submitted) + STOP_GRACE_S
    bound = planned.wall_s + overhead + ALLOWANCE_S
    assert run.wall_s < bound, (
        f"{run.wall_s:.0f} s with a kill, uninterrupted {planned.wall_s:.0f} s + restart overhead {overhead:.0f} s "
        f"+ {ALLOWANCE_S} s")

    training = run.first(PROGRESS, after=resumed_at)
    progress = f"{training[0] - run.killed_at:.1f} s" if training else "-"
    with capsys.disabled():
        print(f"\n[recovery] {scheduler} {how} replica-{victim}: kill->resumed {resumed_at - run.killed_at:.1f} s, "
              f"kill->first progress line {progress}, resumed at step {expected}; "
              f"wall {run.wall_s:.1f} s vs uninterrupted {planned.wall_s:.1f} s (bound {bound:.0f} s)")
