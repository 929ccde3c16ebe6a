"""Run a job on this machine: one process group per replica, owned by a detached supervisor.

Each replica runs the rendered pod command and environment, with
``MASTER_ADDR=127.0.0.1``, ``--port`` or else a free port, ``JOB_COMPLETION_INDEX`` and the
checkpoint/data mount paths mapped to host folders. State and per-rank logs
live in the job's run directory under ``$DDPK_HOME/runs`` (default
``~/.local/share/ddpk/runs``).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ddpk.errors import BadInput, DdpkError
from ddpk.logs import LogLine, parse_timestamp, since_cutoff, split_timestamp
from ddpk.schedulers import local_supervisor as sup
from ddpk.schedulers.base import (
    FAILED,
    PENDING,
    JobStatus,
    Plan,
    ReplicaStatus,
    Scheduler,
)
from ddpk.schedulers.container import map_path, trainer_container
from ddpk.spec import JobSpec

LAUNCHER = "ddpk-launch"
START_TIMEOUT_S = 15.0


def ddpk_home() -> Path:
    if os.environ.get("DDPK_HOME"):
        return Path(os.environ["DDPK_HOME"])
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "ddpk"


def runs_root() -> Path:
    return ddpk_home() / "runs"


def volume_dir(value: str) -> Path:
    """A volume name is a folder under $DDPK_HOME/volumes; an absolute path is itself."""
    return Path(value) if os.path.isabs(value) else ddpk_home() / "volumes" / value


def find_launcher() -> str:
    """ddpk-launch beside the running interpreter (the same venv), else on PATH."""
    beside = Path(sys.executable).parent / LAUNCHER
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(LAUNCHER)
    if found is None:
        raise BadInput("--scheduler", f"local needs {LAUNCHER} (pip install ddpk-trainer) beside {sys.executable} or on PATH")
    return found


def host_mounts(spec: JobSpec, run_dir: Path) -> dict[str, str]:
    """Pod mount path -> host folder, as the pod's volumes would provide them."""
    mounts = {
        spec.checkpoint_mount: str(volume_dir(spec.checkpoint_pvc) if spec.checkpoint_pvc else run_dir / "checkpoints")
    }
    if spec.data_pvc:
        mounts[spec.data_mount] = str(volume_dir(spec.data_pvc))
    return mounts


def local_replicas(
    spec: JobSpec, command: list[str], env: dict[str, str], launcher: str, mounts: dict[str, str]
) -> list[dict]:
    """Each replica's argv and env: the rendered pod's, pointed at this machine."""
    argv = [launcher if command[0] == LAUNCHER else command[0]] + [map_path(a, mounts) for a in command[1:]]
    base = {k: map_path(v, mounts) for k, v in env.items()}
    base["MASTER_ADDR"] = "127.0.0.1"
    # Without --port the supervisor picks a free port for every start of the gang.
    if spec.port is None:
        base.pop("MASTER_PORT", None)
    return [
        {"index": i, "argv": argv, "env": {**base, "JOB_COMPLETION_INDEX": str(i)}} for i in range(spec.replicas)
    ]


def plan_text(replicas: list[dict], mounts: dict[str, str]) -> str:
    lines = [f"# {pod} -> {host}" for pod, host in mounts.items()]
    for r in replicas:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(r["env"].items()))
        free = "" if "MASTER_PORT" in r["env"] else " MASTER_PORT=<free port>"
        lines.append(f"{env}{free} {shlex.join(r['argv'])}")
    return "\n".join(lines)


