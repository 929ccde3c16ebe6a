"""Restart and failure policy of every target, in one place.

The design (docs/fault-tolerance.md): when any replica fails, every replica restarts
and resumes from the newest valid checkpoint, up to ``max_restarts`` times; exit
code 2 (a user error no restart can fix) fails the job at once. Each target gets
the native knobs that produce that behaviour.
"""

from __future__ import annotations

from typing import Any

from ddpk.errors import EXIT_BAD_INPUT
from ddpk.spec import JobSpec

USER_ERROR_EXIT_CODE = EXIT_BAD_INPUT
"""The launcher's and trainer's "do not retry" exit code (ddpk_trainer.errors.EXIT_USER_ERROR)."""
CONTAINER = "trainer"


def _pod_failure_policy(container: str) -> dict[str, Any]:
    return {
        "rules": [
            # A user error fails the whole job now instead of burning the retries.
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [USER_ERROR_EXIT_CODE]},
            },
            # Preemption, eviction and node drain are not the job's fault: they do not count.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def gang_backoff_limit(spec: JobSpec) -> int:
    """Pod failures allowed: one gang restart fails every replica once (the survivors' collectives break)."""
    return spec.max_restarts * spec.replicas


def indexedjob_policy(spec: JobSpec) -> dict[str, Any]:
    """Fields of the pod spec (``pod``) and Job spec (``job``) for a plain Indexed Job, Kubernetes ≥ 1.29.

    restartPolicy Never is what podFailurePolicy requires, and it makes every failure
    a new pod: with podReplacementPolicy Failed the replacement starts only once the
    old pod is fully gone, so two pods never hold the same index (and hostname) at once.
    """
    return {
        "pod": {"restartPolicy": "Never"},
        "job": {
            "backoffLimit": gang_backoff_limit(spec),
            "podFailurePolicy": _pod_failure_policy(CONTAINER),
            "podReplacementPolicy": "Failed",
        },
    }


def pytorchjob_policy(spec: JobSpec) -> dict[str, Any]:
    """``restartPolicy`` of every replica spec and the ``runPolicy`` restart fields of a PyTorchJob.

    Kubeflow's ExitCode policy treats exit codes 1-127 as permanent and only 128-255
    as retryable. A survivor whose peer died leaves with a Python exception (exit 1),
    so ExitCode would fail the job on the first lost pod. OnFailure restarts every
    failed container in place (same pod, same emptyDir checkpoints), which is the
    gang restart we want; runPolicy.backoffLimit bounds it with the same budget as
    the Indexed Job. The price: an exit-2 user error is retried until the budget is
    spent, since OnFailure cannot tell exit codes apart.
    """
    return {
        "replica": {"restartPolicy": "OnFailure"},
        "pod": {"restartPolicy": "OnFailure"},
        "runPolicy": {"backoffLimit": gang_backoff_limit(spec)},
    }


def jobset_policy(spec: JobSpec) -> dict[str, Any]:
    """JobSet-level ``failurePolicy`` plus the child Job's and pod's restart fields.

    The child Job tolerates no pod failure (backoffLimit 0), so any failure fails it and
    JobSet recreates every Job of the set: a whole-gang restart, counted against
    ``failurePolicy.maxRestarts``. A user error fails the child Job through its
    podFailurePolicy (reason PodFailurePolicy), and the first rule turns that into a
    failed JobSet with no restart. A disrupted pod is replaced without counting, but the
    survivors' broken collectives that follow still fail the child Job and restart the set.
    """
    return {
        "failurePolicy": {
            "maxRestarts": spec.max_restarts,
            "rules": [
                {"name": "UserError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            ],
        },
        "job": {
            "backoffLimit": 0,
            "podFailurePolicy": _pod_failure_policy(CONTAINER),
            "podReplacementPolicy": "Failed",
        },
        "pod": {"restartPolicy": "Never"},
    }


def slurm_policy(spec: JobSpec) -> dict[str, Any]:
    """How often the sbatch script reruns the whole ``srun`` step, and which exit codes stop it.

    ``srun --kill-on-bad-exit=1`` ends every task when one fails, so each rerun is a gang restart.
    """
    return {"retries": spec.max_restarts, "fatal_exit_codes": [USER_ERROR_EXIT_CODE]}


POLICIES = {
    "indexedjob": indexedjob_policy,
    "pytorchjob": pytorchjob_policy,
    "jobset": jobset_policy,
    "slurm": slurm_policy,
}


def restart_policy(spec: JobSpec, target: str) -> dict[str, Any]:
    """The restart and failure knobs of ``target`` that implement ``spec.max_restarts``."""
    return POLICIES[target](spec)
