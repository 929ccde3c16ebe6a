"""JobSpec: the one description of a DDP job that every renderer and scheduler reads.

Every field says what it means and its default. Defaults live here and only
here; CLI flags and the config file only override them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ddpk.errors import BadInput
from ddpk.quantity import parse_quantity

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
    """Kueue LocalQueue name; adds the ``kueue.x-k8s.io/queue-name`` label to the workload object. (--queue)"""
    service_account: str | None = None
    """Pod serviceAccountName; its token is still not mounted. (--service-account)"""

    # --- lifecycle ----------------------------------------------------------
    max_restarts: int = 3
    """Whole-gang restarts from the last checkpoint before the job fails. (--max-restarts)"""
    active_deadline_s: int | None = None
    """Seconds the job may run in all before it is failed. (--active-deadline)"""
    ttl_after_finished_s: int | None = 86400
    """Seconds a finished job is kept before Kubernetes deletes it. (--ttl)"""
    port: int | None = None
    """Rendezvous port on the master pod (MASTER_PORT); default 29500 on clusters and Slurm,
    a free port where replicas share this machine (local). (--port)"""
    rdzv_timeout_s: int = 600
    """How long ddpk-launch waits for the master's DNS name and port. (--rdzv-timeout)"""

    # --- trainer ------------------------------------------------------------
    trainer_args: list[str] = field(default_factory=list)
    """Arguments passed to ddpk-train: everything after ``--``."""

    @property
    def service_name(self) -> str:
        """The headless Service whose name is every pod's subdomain."""
        return self.name

    @property
    def master_port(self) -> int:
        """The MASTER_PORT renderers write: ``port`` when set, else ``DEFAULT_PORT``."""
        return DEFAULT_PORT if self.port is None else self.port


# --- validation ------------------------------------------------------------------
# One place decides whether a JobSpec is acceptable. Every message names the flag,
# so the CLI prints it as is and exits 2 before anything is created.

HOSTNAME_MAX = 63
"""Kubernetes (and RFC 1123) limit for a pod hostname and for every label value."""
MAX_REPLICAS = 100_000
"""An Indexed Job accepts at most 10^5 completions."""
INT32_MAX = 2**31 - 1

RESERVED_ENV = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "JOB_COMPLETION_INDEX",
        "PYTHONUNBUFFERED",
    }
)
"""Names the renderer, Kubernetes or the launcher set; a user value would break the rendezvous."""
RESERVED_ENV_PREFIXES = ("DDPK_", "PET_", "TORCHELASTIC_")
"""ddpk's own settings, and the torchrun settings the PyTorchJob operator and the launcher use."""

PULL_POLICIES = ("Always", "IfNotPresent", "Never")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IMAGE = re.compile(r"[^\s]+")


def _check_dns_label(value: object, flag: str, *, service: bool = False) -> None:
    pattern = _DNS1035_LABEL if service else _DNS1123_LABEL
    if not isinstance(value, str) or not pattern.fullmatch(value):
        first = "a lowercase letter" if service else "a lowercase letter or digit"
        raise BadInput(
            flag,
            f"{value!r} must be a DNS-1123 label: lowercase letters, digits and '-', "
            f"starting with {first} and ending with a letter or digit",
        )
    if len(value) > HOSTNAME_MAX:
        raise BadInput(flag, f"{value!r} is {len(value)} characters; the limit is {HOSTNAME_MAX}")


def _check_dns_subdomain(value: object, flag: str) -> None:
    if not isinstance(value, str) or len(value) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(value):
        raise BadInput(flag, f"{value!r} must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.'")


def _check_label_key(key: str, flag: str) -> None:
    prefix, _, name = key.rpartition("/")
    if prefix:
        _check_dns_subdomain(prefix, flag)
    if not name or len(name) > HOSTNAME_MAX or not _LABEL_VALUE.fullmatch(name):
        raise BadInput(flag, f"{key!r} is not a valid label key ([prefix/]name, name at most 63 characters)")


def _check_label_value(value: str, flag: str) -> None:
    if len(value) > HOSTNAME_MAX or not _LABEL_VALUE.fullmatch(value):
        raise BadInput(flag, f"{value!r} is not a valid label value (at most 63 letters, digits, '-', '_', '.')")