def check_port_free(port: int) -> None:
    """Rank 0 must be able to listen on ``port`` here; a port someone holds would hang the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the rendezvous store binds: a port left in TIME_WAIT by an earlier job is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else f"not available ({exc.strerror})"
            raise BadInput("--port", f"{port} is {reason} on this machine") from None


class LocalScheduler(Scheduler):
    name = "local"

    def run_dir(self, name: str) -> Path:
        return runs_root() / name

    def dryrun(self, spec: JobSpec) -> Plan:
        run_dir = self.run_dir(spec.name)
        command, env = trainer_container(spec, "--scheduler local")
        mounts = host_mounts(spec, run_dir)
        replicas = local_replicas(spec, command, env, find_launcher(), mounts)
        payload = {
            "name": spec.name,
            "run_id": f"{spec.name}-{uuid.uuid4().hex[:12]}",
            "cwd": os.getcwd(),
            "max_restarts": spec.max_restarts,
            "port": spec.port,
            "mounts": mounts,
            "replicas": replicas,
        }
        return Plan(
            scheduler=self.name,
            spec=spec,
            where=f"local ({spec.replicas} replica(s), run dir {run_dir})",
            text=plan_text(replicas, mounts),
            payload=payload,
        )

    def schedule(self, plan: Plan, replace: bool = False) -> str:
        name = plan.spec.name
        run_dir = self.run_dir(name)
        if run_dir.exists():
            if not replace:
                phase = self.describe(name).phase
                raise BadInput("--name", f"job {name} already exists on local ({phase}); use --replace or ddpk delete {name}")
            self.delete(name)
        if plan.spec.port is not None:
            check_port_free(plan.spec.port)
        runs_root().mkdir(parents=True, exist_ok=True)
        try:
            run_dir.mkdir()
        except FileExistsError:
            raise BadInput("--name", f"job {name} was just created by another submission") from None
        (run_dir / "logs").mkdir()
        for host in plan.payload["mounts"].values():
            Path(host).mkdir(parents=True, exist_ok=True)
        sup.write_json(run_dir / "plan.json", plan.payload)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "ddpk.schedulers.local_supervisor", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=open(run_dir / "supervisor.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        launcher.wait()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (run_dir / "state.json").exists():
            if time.monotonic() > deadline:
                raise DdpkError(f"the supervisor of {name} did not start; see {run_dir / 'supervisor.log'}")
            time.sleep(0.05)
        return name

    def _read(self, name: str) -> tuple[dict, dict | None]:
        run_dir = self.run_dir(name)
        try:
            plan = json.loads((run_dir / "plan.json").read_text())
        except (OSError, ValueError):
            raise BadInput("JOB", f"no job named {name!r} on local (ddpk list shows the jobs)") from None
        try:
            state = json.loads((run_dir / "state.json").read_text())
        except (OSError, ValueError):
            state = None
        return plan, state

    def describe(self, name: str) -> JobStatus:
        plan, state = self._read(name)
        if state is None:
            return JobStatus(
                name=name,
                scheduler=self.name,
                phase=PENDING,
                replicas=[ReplicaStatus(index=r["index"], state=PENDING) for r in plan["replicas"]],
            )
        phase, reason = state["phase"], state["reason"]
        if phase not in (FAILED, "Succeeded") and not sup.alive(state["supervisor_pid"]):
            phase, reason = FAILED, f"its supervisor (pid {state['supervisor_pid']}) exited unexpectedly"
        return JobStatus(
            name=name,
            scheduler=self.name,
            phase=phase,
            replicas=[
                ReplicaStatus(
                    index=r["index"],
                    state=r["state"],
                    restarts=r["restarts"],
                    exit_code=r["exit_code"],
                    detail=f"pid {r['pid']}" if r["pid"] else "",
                )
                for r in state["replicas"]
            ],
            start_time=state["start_time"],
            completion_time=state["completion_time"],
            reason=reason,
        )

    def list(self) -> list[JobStatus]:
        root = runs_root()
        if not root.is_dir():
            return []
        jobs = []
        for run_dir in sorted(root.iterdir()):
            if (run_dir / "plan.json").is_file():
                jobs.append(self.describe(run_dir.name))
        return jobs

    def logs(
        self,
        name: str,
        rank: int | None = None,
        follow: bool = False,
        since_s: float | None = None,
        tail: int | None = None,
    ) -> Iterator[LogLine]:
        plan, _ = self._read(name)
        ranks = [r["index"] for r in plan["replicas"]] if rank is None else [rank]
        files = {i: self.run_dir(name) / "logs" / f"rank-{i}.log" for i in ranks}
        offsets = dict.fromkeys(ranks, 0)
        cutoff = since_cutoff(since_s)

        def read_new() -> list[LogLine]:
            """Complete lines appended since the last read, in time order across ranks."""
            lines = []
            for i, path in files.items():
                try:
                    with open(path, "rb") as f:
                        f.seek(offsets[i])
                        data = f.read()
                except FileNotFoundError:
                    continue
                complete = data[: data.rfind(b"\n") + 1]
                offsets[i] += len(complete)
                for raw in complete.decode("utf-8", "replace").splitlines():
                    ts, text = split_timestamp(raw)
                    if cutoff is None or (ts is not None and parse_timestamp(ts) >= cutoff):
                        lines.append(LogLine(rank=i, text=text, ts=ts))
            return lines

        first = read_new()
        if tail is not None:
            first = [ln for i in ranks for ln in [x for x in first if x.rank == i][-tail:] if tail > 0]
        yield from sorted(first, key=lambda ln: ln.ts or "")
        while follow:
            done = self.describe(name).terminal
            yield from sorted(read_new(), key=lambda ln: ln.ts or "")
            if done:
                return
            time.sleep(0.2)

    def stop(self, name: str, reason: str) -> None:
        """End every process of the job; the supervisor records ``reason``."""
        plan, state = self._read(name)
        run_dir = self.run_dir(name)
        if state is not None and sup.alive(state["supervisor_pid"]):
            (run_dir / "stop").write_text(reason + "\n")
            os.kill(state["supervisor_pid"], signal.SIGTERM)
            deadline = time.monotonic() + sup.STOP_GRACE_S + 10
            try:
                while sup.alive(state["supervisor_pid"]) and time.monotonic() < deadline:
                    time.sleep(0.1)
            except KeyboardInterrupt:
                self._kill_all(plan, state)
                raise
        self._kill_all(plan, state)

    def _kill_all(self, plan: dict, state: dict | None) -> None:
        """The sweep that leaves nothing behind, even when the supervisor is gone."""
        if state is not None and sup.alive(state["supervisor_pid"]):
            os.kill(state["supervisor_pid"], signal.SIGKILL)
        # Recorded pids may be stale and reused; the marker only matches this run's processes.
        sup.kill_run(plan["run_id"], [], signal.SIGKILL)

    def delete(self, name: str, volumes: bool = False) -> None:
        self.stop(name, f"deleted by ddpk delete {name}")
        shutil.rmtree(self.run_dir(name))

    def interrupted(self, name: str) -> str | None:
        self.stop(name, "interrupted (Ctrl-C)")
        return f"stopped job {name}: every process of it has ended"


SCHEDULER = LocalScheduler
