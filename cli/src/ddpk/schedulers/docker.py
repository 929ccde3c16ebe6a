"""Run a job as containers on one Docker engine, the way the cluster runs its pods.

One user-defined network per job; container ``<job>-<i>`` has hostname
``<job>-<i>`` and the alias ``<job>-<i>.<service>``, so the rendered
``MASTER_ADDR`` resolves as pod DNS does. Each runs the rendered command and
env (entrypoint ddpk-launch) as the image's non-root user, hardened like the
pod (read-only root, /tmp as tmpfs, no capabilities, no new privileges).
A detached supervisor (``docker_supervisor``, the local scheduler's gang loop)
restarts the whole gang in place when any replica fails, and writes the job's
phase, reason and restart counts to ``$DDPK_HOME/docker/<job>/state.json``,
which ``describe`` reads beside the containers. The Docker SDK is imported
only here and in the supervisor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpk.errors import BadInput, DdpkError, Unreachable
from ddpk.logs import LogLine, follow_resumable, iter_lines, merge, parse_timestamp, split_timestamp
from ddpk.quantity import parse_quantity
from ddpk.schedulers.base import (
    FAILED,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PENDING,
    RUNNING,
    SUCCEEDED,
    JobStatus,
    Plan,
    ReplicaStatus,
    Scheduler,
)
from ddpk.schedulers import local_supervisor as sup
from ddpk.schedulers.container import trainer_container
from ddpk.schedulers.local import ddpk_home
from ddpk.spec import JobSpec

JOB_LABEL = "ddpk.job"
INDEX_LABEL = "ddpk.index"
USER_ERROR = 2
STOP_TIMEOUT_S = 10
START_TIMEOUT_S = 30.0
SUPERVISOR = "ddpk.schedulers.docker_supervisor"
RESTART_POLICY = {"Name": "no"}
"""The supervisor is the one restarter. The engine's on-failure would restart a crashed
container on its own, racing the supervisor's stop-and-start of the gang, would retry
exit 2, and skips a container stopped with docker kill anyway."""


def state_root() -> Path:
    return ddpk_home() / "docker"


def volume_source(value: str) -> tuple[str, str]:
    """("bind", path) for an absolute host path, else ("volume", name)."""
    return ("bind", value) if os.path.isabs(value) else ("volume", value)


def container_plans(spec: JobSpec, command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Everything the engine is asked to create, as plain data (printable, no SDK objects)."""
    labels = {MANAGED_BY_LABEL: MANAGED_BY, JOB_LABEL: spec.name}
    kind, source = volume_source(spec.checkpoint_pvc) if spec.checkpoint_pvc else ("volume", f"{spec.name}-checkpoints")
    mounts = [{"type": kind, "source": source, "target": spec.checkpoint_mount, "read_only": False}]
    if spec.data_pvc:
        kind, source = volume_source(spec.data_pvc)
        mounts.append({"type": kind, "source": source, "target": spec.data_mount, "read_only": True})
    resources: dict[str, Any] = {}
    if spec.cpu_limit:
        resources["nano_cpus"] = int(parse_quantity(spec.cpu_limit, "--cpu-limit") * 10**9)
    if spec.memory_limit:
        resources["mem_limit"] = int(parse_quantity(spec.memory_limit, "--memory-limit"))
    containers = []
    for i in range(spec.replicas):
        host = f"{spec.name}-{i}"
        containers.append({
            "name": host,
            "hostname": host,
            "image": spec.image,
            "entrypoint": command[:1],
            "command": command[1:],
            "environment": {**env, "JOB_COMPLETION_INDEX": str(i)},
            "labels": {**labels, INDEX_LABEL: str(i)},
            "aliases": [f"{host}.{spec.service_name}"],
            "shm_size": int(parse_quantity(spec.shm_size, "--shm-size")),
            "restart_policy": RESTART_POLICY,
            "mounts": mounts,
            "gpus": spec.gpus_per_replica,
            "read_only": True,
            "tmpfs": {"/tmp": ""},
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            **resources,
        })
    return {
        "network": spec.name,
        "labels": labels,
        "volumes": sorted({m["source"] for m in mounts if m["type"] == "volume" and not m["read_only"]}),
        "containers": containers,
    }


def plan_text(payload: dict[str, Any]) -> str:
    lines = [f"network {payload['network']}"]
    lines += [f"volume {v}" for v in payload["volumes"]]
    for c in payload["containers"]:
        env = " ".join(f"-e {k}={v}" for k, v in c["environment"].items())
        mounts = " ".join(f"--mount type={m['type']},src={m['source']},dst={m['target']}{',ro' if m['read_only'] else ''}"
                          for m in c["mounts"])
        lines.append(
            f"container {c['name']}: --hostname {c['hostname']} --network-alias {c['aliases'][0]} "
            f"--shm-size {c['shm_size']} --restart {c['restart_policy']['Name']} "
            f"{mounts} {env} --entrypoint {c['entrypoint'][0]} {c['image']} {' '.join(c['command'])}"
        )
    return "\n".join(lines)


