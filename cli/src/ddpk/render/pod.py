"""The pod every Kubernetes target runs, and the trainer container the local and docker schedulers execute.

One function builds each piece, so the Indexed Job, PyTorchJob and JobSet pods differ
only where their controllers demand it (container name, restart policy, subdomain).
"""

from __future__ import annotations

from typing import Any

from ddpk.render.policy import CONTAINER
from ddpk.spec import JobSpec, parse_toleration

APP = "ddpk"
RUN_AS = 10001
"""The image's numeric non-root user (docker/Dockerfile), so runAsNonRoot is verifiable."""
GPU_RESOURCE = "nvidia.com/gpu"
PORT_NAME = "rdzv"


def labels(spec: JobSpec, component: str = "trainer", workload: bool = False) -> dict[str, str]:
    """The app.kubernetes.io recommended labels; on the workload object, Kueue's queue label when a queue is given.

    Kueue admits the top-level workload (Job, PyTorchJob, JobSet) as a whole; the label
    stays off pods, child Jobs and the Service so nothing else is queued on its own.
    """
    out = {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": APP,
        "app.kubernetes.io/managed-by": APP,
    }
    if workload and spec.queue:
        out["kueue.x-k8s.io/queue-name"] = spec.queue
    return out


def selector_labels(spec: JobSpec) -> dict[str, str]:
    """Labels that pick exactly this job's trainer pods (no other ddpk job, no other component)."""
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": "trainer",
    }


def selector(spec: JobSpec) -> str:
    """``selector_labels`` as a label-selector string for list/watch calls."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(spec).items())


def metadata(spec: JobSpec, name: str | None = None, component: str = "trainer",
             workload: bool = False) -> dict[str, Any]:
    return {"name": name or spec.name, "namespace": spec.namespace, "labels": labels(spec, component, workload)}


def launch_command(spec: JobSpec) -> list[str]:
    """The container command: the launcher, its rendezvous bound, then the trainer's arguments."""
    return ["ddpk-launch", "--rdzv-timeout", str(spec.rdzv_timeout_s), "--", *spec.trainer_args]


def pod_env(spec: JobSpec, master_addr: str | None) -> dict[str, str]:
    """Plain env of every pod, in order; ``master_addr`` None leaves MASTER_ADDR/PORT to an operator."""
    env: dict[str, str] = {}
    if master_addr is not None:
        env["MASTER_ADDR"] = master_addr
        env["MASTER_PORT"] = str(spec.master_port)
    env["DDPK_NNODES"] = str(spec.replicas)
    env["DDPK_NPROC_PER_NODE"] = spec.nproc_per_node
    env["DDPK_CHECKPOINT_DIR"] = spec.checkpoint_mount
    env["DDPK_METRICS_FILE"] = f"{spec.checkpoint_mount}/metrics.jsonl"
    if spec.data_pvc is not None:
        env["DDPK_DATA_DIR"] = spec.data_mount
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.env)
    return env


def resources(spec: JobSpec) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", spec.cpu_request), ("memory", spec.memory_request)) if v is not None}
    limits = {k: v for k, v in (("cpu", spec.cpu_limit), ("memory", spec.memory_limit)) if v is not None}
    if spec.gpus_per_replica:
        # Extended resources are limits only; Kubernetes sets the request equal.
        limits[GPU_RESOURCE] = str(spec.gpus_per_replica)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def volumes(spec: JobSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        # NCCL and DataLoader workers need far more shared memory than the runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        # The root filesystem is read-only; scratch space lives here.
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.checkpoint_pvc:
        out.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint_pvc}})
    else:
        # Survives container restarts in the same pod only; a PVC survives pod replacement.
        out.append({"name": "checkpoints", "emptyDir": {}})
    if spec.data_pvc:
        out.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data_pvc, "readOnly": True}})
    return out


def volume_mounts(spec: JobSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "checkpoints", "mountPath": spec.checkpoint_mount},
    ]
    if spec.data_pvc:
        out.append({"name": "data", "mountPath": spec.data_mount, "readOnly": True})
    return out


def container(
    spec: JobSpec, master_addr: str | None, name: str = CONTAINER, port_name: str = PORT_NAME
) -> dict[str, Any]:
    """The trainer container: command, env (secrets by reference only), resources, mounts, hardening."""
    out: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": launch_command(spec),
        "env": [{"name": k, "value": v} for k, v in pod_env(spec, master_addr).items()],
    }
    if spec.env_from_secrets:
        out["envFrom"] = [{"secretRef": {"name": secret}} for secret in spec.env_from_secrets]
    out["ports"] = [{"name": port_name, "containerPort": spec.master_port, "protocol": "TCP"}]
    res = resources(spec)
    if res:
        out["resources"] = res
    out["volumeMounts"] = volume_mounts(spec)
    out["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return out


def pod_spec(spec: JobSpec, master_addr: str | None, restart_policy: str, *,
             subdomain: str | None = None, container_name: str = CONTAINER,
             port_name: str = PORT_NAME) -> dict[str, Any]:
    out: dict[str, Any] = {"restartPolicy": restart_policy}
    if subdomain is not None:
        out["subdomain"] = subdomain
    out["automountServiceAccountToken"] = False
    # Thousands of *_SERVICE_HOST variables help nobody and slow container start.
    out["enableServiceLinks"] = False
    if spec.service_account:
        out["serviceAccountName"] = spec.service_account
    if spec.priority_class:
        out["priorityClassName"] = spec.priority_class
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [parse_toleration(t) for t in spec.tolerations]
    out["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        # Makes PVCs and emptyDirs writable for the non-root user.
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    out["containers"] = [container(spec, master_addr, container_name, port_name)]
    out["volumes"] = volumes(spec)
    return out