def _check_int(value: object, flag: str, *, minimum: int, maximum: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
            value = int(value)
        else:
            raise BadInput(flag, f"{value!r} is not an integer")
    if value < minimum:
        raise BadInput(flag, f"must be at least {minimum}, got {value}")
    if value > maximum:
        raise BadInput(flag, f"must be at most {maximum}, got {value}")
    return value


def _check_mount(path: object, flag: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or path.rstrip("/") == "":
        raise BadInput(flag, f"{path!r} must be an absolute path other than /")
    if ":" in path or any(c.isspace() for c in path):
        raise BadInput(flag, f"{path!r} must not contain ':' or whitespace")
    path = path.rstrip("/")
    if path == "/dev/shm" or path == "/tmp":
        raise BadInput(flag, f"{path} is already mounted by ddpk")
    return path


def _check_volume(value: str | None, flag: str) -> None:
    """A PVC name on Kubernetes; local, docker and Slurm also take an absolute host path."""
    if value is None or (isinstance(value, str) and value.startswith("/")):
        return
    _check_dns_subdomain(value, flag)


def check_env_name(name: str, flag: str = "--env") -> None:
    """Env names ddpk accepts: shell identifiers that are not reserved for the rendezvous."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise BadInput(flag, f"{name!r} is not a valid environment variable name (letters, digits, '_')")
    if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
        raise BadInput(flag, f"{name} is reserved: ddpk, the launcher or Kubernetes sets it")


def parse_env_pairs(values: list[str] | tuple[str, ...] | None, flag: str) -> dict[str, str]:
    """``["K=V", …]`` as a dict, in order. The form only: each flag's own rules apply in ``validate``."""
    pairs: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(flag, f"{item!r} must have the form KEY=VALUE")
        if key in pairs:
            raise BadInput(flag, f"{key} is given twice")
        pairs[key] = value
    return pairs


def parse_toleration(text: str, flag: str = "--toleration") -> dict[str, str]:
    """``key[=value]:Effect`` as a Kubernetes toleration (operator Equal with a value, else Exists)."""
    body, sep, effect = text.rpartition(":")
    if not sep or not body:
        raise BadInput(flag, f"{text!r} must have the form key[=value]:Effect")
    if effect not in TOLERATION_EFFECTS:
        raise BadInput(flag, f"{text!r}: the effect must be one of {', '.join(TOLERATION_EFFECTS)}")
    key, has_value, value = body.partition("=")
    _check_label_key(key, flag)
    if has_value:
        _check_label_value(value, flag)
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


def normalize_nproc(value: object) -> str:
    """``"auto"`` or a positive integer, as the string the launcher reads."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if text == "auto":
        return text
    if re.fullmatch(r"[0-9]+", text) and int(text) >= 1:
        return str(int(text))
    raise BadInput("--nproc-per-node", f"{value!r} must be 'auto' or an integer of at least 1")


def validate(spec: JobSpec) -> JobSpec:
    """The spec, normalized, or ``BadInput`` naming the first wrong field.

    Checks hold for every target: pods are named ``<name>-<index>`` on Kubernetes,
    as containers by the docker scheduler and as ranks locally. Renderers add the
    checks their own naming needs (``ddpk.render.validate_for``).
    """
    _check_dns_label(spec.name, "--name", service=True)
    replicas = _check_int(spec.replicas, "--replicas", minimum=1, maximum=MAX_REPLICAS)
    check_hostnames(spec.name, [f"{spec.name}-{replicas - 1}"])
    _check_dns_label(spec.namespace, "--namespace")
    if not isinstance(spec.image, str) or not _IMAGE.fullmatch(spec.image):
        raise BadInput("--image", f"{spec.image!r} is not an image reference")
    if spec.image_pull_policy not in PULL_POLICIES:
        raise BadInput("--image-pull-policy", f"{spec.image_pull_policy!r} must be one of {', '.join(PULL_POLICIES)}")

    nproc = normalize_nproc(spec.nproc_per_node)
    gpus = _check_int(spec.gpus_per_replica, "--gpus", minimum=0, maximum=1024)

    for flag, value in (("--cpu", spec.cpu_request), ("--cpu-limit", spec.cpu_limit),
                        ("--memory", spec.memory_request), ("--memory-limit", spec.memory_limit)):
        if value is not None:
            parse_quantity(value, flag)
    for request, limit, flag in ((spec.cpu_request, spec.cpu_limit, "--cpu-limit"),
                                 (spec.memory_request, spec.memory_limit, "--memory-limit")):
        if request is not None and limit is not None and parse_quantity(limit, flag) < parse_quantity(request, flag):
            raise BadInput(flag, f"the limit {limit} is below the request {request}")
    parse_quantity(spec.shm_size, "--shm-size")

    for name in spec.env:
        check_env_name(name, "--env")
    for value in spec.env.values():
        if not isinstance(value, str):
            raise BadInput("--env", f"the value {value!r} must be a string")
    for secret in spec.env_from_secrets:
        _check_dns_subdomain(secret, "--env-from-secret")
    if len(set(spec.env_from_secrets)) != len(spec.env_from_secrets):
        raise BadInput("--env-from-secret", "a secret is given twice")

    _check_volume(spec.data_pvc, "--data-pvc")
    _check_volume(spec.checkpoint_pvc, "--checkpoint-pvc")
    data_mount = _check_mount(spec.data_mount, "--data-mount")
    checkpoint_mount = _check_mount(spec.checkpoint_mount, "--checkpoint-mount")
    if spec.data_pvc is not None and data_mount == checkpoint_mount:
        raise BadInput("--data-mount", "the data and checkpoint volumes need different mount paths")

    for key, value in spec.node_selector.items():
        _check_label_key(key, "--node-selector")
        _check_label_value(value, "--node-selector")
    for toleration in spec.tolerations:
        parse_toleration(toleration, "--toleration")
    if spec.priority_class is not None:
        _check_dns_subdomain(spec.priority_class, "--priority-class")
    if spec.queue is not None:
        _check_dns_label(spec.queue, "--queue")
    if spec.service_account is not None:
        _check_dns_subdomain(spec.service_account, "--service-account")

    # One gang restart costs up to `replicas` pod failures (see ddpk.render.policy).
    max_restarts = _check_int(spec.max_restarts, "--max-restarts", minimum=0, maximum=INT32_MAX // replicas)
    deadline = spec.active_deadline_s
    if deadline is not None:
        deadline = _check_int(deadline, "--active-deadline", minimum=1)
    ttl = spec.ttl_after_finished_s
    if ttl is not None:
        ttl = _check_int(ttl, "--ttl", minimum=0)
    port = spec.port
    if port is not None:
        port = _check_int(port, "--port", minimum=1, maximum=65535)
    rdzv_timeout = _check_int(spec.rdzv_timeout_s, "--rdzv-timeout", minimum=1)

    if not all(isinstance(arg, str) for arg in spec.trainer_args):
        raise BadInput("trainer arguments", "every argument after -- must be a string")

    return dataclasses.replace(
        spec,
        replicas=replicas,
        nproc_per_node=nproc,
        gpus_per_replica=gpus,
        data_mount=data_mount,
        checkpoint_mount=checkpoint_mount,
        env=dict(spec.env),
        env_from_secrets=list(spec.env_from_secrets),
        node_selector=dict(spec.node_selector),
        tolerations=list(spec.tolerations),
        max_restarts=max_restarts,
        active_deadline_s=deadline,
        ttl_after_finished_s=ttl,
        port=port,
        rdzv_timeout_s=rdzv_timeout,
        trainer_args=list(spec.trainer_args),
    )


def check_hostnames(name: str, longest: list[str], flag: str = "--name") -> None:
    """Every pod hostname (the longest is the last index) must fit the 63-character limit."""
    for hostname in longest:
        if len(hostname) > HOSTNAME_MAX:
            raise BadInput(
                flag,
                f"{name!r} is too long: pod hostname {hostname!r} has {len(hostname)} characters, "
                f"the limit is {HOSTNAME_MAX}",
            )