def replica_state(attrs: dict) -> ReplicaStatus:
    """One container's state as a replica."""
    st = attrs.get("State", {})
    status, code = st.get("Status", "created"), st.get("ExitCode")
    finished = status in ("exited", "dead")
    if status == "running":
        state = RUNNING
    elif finished:
        state = SUCCEEDED if code == 0 else FAILED
    else:
        state = PENDING
    return ReplicaStatus(
        index=int(attrs["Config"]["Labels"].get(INDEX_LABEL, 0)),
        state=state,
        exit_code=code if finished else None,
        detail=attrs.get("Name", "").lstrip("/"),
    )


def containers_phase(replicas: list[ReplicaStatus]) -> tuple[str, str | None]:
    """The phase the containers alone show, for a job whose supervisor state is not here."""
    failed = [r for r in replicas if r.state == FAILED]
    if failed:
        r = next((r for r in failed if r.exit_code == USER_ERROR), failed[0])
        what = "a user error, not retried" if r.exit_code == USER_ERROR else "no supervisor state to restart it"
        return FAILED, f"replica {r.index} exited with code {r.exit_code}: {what}"
    if replicas and all(r.state == SUCCEEDED for r in replicas):
        return SUCCEEDED, None
    if any(r.state == RUNNING for r in replicas):
        return RUNNING, None
    return PENDING, None


def job_state(name: str, containers: list[dict], state: dict | None, supervised: bool) -> JobStatus:
    """The job's status: phase, reason and restarts from the supervisor's state, the rest from the containers.

    ``supervised`` says whether the supervisor still runs; a job it left unfinished failed.
    """
    replicas = sorted((replica_state(a) for a in containers), key=lambda r: r.index)
    if state is None:
        phase, reason = containers_phase(replicas)
        times = [a.get("State", {}) for a in containers]
        started = sorted(t["StartedAt"] for t in times if t.get("StartedAt", "").startswith("2"))
        ended = sorted(t["FinishedAt"] for t in times if t.get("FinishedAt", "").startswith("2"))
        start_time = started[0] if started else None
        completion_time = ended[-1] if ended and phase in (SUCCEEDED, FAILED) else None
    else:
        recorded = {r["index"]: r for r in state["replicas"]}
        replicas = [
            dataclasses.replace(
                r,
                restarts=recorded.get(r.index, {}).get("restarts", 0),
                exit_code=r.exit_code if r.exit_code is not None else recorded.get(r.index, {}).get("exit_code"),
            )
            for r in replicas
        ]
        phase, reason = state["phase"], state["reason"]
        if phase not in (SUCCEEDED, FAILED) and not supervised:
            phase = FAILED
            reason = f"its supervisor (pid {state['supervisor_pid']}) is gone; nothing restarts the replicas"
        start_time, completion_time = state["start_time"], state["completion_time"]
    return JobStatus(
        name=name,
        scheduler="docker",
        phase=phase,
        replicas=replicas,
        start_time=start_time,
        completion_time=completion_time,
        reason=reason,
    )


def supervisor_alive(state: dict, state_dir: Path) -> bool:
    """The recorded pid still runs this job's supervisor (not a process that reused the pid)."""
    pid = state["supervisor_pid"]
    if not sup.alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return SUPERVISOR.encode() in argv and str(state_dir).encode() in argv


