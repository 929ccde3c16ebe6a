"""The detached process that owns one local job's replicas.

``python -m ddpk.schedulers.local_supervisor RUN_DIR`` detaches (a second fork
in a new session), then runs the gang described by ``RUN_DIR/plan.json``. It
alone writes ``state.json`` (atomically) and the per-replica log files, so
``status``, ``logs``, ``list`` and ``delete`` work after the submitting process
has gone. Recovery mirrors the Indexed Job: when any replica exits non-zero,
the whole gang is stopped and started again (each replica's restart count goes
up by one) until ``max_restarts`` is spent; exit code 2 is a user error and
fails the job at once. That loop (``Gang``, ``decide``) is shared with the
docker supervisor, which runs containers instead of process groups.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from ddpk.logs import now_timestamp

EXIT_USER_ERROR = 2
STOP_GRACE_S = 10.0
POLL_S = 0.2
MARKER = "DDPK_LOCAL_RUN"
"""Env var set in every replica (and inherited by its ranks) naming its run; the sweep looks for it."""


def write_json(path: Path, data: dict) -> None:
    """Write atomically, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def exit_code(returncode: int) -> int:
    """Popen's -N for a signal becomes 128+N, as containers and pods report it."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def decide(exit_codes: list[int | None], restarts_done: int, max_restarts: int) -> tuple[str, str | None]:
    """What the gang does next: ("wait"|"succeed"|"restart"|"fail", reason).

    ``exit_codes`` holds None for replicas still running.
    """
    failed = [(i, c) for i, c in enumerate(exit_codes) if c not in (None, 0)]
    if not failed:
        return ("succeed", None) if all(c == 0 for c in exit_codes) else ("wait", None)
    # A user error anywhere decides, even when a peer's broken collective was seen with it.
    user_error = [i for i, c in failed if c == EXIT_USER_ERROR]
    if user_error:
        return "fail", f"replica {user_error[0]} failed with exit code 2: a user error, not retried"
    # The victim and the survivors it took down often end within one poll: name them all.
    what = "; ".join(f"replica {i} failed with {describe_exit(c)}" for i, c in failed)
    if restarts_done >= max_restarts:
        return "fail", f"{what} after {restarts_done} restart(s); max_restarts={max_restarts} spent"
    return "restart", what


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (None: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def marked_pids(run_id: str) -> list[int]:
    """Every live process whose environment carries this run's marker."""
    needle = f"{MARKER}={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def kill_run(run_id: str, pgids: list[int], sig: int) -> None:
    """Signal the replicas' process groups and every process carrying the marker."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in marked_pids(run_id):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Gang(ABC):
    """The gang loop every supervisor runs; subclasses start, stop and poll their replicas.

    It alone writes ``state.json`` in ``state_dir``. Recovery mirrors the Indexed
    Job (see ``decide``): any replica that exits non-zero stops the gang and
    starts all of it again, each replica's restart count going up by one.
    """

    poll_s = POLL_S

    def __init__(self, state_dir: Path, name: str, replicas: int, max_restarts: int):
        self.state_dir = state_dir
        self.max_restarts = max_restarts
        self.stop_requested = False
        self.state = {
            "name": name,
            "phase": "Pending",
            "supervisor_pid": os.getpid(),
            "start_time": now_timestamp(),
            "completion_time": None,
            "reason": None,
            "restarts": 0,
            "replicas": [
                {"index": i, "state": "Pending", "pid": None, "restarts": 0, "exit_code": None}
                for i in range(replicas)
            ],
        }

    @abstractmethod
    def start_gang(self) -> None:
        """Start every replica (again)."""

    @abstractmethod
    def stop_gang(self) -> None:
        """End every replica still running: TERM, a grace period, then KILL."""

    @abstractmethod
    def exit_codes(self) -> list[int | None]:
        """Each replica's exit code as a pod reports it (128+N for a signal); None while it runs."""

    def save(self) -> None:
        write_json(self.state_dir / "state.json", self.state)

    def started(self) -> None:
        for rep_state in self.state["replicas"]:
            rep_state["state"] = "Running"
        self.state["phase"] = "Running"
        self.save()

    def drain(self) -> None:
        """Wait for what the finished replicas still have to hand over (their output)."""

    def finish(self, phase: str, reason: str | None) -> None:
        for code, rep_state in zip(self.exit_codes(), self.state["replicas"]):
            rep_state.update(state="Succeeded" if code == 0 else "Failed", exit_code=code, pid=None)
        # A job that recovered and succeeded keeps the reason of its last restart.
        self.state.update(phase=phase, reason=reason or self.state["reason"], completion_time=now_timestamp())
        self.save()

    def run(self, start: bool = True) -> int:
        """Supervise the gang to its end; ``start=False`` when it was started before."""
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        if start:
            self.start_gang()
        self.started()
        while True:
            time.sleep(self.poll_s)
            if self.stop_requested:
                self.stop_gang()
                stop_file = self.state_dir / "stop"
                reason = stop_file.read_text().strip() if stop_file.exists() else "stopped"
                self.finish("Failed", reason)
                return 1
            codes = self.exit_codes()
            for code, rep_state in zip(codes, self.state["replicas"]):
                if code is not None and rep_state["exit_code"] != code:
                    rep_state.update(state="Succeeded" if code == 0 else "Failed", exit_code=code)
                    self.save()
            action, reason = decide(codes, self.state["restarts"], self.max_restarts)
            if action == "succeed":
                self.drain()
                self.finish("Succeeded", None)
                return 0
            if action == "fail":
                self.stop_gang()
                self.finish("Failed", reason)
                return 1
            if action == "restart":
                self.stop_gang()
                self.state["restarts"] += 1
                self.state["reason"] = f"restart {self.state['restarts']}/{self.max_restarts}: {reason}"
                for rep_state in self.state["replicas"]:
                    rep_state["restarts"] += 1
                self.start_gang()
                self.started()

    def _on_stop(self, signum, frame) -> None:
        self.stop_requested = True


