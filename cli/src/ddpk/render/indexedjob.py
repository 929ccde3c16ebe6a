"""The default target: a headless Service and an Indexed ``batch/v1`` Job (DESIGN.md, per-pod contract)."""

from __future__ import annotations

from typing import Any

from ddpk.render import pod
from ddpk.render.policy import indexedjob_policy
from ddpk.spec import JobSpec


def hostname(spec: JobSpec, index: int) -> str:
    """The Job controller names pod *i*'s hostname ``<job>-<i>`` when the pod has a subdomain."""
    return f"{spec.name}-{index}"


def master_addr(spec: JobSpec) -> str:
    return f"{hostname(spec, 0)}.{spec.service_name}"


def service(spec: JobSpec) -> dict[str, Any]:
    """Headless, and publishing addresses before readiness: rank 0 must resolve while still starting."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pod.metadata(spec, spec.service_name, component="rendezvous"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": pod.selector_labels(spec),
            "ports": [{"name": pod.PORT_NAME, "port": spec.master_port, "targetPort": spec.master_port, "protocol": "TCP"}],
        },
    }


def pod_template(spec: JobSpec) -> dict[str, Any]:
    policy = indexedjob_policy(spec)
    return {
        "metadata": {"labels": pod.labels(spec)},
        "spec": pod.pod_spec(spec, master_addr(spec), policy["pod"]["restartPolicy"], subdomain=spec.service_name),
    }


def indexed_job_spec(
    spec: JobSpec, job_policy: dict[str, Any], template: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    """An Indexed Job's spec, also JobSet's replicated job: one pod per node, its completion index the node rank.

    ``fields`` go just before the (long) template, where a reader of the YAML still sees them.
    """
    body: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.replicas,
        "parallelism": spec.replicas,
        **job_policy,
    }
    if spec.active_deadline_s is not None:
        body["activeDeadlineSeconds"] = spec.active_deadline_s
    body.update(fields)
    body["template"] = template
    return body


def job(spec: JobSpec) -> dict[str, Any]:
    ttl = {} if spec.ttl_after_finished_s is None else {"ttlSecondsAfterFinished": spec.ttl_after_finished_s}
    body = indexed_job_spec(spec, indexedjob_policy(spec)["job"], pod_template(spec), **ttl)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": pod.metadata(spec, workload=True), "spec": body}


def render(spec: JobSpec) -> list[dict[str, Any]]:
    """The Service first, so pod DNS names exist by the time the pods ask."""
    return [service(spec), job(spec)]


def hostnames(spec: JobSpec) -> list[str]:
    return [hostname(spec, spec.replicas - 1)]
