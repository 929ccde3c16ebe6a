"""The rendered trainer container, as the local and docker schedulers run it.

They take the Indexed Job's container (``ddpk.render.trainer_container``)
rather than building their own, so what runs here is what the cluster runs.
"""

from __future__ import annotations

import os

from ddpk.errors import BadInput
from ddpk.spec import JobSpec


def trainer_container(spec: JobSpec, where: str) -> tuple[list[str], dict[str, str]]:
    """The rendered command and plain env; secrets by reference only exist on Kubernetes."""
    from ddpk import render

    container = render.trainer_container(spec)
    if container.get("envFrom"):
        raise BadInput("--env-from-secret", f"Kubernetes secrets cannot be read by {where}; pass values with --env")
    env = {item["name"]: item["value"] for item in container["env"]}
    # Every replica here shares this machine's cores, as pods share a node under CPU limits.
    # Without a budget each launcher gives its ranks all cores and they oversubscribe them
    # (the 2-replica demo runs about 3x slower). --env OMP_NUM_THREADS=N overrides it.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.replicas)))
    return list(container["command"]), env


def map_path(value: str, mounts: dict[str, str]) -> str:
    """Rewrite a pod path under a mount point to the host folder behind it."""
    for pod_path, host_path in mounts.items():
        if value == pod_path or value.startswith(pod_path + "/"):
            return host_path + value[len(pod_path):]
    return value