class Supervisor(Gang):
    """One process group per replica, its output timestamped into ``logs/rank-<i>.log``."""

    def __init__(self, run_dir: Path):
        self.plan = json.loads((run_dir / "plan.json").read_text())
        super().__init__(run_dir, self.plan["name"], len(self.plan["replicas"]), self.plan["max_restarts"])
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []

    def _pump(self, index: int, stream) -> None:
        with open(self.state_dir / "logs" / f"rank-{index}.log", "ab", buffering=0) as out:
            for raw in iter(stream.readline, b""):
                text = raw.rstrip(b"\n")
                out.write(now_timestamp().encode() + b" " + text + b"\n")
        stream.close()

    def start_gang(self) -> None:
        # --port when given (ddpk submit checked it is free), else a new free port for every start.
        port = str(self.plan["port"] or free_port())
        self.procs, self.readers = [], []
        for replica, rep_state in zip(self.plan["replicas"], self.state["replicas"]):
            env = {**os.environ, **replica["env"], "MASTER_PORT": port, MARKER: self.plan["run_id"]}
            proc = subprocess.Popen(
                replica["argv"],
                env=env,
                cwd=self.plan["cwd"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            reader = threading.Thread(target=self._pump, args=(replica["index"], proc.stdout), daemon=True)
            reader.start()
            self.procs.append(proc)
            self.readers.append(reader)
            rep_state["pid"] = proc.pid

    def stop_gang(self) -> None:
        pgids = [p.pid for p in self.procs]
        kill_run(self.plan["run_id"], pgids, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and (
            any(p.poll() is None for p in self.procs) or marked_pids(self.plan["run_id"])
        ):
            time.sleep(POLL_S)
        kill_run(self.plan["run_id"], pgids, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.drain()

    def exit_codes(self) -> list[int | None]:
        return [None if p.poll() is None else exit_code(p.returncode) for p in self.procs]

    def drain(self) -> None:
        for r in self.readers:
            r.join(timeout=5)


def detach() -> None:
    """Leave the submitting process: it reaps the first child at once, init inherits the second."""
    if os.fork() > 0:
        os._exit(0)


def main(argv: list[str]) -> int:
    run_dir = Path(argv[0])
    detach()
    supervisor = Supervisor(run_dir)
    supervisor.save()
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