class DockerScheduler(Scheduler):
    name = "docker"

    def __init__(self, options=None):
        super().__init__(options)
        self._client = None

    @property
    def client(self):
        if self._client is None:
            import docker

            try:
                self._client = docker.from_env()
                self._client.ping()
            except docker.errors.DockerException as exc:
                where = os.environ.get("DOCKER_HOST") or "the local socket"
                reason = str(exc).splitlines()[0][:200]
                raise Unreachable(f"Docker engine not reachable at {where}: {reason} (start dockerd or set DOCKER_HOST)") from None
        return self._client

    def _errors(self):
        import docker

        return docker.errors

    def dryrun(self, spec: JobSpec) -> Plan:
        command, env = trainer_container(spec, "--scheduler docker")
        payload = container_plans(spec, command, env)
        payload["pull_policy"] = spec.image_pull_policy
        payload["max_restarts"] = spec.max_restarts
        where = f"docker ({spec.replicas} container(s) of {spec.image} on network {spec.name})"
        return Plan(scheduler=self.name, spec=spec, where=where, text=plan_text(payload), payload=payload)

    def _networks(self, name: str) -> list:
        # The engine's name filter matches substrings; only the exact name is this job's.
        return [n for n in self.client.networks.list(names=[name]) if n.name == name]

    def _containers(self, name: str) -> list:
        return self.client.containers.list(all=True, filters={"label": [f"{JOB_LABEL}={name}"]})

    def _ensure_image(self, image: str, policy: str) -> None:
        errors = self._errors()
        try:
            if policy == "Always":
                raise errors.ImageNotFound(image)
            self.client.images.get(image)
        except errors.ImageNotFound:
            if policy == "Never":
                raise BadInput("--image", f"{image} is not in the Docker engine and --image-pull-policy is Never") from None
            try:
                self.client.images.pull(image)
            except errors.DockerException as exc:
                reason = getattr(exc, "explanation", None) or str(exc)
                raise BadInput("--image", f"{image} is not in the Docker engine and pulling it failed "
                                          f"(build it, e.g. make image-cpu): {reason.splitlines()[0][:120]}") from None

    def state_dir(self, name: str) -> Path:
        return state_root() / name

    def schedule(self, plan: Plan, replace: bool = False) -> str:
        name = plan.spec.name
        payload = plan.payload
        errors = self._errors()
        existing = self._containers(name)
        network_exists = bool(self._networks(payload["network"]))
        if existing or network_exists or self.state_dir(name).exists():
            if not replace:
                raise BadInput("--name", f"job {name} already exists on docker; use --replace or ddpk delete {name} -s docker")
            self.delete(name)
        self._ensure_image(plan.spec.image, payload["pull_policy"])
        for c in payload["containers"][:1]:
            for m in c["mounts"]:
                if m["type"] == "bind" and not m["read_only"]:
                    os.makedirs(m["source"], exist_ok=True)
        created = []
        network = None
        try:
            network = self.client.networks.create(payload["network"], driver="bridge", labels=payload["labels"])
            for volume in payload["volumes"]:
                try:
                    self.client.volumes.get(volume)
                except errors.NotFound:
                    self.client.volumes.create(volume, labels=payload["labels"])
            for c in payload["containers"]:
                created.append(self._create(c, payload["network"]))
            for container in created:
                container.start()
            self._supervise(name, len(created), payload["max_restarts"])
        except BaseException:
            # Nothing half-applied: a job that could not start leaves no container, network or state.
            self._end_supervisor(name)
            for container in created:
                container.remove(force=True)
            if network is not None:
                network.remove()
            shutil.rmtree(self.state_dir(name), ignore_errors=True)
            raise
        return name

    def _supervise(self, name: str, replicas: int, max_restarts: int) -> None:
        """Start the job's detached supervisor and wait until it has written its state."""
        state_dir = self.state_dir(name)
        state_dir.mkdir(parents=True)
        sup.write_json(state_dir / "plan.json", {"name": name, "replicas": replicas, "max_restarts": max_restarts})
        with open(state_dir / "supervisor.log", "ab") as log:
            # It forks again and the first child exits at once: waiting here reaps it.
            subprocess.run([sys.executable, "-m", SUPERVISOR, str(state_dir)], stdin=subprocess.DEVNULL,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, check=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (state_dir / "state.json").exists():
            if time.monotonic() > deadline:
                raise DdpkError(f"the supervisor of {name} did not start; see {state_dir / 'supervisor.log'}")
            time.sleep(0.05)

    def _state(self, name: str) -> tuple[dict | None, bool]:
        """The supervisor's state (None when this DDPK_HOME has none) and whether it still runs."""
        state_dir = self.state_dir(name)
        try:
            state = json.loads((state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None, False
        return state, supervisor_alive(state, state_dir)

    def _end_supervisor(self, name: str) -> None:
        """SIGKILL the job's supervisor, so that it restarts nothing while the containers go."""
        state, running = self._state(name)
        if not running:
            return
        pid = state["supervisor_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while sup.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _create(self, c: dict, network: str):
        from docker.types import DeviceRequest, Mount

        kwargs: dict[str, Any] = {
            k: c[k] for k in ("name", "hostname", "entrypoint", "command", "environment", "labels",
                              "shm_size", "restart_policy", "read_only", "tmpfs", "cap_drop", "security_opt")
        }
        kwargs.update({k: c[k] for k in ("nano_cpus", "mem_limit") if k in c})
        kwargs["mounts"] = [Mount(m["target"], m["source"], type=m["type"], read_only=m["read_only"]) for m in c["mounts"]]
        if c["gpus"]:
            kwargs["device_requests"] = [DeviceRequest(count=c["gpus"], capabilities=[["gpu"]])]
        endpoint = self.client.api.create_endpoint_config(aliases=c["aliases"])
        try:
            return self.client.containers.create(c["image"], network=network, networking_config={network: endpoint}, **kwargs)
        except self._errors().APIError as exc:
            raise DdpkError(f"Docker could not create {c['name']}: {exc.explanation or exc}") from None

    def describe(self, name: str) -> JobStatus:
        containers = self._containers(name)
        if not containers:
            raise BadInput("JOB", f"no job named {name!r} on docker (ddpk list -s docker shows the jobs)")
        return job_state(name, [c.attrs for c in containers], *self._state(name))

    def list(self) -> list[JobStatus]:
        by_job: dict[str, list] = {}
        for c in self.client.containers.list(all=True, filters={"label": [f"{MANAGED_BY_LABEL}={MANAGED_BY}"]}):
            by_job.setdefault(c.labels.get(JOB_LABEL, ""), []).append(c)
        return [job_state(job, [c.attrs for c in cs], *self._state(job)) for job, cs in sorted(by_job.items())]

    def logs(self, name: str, rank: int | None = None, follow: bool = False,
             since_s: float | None = None, tail: int | None = None) -> Iterator[LogLine]:
        containers = sorted(self._containers(name), key=lambda c: int(c.labels.get(INDEX_LABEL, 0)))
        if not containers:
            raise BadInput("JOB", f"no job named {name!r} on docker")
        if rank is not None:
            containers = [c for c in containers if int(c.labels.get(INDEX_LABEL, 0)) == rank]
        since = time.time() - since_s if since_s is not None else None
        if not follow:
            lines = []
            for c in containers:
                for raw in iter_lines([c.logs(timestamps=True, since=since, tail="all" if tail is None else tail)]):
                    ts, text = split_timestamp(raw)
                    lines.append(LogLine(int(c.labels.get(INDEX_LABEL, 0)), text, ts))
            yield from sorted(lines, key=lambda ln: parse_timestamp(ln.ts) if ln.ts else 0)
            return
        done = threading.Event()
        streams = [self._follow_container(c, since, tail, done) for c in containers]
        try:
            yield from merge(streams + [self._watch(name, done)])
        finally:
            done.set()

    def _watch(self, name: str, done: threading.Event) -> Iterator[LogLine]:
        """Ends the follow when the job is Succeeded or Failed; the container streams then drain.

        A failed job's surviving replicas are stopped here (the supervisor does so too
        while it runs), so that no stream waits on a replica that waits on a dead peer.
        """
        while not done.is_set():
            status = self.describe(name)
            if status.terminal:
                if status.phase == FAILED:
                    self._stop(name)
                break
            time.sleep(1)
        done.set()
        yield from ()

    def _follow_container(self, container, since: float | None, tail: int | None,
                          done: threading.Event) -> Iterator[LogLine]:
        index = int(container.labels.get(INDEX_LABEL, 0))
        errors = self._errors()
        first = True

        def open_stream(resume: str | None):
            nonlocal first
            if resume is not None:
                # A float may round up past the last line; start 1 ms early and let timestamps drop repeats.
                start: Any = parse_timestamp(resume) / 1e9 - 0.001
            else:
                start = since
            opts: dict[str, Any] = {"stream": True, "follow": True, "timestamps": True, "since": start}
            if first and tail is not None:
                opts["tail"] = tail
            first = False
            try:
                yield from iter_lines(container.logs(**opts))
            except errors.NotFound:
                return

        def finished() -> bool:
            try:
                container.reload()
            except errors.NotFound:
                return True
            return done.is_set() and container.status not in ("running", "restarting")

        for ts, text in follow_resumable(open_stream, finished, (errors.DockerException, OSError)):
            yield LogLine(index, text, ts)

    def wait(self, name: str, timeout: float | None = None, poll_s: float = 1.0) -> JobStatus:
        status = super().wait(name, timeout, poll_s)
        if status.phase == FAILED:
            # Like the Job controller: a failed job's other replicas are stopped, not left to wait for a
            # peer, also when its supervisor is gone.
            self._stop(name)
        return status

    def _stop(self, name: str) -> None:
        for c in self._containers(name):
            if c.status == "running":
                c.stop(timeout=STOP_TIMEOUT_S)

    def delete(self, name: str, volumes: bool = False) -> None:
        errors = self._errors()
        containers = self._containers(name)
        networks = self._networks(name)
        owned_volumes = self.client.volumes.list(filters={"label": [f"{JOB_LABEL}={name}"]}) if volumes else []
        state_dir = self.state_dir(name)
        if not containers and not networks and not owned_volumes and not state_dir.exists():
            raise BadInput("JOB", f"no job named {name!r} on docker")
        self._end_supervisor(name)
        for c in containers:
            try:
                c.remove(force=True)
            except errors.NotFound:
                pass
        for n in networks:
            n.remove()
        for v in owned_volumes:
            v.remove()
        shutil.rmtree(state_dir, ignore_errors=True)


SCHEDULER = DockerScheduler
