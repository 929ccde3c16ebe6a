"""JobSpec: the one description of a DDP job that every renderer and scheduler reads.

Every field says what it means and its default. Defaults live here and only
here; CLI flags and the config file only override them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_IMAGE = "ddpk:latest"
DEFAULT_PORT = 29500


@dataclass
class JobSpec:
    # --- identity and image -------------------------------------------------
    name: str
    """Job name, a DNS-1123 label; pods are ``<name>-<index>``. (flag --name)"""
    namespace: str = "default"
    """Kubernetes namespace. (--namespace/-n)"""
    image: str = DEFAULT_IMAGE
    """Container image holding ddpk-trainer; its entrypoint is ddpk-launch. (--image)"""
    image_pull_policy: str = "IfNotPresent"
    """Always, IfNotPresent or Never. (--image-pull-policy)"""

    # --- topology -----------------------------------------------------------
    replicas: int = 1
    """Number of pods (nodes). (--replicas)"""
    nproc_per_node: str = "auto"
    """Ranks per pod: "auto" (one per visible GPU, else 1) or a positive integer. (--nproc-per-node)"""
    gpus_per_replica: int = 0
    """``nvidia.com/gpu`` limit per pod; 0 trains on CPU with gloo. (--gpus)"""

    # --- resources ----------------------------------------------------------
    cpu_request: str | None = None
    """CPU request per pod, a Kubernetes quantity ("500m", "4"). (--cpu)"""
    cpu_limit: str | None = None
    """CPU limit per pod. (--cpu-limit)"""
    memory_request: str | None = None
    """Memory request per pod ("4Gi"). (--memory)"""
    memory_limit: str | None = None
    """Memory limit per pod. (--memory-limit)"""

    # --- environment --------------------------------------------------------
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment, from repeated ``--env K=V``; reserved names are refused."""
    env_from_secrets: list[str] = field(default_factory=list)
    """Secrets whose keys become env vars, by reference only. (--env-from-secret)"""

    # --- volumes ------------------------------------------------------------
    data_pvc: str | None = None
    """PVC with the dataset, mounted read-only at ``data_mount``; docker/local read it as a volume name or host path. (--data-pvc)"""
    data_mount: str = "/data"
    """Where the data volume is mounted; the trainer's default --data-dir. (--data-mount)"""
    checkpoint_pvc: str | None = None
    """PVC for checkpoints and metrics; without one, an emptyDir that survives container restarts only. (--checkpoint-pvc)"""
    checkpoint_mount: str = "/checkpoints"
    """Where checkpoints go; the trainer's default --checkpoint-dir. (--checkpoint-mount)"""
    shm_size: str = "2Gi"
    """Size of the memory-backed /dev/shm. (--shm-size)"""

    # --- placement ----------------------------------------------------------
    node_selector: dict[str, str] = field(default_factory=dict)
    """Pod nodeSelector, from repeated ``--node-selector K=V``."""
    tolerations: list[str] = field(default_factory=list)
    """Tolerations as ``key[=value]:Effect``. (--toleration)"""
    priority_class: str | None = None
    """Pod priorityClassName. (--priority-class)"""
    queue: str | None = None
    """Kueue LocalQueue name; adds the ``kueue.x-k8s.io/queue-name`` label. (--queue)"""
    service_account: str | None = None
    """Pod serviceAccountName; its token is still not mounted. (--service-account)"""

    # --- lifecycle ----------------------------------------------------------
    max_restarts: int = 3
    """Whole-gang restarts from the last checkpoint before the job fails. (--max-restarts)"""
    active_deadline_s: int | None = None
    """Seconds the job may run in all before it is failed. (--active-deadline)"""
    ttl_after_finished_s: int | None = 86400
    """Seconds a finished job is kept before Kubernetes deletes it. (--ttl)"""
    port: int = DEFAULT_PORT
    """Rendezvous port on the master pod (MASTER_PORT). (--port)"""
    rdzv_timeout_s: int = 600
    """How long ddpk-launch waits for the master's DNS name and port. (--rdzv-timeout)"""

    # --- trainer ------------------------------------------------------------
    trainer_args: list[str] = field(default_factory=list)
    """Arguments passed to ddpk-train: everything after ``--``."""

    @property
    def service_name(self) -> str:
        """The headless Service whose name is every pod's subdomain."""
        return self.name
