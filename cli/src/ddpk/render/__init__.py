"""Renderers: a validated JobSpec in, manifests (or an sbatch script) out. Pure; no I/O but ``write_dir``.

``render(spec, target)`` is what ``ddpk render`` prints and what the kubernetes
scheduler applies. The local and docker schedulers run the *rendered* trainer
container (``trainer_container``) with each pod's own env (``pod_env``), so what
passes on this machine is what the cluster runs.
"""

from __future__ import annotations

from typing import Any

from ddpk.render import indexedjob, jobset, pod, pytorchjob, slurm
from ddpk.render.output import to_yaml, write_dir
from ddpk.render.policy import restart_policy
from ddpk.spec import JobSpec, check_hostnames, validate

TARGETS = ("indexedjob", "pytorchjob", "jobset", "slurm")
DEFAULT_TARGET = "indexedjob"

_MODULES = {"indexedjob": indexedjob, "pytorchjob": pytorchjob, "jobset": jobset, "slurm": slurm}

__all__ = [
    "TARGETS",
    "DEFAULT_TARGET",
    "render",
    "validate_for",
    "to_yaml",
    "write_dir",
    "pod_template",
    "trainer_container",
    "pod_env",
    "hostname",
    "master_addr",
    "selector",
    "selector_labels",
    "restart_policy",
]


def _module(target: str):
    if target not in _MODULES:
        from ddpk.errors import BadInput

        raise BadInput("--target", f"{target!r} is not one of {', '.join(TARGETS)}")
    return _MODULES[target]


def validate_for(spec: JobSpec, target: str = DEFAULT_TARGET) -> JobSpec:
    """``ddpk.spec.validate`` plus what the target's own pod naming and volumes need."""
    module = _module(target)
    spec = validate(spec)
    check_hostnames(spec.name, module.hostnames(spec))
    if target == "slurm":
        slurm.check(spec)
    return spec


def render(spec: JobSpec, target: str = DEFAULT_TARGET, **options: Any) -> list[dict[str, Any]] | str:
    """Manifest dicts in apply order, or for ``slurm`` the sbatch script (option ``container=True``: pyxis)."""
    spec = validate_for(spec, target)
    return _module(target).render(spec, **options)


def pod_template(spec: JobSpec) -> dict[str, Any]:
    """The Indexed Job's pod template (metadata and spec), as the cluster gets it."""
    return indexedjob.pod_template(validate(spec))


def trainer_container(spec: JobSpec) -> dict[str, Any]:
    """The Indexed Job's trainer container: ``command``, ``env`` (list of name/value), ``envFrom``, mounts."""
    return pod_template(spec)["spec"]["containers"][0]


def pod_env(spec: JobSpec, index: int) -> dict[str, str]:
    """The plain env pod ``index`` sees on Kubernetes: the rendered env plus JOB_COMPLETION_INDEX.

    Secrets (``envFrom``) are not included; a scheduler that runs the container resolves them itself.
    """
    env = {item["name"]: item["value"] for item in trainer_container(spec)["env"]}
    env["JOB_COMPLETION_INDEX"] = str(index)
    return env


def hostname(spec: JobSpec, index: int, target: str = DEFAULT_TARGET) -> str:
    """Pod ``index``'s hostname under ``target`` (Kubernetes targets only)."""
    return _module(target).hostname(spec, index)


def master_addr(spec: JobSpec, target: str = DEFAULT_TARGET) -> str:
    """The DNS name the launcher of every pod dials for the rendezvous (Kubernetes targets only)."""
    return _module(target).master_addr(spec)


selector = pod.selector
selector_labels = pod.selector_labels
