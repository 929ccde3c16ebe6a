"""``JobSet`` (jobset.x-k8s.io/v1alpha2): one replicated Indexed Job holding every node.

JobSet creates the headless Service itself (named after the JobSet unless
``network.subdomain`` says otherwise) and names pods' hostnames
``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``, so MASTER_ADDR is
``<name>-node-0-0.<name>``. Node rank is the pod's JOB_COMPLETION_INDEX, as in the
Indexed Job target.
"""

from __future__ import annotations

from typing import Any

from ddpk.render import pod
from ddpk.render.indexedjob import indexed_job_spec
from ddpk.render.policy import jobset_policy
from ddpk.spec import JobSpec

REPLICATED_JOB = "node"


def hostname(spec: JobSpec, index: int) -> str:
    return f"{spec.name}-{REPLICATED_JOB}-0-{index}"


def master_addr(spec: JobSpec) -> str:
    return f"{hostname(spec, 0)}.{spec.service_name}"


def render(spec: JobSpec) -> list[dict[str, Any]]:
    policy = jobset_policy(spec)
    # activeDeadlineSeconds counts per attempt: a JobSet restart recreates the Job and its clock.
    job_spec = indexed_job_spec(spec, policy["job"], {
        "metadata": {"labels": pod.labels(spec)},
        "spec": pod.pod_spec(spec, master_addr(spec), policy["pod"]["restartPolicy"]),
    })
    body: dict[str, Any] = {
        "network": {
            "enableDNSHostnames": True,
            "publishNotReadyAddresses": True,
            "subdomain": spec.service_name,
        },
        "failurePolicy": policy["failurePolicy"],
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"metadata": {"labels": pod.labels(spec)}, "spec": job_spec},
            }
        ],
    }
    if spec.ttl_after_finished_s is not None:
        body["ttlSecondsAfterFinished"] = spec.ttl_after_finished_s
    metadata = pod.metadata(spec, workload=True)
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": metadata, "spec": body}]


def hostnames(spec: JobSpec) -> list[str]:
    return [hostname(spec, spec.replicas - 1)]
