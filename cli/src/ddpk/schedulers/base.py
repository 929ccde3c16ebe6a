"""The one small interface every scheduler implements.

TorchX's verb set: ``dryrun`` turns a spec into a printable plan with no side
effects at all; ``schedule`` acts on that plan and nothing else; ``describe``,
``list``, ``logs``, ``delete`` and ``wait`` act on a job by name. Backends live
in one module each and import their SDKs lazily, so ``ddpk --help``, ``render``
and ``submit --dry-run`` stay fast.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ddpk.errors import DdpkError, JobFailed
from ddpk.logs import LogLine
from ddpk.spec import JobSpec

SCHEDULERS = ("local", "docker", "kubernetes")

PENDING = "Pending"
RUNNING = "Running"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
TERMINAL = (SUCCEEDED, FAILED)

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "ddpk"


@dataclass
class ReplicaStatus:
    index: int
    """Replica (node) index, which is also the ``[rank i]`` of its log lines."""
    state: str
    """Pending, Running, Succeeded, Failed or Restarting."""
    restarts: int = 0
    """How many times this replica was started again after a failure."""
    exit_code: int | None = None
    """Exit code of the replica's last finished run, if any."""
    detail: str = ""
    """Where it runs: a pid, a container or a pod name, or why it waits."""


@dataclass
class JobStatus:
    name: str
    scheduler: str
    phase: str
    """Pending, Running, Succeeded or Failed."""
    replicas: list[ReplicaStatus] = field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    reason: str | None = None
    """Why the job failed or why it still waits, in the backend's words."""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    """What ``schedule`` will do: the printable result of a dry run."""

    scheduler: str
    spec: JobSpec
    where: str
    """One phrase saying where the job goes, for the first output line."""
    text: str
    """What would be applied or run, as the user sees it with ``--dry-run``."""
    payload: Any = None
    """The backend's own description of the actions (objects, containers, commands)."""

    def __str__(self) -> str:
        return self.text


@dataclass
class Options:
    """Connection options shared by all commands; each backend reads what it needs."""

    namespace: str = "default"
    context: str | None = None
    kubeconfig: str | None = None
    validate: str = "client"


class Scheduler(ABC):
    name: str = ""

    def __init__(self, options: Options | None = None):
        self.options = options or Options()

    @abstractmethod
    def dryrun(self, spec: JobSpec) -> Plan:
        """Everything ``schedule`` needs, decided without touching anything."""

    @abstractmethod
    def schedule(self, plan: Plan, replace: bool = False) -> str:
        """Start the planned job; with ``replace`` delete a job of the same name first."""

    @abstractmethod
    def describe(self, name: str) -> JobStatus:
        """The job's status; raises BadInput naming JOB when there is no such job."""

    @abstractmethod
    def list(self) -> list[JobStatus]:
        """Jobs this tool started on this scheduler."""

    @abstractmethod
    def logs(
        self,
        name: str,
        rank: int | None = None,
        follow: bool = False,
        since_s: float | None = None,
        tail: int | None = None,
    ) -> Iterator[LogLine]:
        """All ranks' lines; with ``follow`` until the job is Succeeded or Failed."""

    @abstractmethod
    def delete(self, name: str, volumes: bool = False) -> None:
        """Stop the job and remove what it created; named volumes only with ``volumes``."""

    def interrupted(self, name: str) -> str | None:
        """Ctrl-C while following the job; returns a line for the user, if any."""
        return f"stopped following {name}; it keeps running (ddpk delete {name} ends it)"

    def wait(self, name: str, timeout: float | None = None, poll_s: float = 1.0) -> JobStatus:
        """Block until the job is Succeeded or Failed; raise after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.describe(name)
            if status.terminal:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise DdpkError(f"job {name} is still {status.phase} after {timeout:g}s")
            time.sleep(poll_s)


def result(status: JobStatus) -> int:
    """Exit with the job's result: 0 when it succeeded, JobFailed (1) otherwise."""
    if status.phase == SUCCEEDED:
        return 0
    raise JobFailed(f"job {status.name} {status.phase.lower()}: {status.reason or 'no reason given'}")


def get_scheduler(name: str, options: Options | None = None) -> Scheduler:
    """The backend called ``name``, importing only its module."""
    module = importlib.import_module(f"ddpk.schedulers.{name}")
    return module.SCHEDULER(options)
