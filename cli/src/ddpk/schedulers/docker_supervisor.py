"""The detached process that owns one docker job's containers.

``python -m ddpk.schedulers.docker_supervisor STATE_DIR`` detaches like the
local supervisor and runs the same gang loop (``local_supervisor.Gang``) over
the containers labelled with the job named in ``STATE_DIR/plan.json``, which
``schedule`` created and started. It polls them; when one exits non-zero,
whether it crashed or was stopped with ``docker kill`` (which Docker's own
restart policy would leave dead), it stops the others and starts every
container of the gang again in place: same container, hostname, alias and
network, so ``MASTER_ADDR`` still resolves. Exit 2 fails the job at once.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddpk.logs import now_timestamp
from ddpk.schedulers.docker import INDEX_LABEL, JOB_LABEL
from ddpk.schedulers.local_supervisor import STOP_GRACE_S, Gang, detach

MODULE = "ddpk.schedulers.docker_supervisor"
FINISHED = ("exited", "dead")


class ContainersLost(Exception):
    """A container of the gang was removed behind ddpk's back: nothing is left to restart."""


def index_of(container) -> int:
    return int(container.labels.get(INDEX_LABEL, 0))


class DockerGang(Gang):
    poll_s = 0.5
    """Each poll is one list call and one inspect per container; a replica's death is seen within it."""

    def __init__(self, state_dir: Path):
        import docker

        plan = json.loads((state_dir / "plan.json").read_text())
        super().__init__(state_dir, plan["name"], plan["replicas"], plan["max_restarts"])
        self.client = docker.from_env()

    def containers(self) -> list:
        name, replicas = self.state["name"], len(self.state["replicas"])
        found = self.client.containers.list(all=True, filters={"label": [f"{JOB_LABEL}={name}"]})
        found.sort(key=index_of)
        if [index_of(c) for c in found] != list(range(replicas)):
            raise ContainersLost(f"a container of {name} was removed outside ddpk")
        return found

    def start_gang(self) -> None:
        for c in self.containers():
            c.start()

    def stop_gang(self) -> None:
        # docker stop is TERM, the grace period, then KILL; all at once, so the gang waits one grace period.
        running = [c for c in self.containers() if c.status not in FINISHED]
        with ThreadPoolExecutor(max_workers=max(1, len(running))) as pool:
            list(pool.map(lambda c: c.stop(timeout=int(STOP_GRACE_S)), running))

    def exit_codes(self) -> list[int | None]:
        return [c.attrs["State"]["ExitCode"] if c.status in FINISHED else None for c in self.containers()]


def main(argv: list[str]) -> int:
    state_dir = Path(argv[0])
    detach()
    gang = DockerGang(state_dir)
    gang.save()
    try:
        # schedule started the containers; it reports a container that cannot start as an error.
        return gang.run(start=False)
    except Exception as exc:  # an engine that went away, a container removed: say so instead of looking alive
        gang.state.update(phase="Failed", reason=f"supervision ended: {str(exc)[:300]}",
                          completion_time=now_timestamp())
        gang.save()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
