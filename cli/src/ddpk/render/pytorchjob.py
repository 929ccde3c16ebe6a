"""Kubeflow ``PyTorchJob`` (kubeflow.org/v1): Master ×1 and Worker × (replicas − 1).

The training operator, not ddpk, wires the rendezvous: it creates a Service per pod,
and injects MASTER_ADDR (``<job>-master-0``), MASTER_PORT (the Master container's port
named ``pytorchjob-port``), RANK (the node rank), WORLD_SIZE (nodes × nprocPerNode),
PET_NNODES and PET_NPROC_PER_NODE, which the launcher reads. It finds that port only in
a container named ``pytorch``, so here the trainer container carries that name.
"""

from __future__ import annotations

from typing import Any

from ddpk.render import pod
from ddpk.render.policy import pytorchjob_policy
from ddpk.spec import JobSpec

CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"


def hostname(spec: JobSpec, index: int) -> str:
    """The operator's pod and Service name for node rank ``index``."""
    return f"{spec.name}-master-0" if index == 0 else f"{spec.name}-worker-{index - 1}"


def master_addr(spec: JobSpec) -> str:
    return hostname(spec, 0)


def nproc_per_node(spec: JobSpec) -> str:
    """An explicit integer: the operator counts anything else ("auto") as 1 in WORLD_SIZE."""
    if spec.nproc_per_node != "auto":
        return spec.nproc_per_node
    return str(spec.gpus_per_replica or 1)


def _replica(spec: JobSpec, replicas: int) -> dict[str, Any]:
    policy = pytorchjob_policy(spec)
    return {
        "replicas": replicas,
        **policy["replica"],
        "template": {
            "metadata": {"labels": pod.labels(spec)},
            "spec": pod.pod_spec(
                spec, None, policy["pod"]["restartPolicy"], container_name=CONTAINER, port_name=PORT_NAME
            ),
        },
    }


def render(spec: JobSpec) -> list[dict[str, Any]]:
    replica_specs = {"Master": _replica(spec, 1)}
    if spec.replicas > 1:
        replica_specs["Worker"] = _replica(spec, spec.replicas - 1)
    run_policy: dict[str, Any] = {
        # Keep finished pods until the TTL so their logs stay readable.
        "cleanPodPolicy": "None",
        **pytorchjob_policy(spec)["runPolicy"],
    }
    if spec.active_deadline_s is not None:
        run_policy["activeDeadlineSeconds"] = spec.active_deadline_s
    if spec.ttl_after_finished_s is not None:
        run_policy["ttlSecondsAfterFinished"] = spec.ttl_after_finished_s
    return [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": pod.metadata(spec, workload=True),
            "spec": {
                "nprocPerNode": nproc_per_node(spec),
                "runPolicy": run_policy,
                "pytorchReplicaSpecs": replica_specs,
            },
        }
    ]


def hostnames(spec: JobSpec) -> list[str]:
    return [hostname(spec, spec.replicas - 1)]
