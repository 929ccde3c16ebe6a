"""The per-pod contract every target keeps (DESIGN.md): names, rendezvous address, world size, hardening, secrets."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys

import pytest
import yaml
from render_cases import CASES, K8S_TARGETS

from ddpk.render import (
    TARGETS,
    hostname,
    master_addr,
    pod_env,
    pod_template,
    render,
    restart_policy,
    selector,
    selector_labels,
    to_yaml,
    trainer_container,
    write_dir,
)
from ddpk.errors import BadInput
from ddpk.render.output import file_name
from ddpk.spec import JobSpec, parse_toleration, validate
from ddpk_trainer import env as envmod
from ddpk_trainer import launch

pytestmark = pytest.mark.unit

ALL_CASES = sorted(CASES)


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objs}


def pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "Job":
        return [obj["spec"]["template"]]
    if obj["kind"] == "PyTorchJob":
        return [r["template"] for r in obj["spec"]["pytorchReplicaSpecs"].values()]
    if obj["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in obj["spec"]["replicatedJobs"]]
    return []


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# --- names and the rendezvous address -----------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES)
def test_indexedjob_hostname_subdomain_and_service_agree(case):
    spec = CASES[case]
    objs = by_kind(render(spec))
    service, job = objs["Service"], objs["Job"]
    pod = job["spec"]["template"]
    assert service["metadata"]["name"] == pod["spec"]["subdomain"] == spec.service_name
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # The Job controller names pod i's hostname "<job name>-<i>" when the pod has a subdomain.
    assert [hostname(spec, i) for i in (0, spec.replicas - 1)] == [
        f"{job['metadata']['name']}-0", f"{job['metadata']['name']}-{spec.replicas - 1}"
    ]
    master = env_of(pod["spec"]["containers"][0])["MASTER_ADDR"]
    assert master == f"{job['metadata']['name']}-0.{service['metadata']['name']}" == master_addr(spec)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == spec.replicas
    # Everything every pod needs to reach index 0 is in one namespace.
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == spec.namespace


@pytest.mark.parametrize("case", ALL_CASES)
def test_service_selects_only_this_jobs_pods(case):
    spec = CASES[case]
    service, job = render(spec)
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    chosen = service["spec"]["selector"]
    assert chosen.items() <= pod_labels.items()
    assert chosen == selector_labels(spec)
    assert selector(spec) == ",".join(f"{k}={v}" for k, v in chosen.items())
    other = render(dataclasses.replace(spec, name=f"{spec.name}x"))[1]
    assert not chosen.items() <= other["spec"]["template"]["metadata"]["labels"].items()
    # The Service itself is not a trainer pod's label set: its component differs.
    assert not chosen.items() <= service["metadata"]["labels"].items()


@pytest.mark.parametrize("case", ALL_CASES)
def test_jobset_master_follows_jobset_dns(case):
    spec = CASES[case]
    jobset = render(spec, "jobset")[0]
    rjob = jobset["spec"]["replicatedJobs"][0]
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    # JobSet's headless Service is named after the JobSet unless network.subdomain says otherwise.
    assert network["subdomain"] == jobset["metadata"]["name"] == spec.service_name
    assert rjob["replicas"] == 1
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == spec.replicas
    # <jobSet>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>
    expected = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{network['subdomain']}"
    assert env_of(job["template"]["spec"]["containers"][0])["MASTER_ADDR"] == expected == master_addr(spec, "jobset")


@pytest.mark.parametrize("case", ALL_CASES)
def test_pytorchjob_leaves_the_rendezvous_to_the_operator(case):
    spec = CASES[case]
    obj = render(spec, "pytorchjob")[0]
    replicas = obj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {"replicas": 0})["replicas"] == spec.replicas - 1
    for template in pod_templates(obj):
        container = template["spec"]["containers"][0]
        # The operator finds MASTER_PORT only on a container named "pytorch", port "pytorchjob-port".
        assert container["name"] == "pytorch"
        assert {"name": "pytorchjob-port", "containerPort": spec.master_port, "protocol": "TCP"} in container["ports"]
        assert "MASTER_ADDR" not in env_of(container)
    assert master_addr(spec, "pytorchjob") == f"{spec.name}-master-0"
    # An explicit integer: the operator counts "auto" as 1 process when it computes WORLD_SIZE.
    assert obj["spec"]["nprocPerNode"].isdigit()


# --- WORLD_SIZE as the launcher counts it ------------------------------------------------


def launcher_world_sizes(env: dict[str, str], gpus: int) -> set[int]:
    """WORLD_SIZE of every rank the real launcher would start on a node with ``gpus`` visible GPUs."""
    env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    topo = envmod.resolve(env, env.get("DDPK_NPROC_PER_NODE") or "auto")
    if topo.nproc_per_node is None:
        topo = dataclasses.replace(topo, nproc_per_node=max(1, launch.visible_gpus(env)))
    return {int(launch.rank_env(env, topo, r, None)["WORLD_SIZE"]) for r in range(topo.nproc_per_node)}


def operator_env(obj: dict, role: str, index: int) -> dict[str, str]:
    """What Kubeflow's training operator appends to a PyTorchJob pod (pkg/controller.v1/pytorch/envvar.go)."""
    spec = obj["spec"]
    total = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    nproc = int(spec["nprocPerNode"]) if spec["nprocPerNode"].isdigit() else 1
    master = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port")
    rank = index + 1 if role == "Worker" else index
    return {
        "MASTER_PORT": str(port),
        "MASTER_ADDR": f"{obj['metadata']['name']}-master-0",
        "WORLD_SIZE": str(total * nproc),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(total),
        "PET_NPROC_PER_NODE": spec["nprocPerNode"],
    }


def node_envs(spec: JobSpec, target: str) -> list[dict[str, str]]:
    """The env each node's launcher starts with, as the cluster or Slurm would hand it over."""
    if target == "indexedjob":
        return [pod_env(spec, i) for i in range(spec.replicas)]
    if target == "jobset":
        template = pod_templates(render(spec, "jobset")[0])[0]
        base = env_of(template["spec"]["containers"][0])
        return [{**base, "JOB_COMPLETION_INDEX": str(i)} for i in range(spec.replicas)]
    if target == "pytorchjob":
        obj = render(spec, "pytorchjob")[0]
        out = []
        for role, replica in obj["spec"]["pytorchReplicaSpecs"].items():
            base = env_of(replica["template"]["spec"]["containers"][0])
            out += [{**base, **operator_env(obj, role, i)} for i in range(replica["replicas"])]
        return out
    script = render(spec, "slurm", container=True)
    exported = {}
    for line in script.splitlines():
        if line.startswith("export ") and "=" in line:
            name, _, value = line[len("export "):].partition("=")
            exported[name] = shlex.split(value)[0]
    exported["MASTER_ADDR"] = "node001"
    return [
        {**exported, "SLURM_PROCID": str(i), "SLURM_NTASKS": str(spec.replicas), "SLURM_NODEID": str(i),
         "SLURM_JOB_NUM_NODES": str(spec.replicas), "SLURM_JOB_NODELIST": f"node[001-{spec.replicas:03d}]"}
        for i in range(spec.replicas)
    ]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_world_size_is_replicas_times_processes_per_node(case, target):
    spec = CASES[case]
    if target == "slurm":
        spec = dataclasses.replace(spec, env_from_secrets=[], data_pvc=None, checkpoint_pvc=None)
    per_node = int(spec.nproc_per_node) if spec.nproc_per_node != "auto" else max(1, spec.gpus_per_replica)
    envs = node_envs(spec, target)
    assert len(envs) == spec.replicas
    for env in envs:
        assert launcher_world_sizes(env, spec.gpus_per_replica) == {spec.replicas * per_node}


# --- pod contents -------------------------------------------------------------------------


@pytest.mark.parametrize("target", K8S_TARGETS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_pods_are_hardened_and_carry_the_contract_env(case, target):
    spec = validate(CASES[case])
    for template in [t for obj in render(spec, target) for t in pod_templates(obj)]:
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert len(pod["containers"]) == 1
        container = pod["containers"][0]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["runAsNonRoot"] is True and security["seccompProfile"]["type"] == "RuntimeDefault"
        assert container["command"] == ["ddpk-launch", "--rdzv-timeout", str(spec.rdzv_timeout_s), "--",
                                        *spec.trainer_args]
        env = env_of(container)
        assert env["DDPK_NNODES"] == str(spec.replicas)
        assert env["DDPK_NPROC_PER_NODE"] == spec.nproc_per_node
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["DDPK_CHECKPOINT_DIR"] == spec.checkpoint_mount
        assert env["DDPK_METRICS_FILE"] == f"{spec.checkpoint_mount}/metrics.jsonl"
        assert ("DDPK_DATA_DIR" in env) == (spec.data_pvc is not None)
        if target != "pytorchjob":
            assert env["MASTER_PORT"] == str(spec.master_port)
        for name, value in spec.env.items():
            assert env[name] == value
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": spec.shm_size}
        checkpoints = volumes[mounts[spec.checkpoint_mount]]
        if spec.checkpoint_pvc:
            assert checkpoints["persistentVolumeClaim"] == {"claimName": spec.checkpoint_pvc}
        else:
            assert checkpoints["emptyDir"] == {}
        if spec.data_pvc:
            assert volumes[mounts[spec.data_mount]]["persistentVolumeClaim"] == {
                "claimName": spec.data_pvc, "readOnly": True}
        limits = container.get("resources", {}).get("limits", {})
        if spec.gpus_per_replica:
            assert limits["nvidia.com/gpu"] == str(spec.gpus_per_replica)
        else:
            assert "nvidia.com/gpu" not in limits
        assert pod.get("tolerations", []) == [parse_toleration(t) for t in spec.tolerations]
        assert pod.get("nodeSelector", {}) == spec.node_selector
        assert pod.get("priorityClassName") == spec.priority_class
        assert pod.get("serviceAccountName") == spec.service_account


@pytest.mark.parametrize("target", K8S_TARGETS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_labels_and_queue(case, target):
    spec = CASES[case]
    objs = render(spec, target)
    for obj in objs:
        inner = [t["metadata"]["labels"] for t in pod_templates(obj)]
        if obj["kind"] == "JobSet":
            inner += [r["template"]["metadata"]["labels"] for r in obj["spec"]["replicatedJobs"]]
        for labels in [obj["metadata"]["labels"], *inner]:
            assert labels["app.kubernetes.io/name"] == "ddpk"
            assert labels["app.kubernetes.io/instance"] == spec.name
            assert labels["app.kubernetes.io/part-of"] == "ddpk"
            assert labels["app.kubernetes.io/managed-by"] == "ddpk"
            assert "app.kubernetes.io/component" in labels
        # Kueue admits the workload as a whole: the queue label is on it and nowhere else.
        assert all("kueue.x-k8s.io/queue-name" not in labels for labels in inner)
    (workload,) = [obj for obj in objs if obj["kind"] != "Service"]
    assert workload["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") == spec.queue
    assert all("kueue.x-k8s.io/queue-name" not in o["metadata"]["labels"] for o in objs if o["kind"] == "Service")


# --- secrets -------------------------------------------------------------------------------

SECRET_VALUE = "hunter2-do-not-print"


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_value_leaks(target, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET_VALUE)
    monkeypatch.setenv("WANDB_API_KEY", SECRET_VALUE)
    spec = CASES["wide-volumes-secrets"]
    if target == "slurm":
        text = render(dataclasses.replace(spec, env_from_secrets=[], data_pvc=None, checkpoint_pvc=None), "slurm")
        assert SECRET_VALUE not in text
        return
    objs = render(spec, target)
    text = to_yaml(objs)
    assert SECRET_VALUE not in text
    assert all(obj["kind"] != "Secret" for obj in objs)
    for template in [t for obj in objs for t in pod_templates(obj)]:
        container = template["spec"]["containers"][0]
        # By reference only: whole secrets through envFrom, never a literal value or key.
        assert container["envFrom"] == [{"secretRef": {"name": s}} for s in spec.env_from_secrets]
        assert all("valueFrom" not in e for e in container["env"])


# --- restart and failure policy ----------------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES)
def test_restart_and_failure_fields_implement_max_restarts(case):
    spec = CASES[case]
    job = render(spec)[1]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["backoffLimit"] == spec.max_restarts * spec.replicas
    assert job["podReplacementPolicy"] == "Failed"
    fail, ignore = job["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob"
    # The rule must name the real container, or Kubernetes never matches it.
    assert fail["onExitCodes"] == {"containerName": job["template"]["spec"]["containers"][0]["name"],
                                   "operator": "In", "values": [2]}
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}

    jobset = render(spec, "jobset")[0]["spec"]
    assert jobset["failurePolicy"]["maxRestarts"] == spec.max_restarts
    child = jobset["replicatedJobs"][0]["template"]["spec"]
    assert child["backoffLimit"] == 0 and child["template"]["spec"]["restartPolicy"] == "Never"
    assert child["podFailurePolicy"]["rules"][0]["onExitCodes"]["containerName"] == (
        child["template"]["spec"]["containers"][0]["name"])

    pytorchjob = render(spec, "pytorchjob")[0]["spec"]
    assert pytorchjob["runPolicy"]["backoffLimit"] == spec.max_restarts * spec.replicas
    assert {r["restartPolicy"] for r in pytorchjob["pytorchReplicaSpecs"].values()} == {"OnFailure"}

    assert restart_policy(spec, "slurm") == {"retries": spec.max_restarts, "fatal_exit_codes": [2]}


def test_deadline_and_ttl():
    spec = CASES["two-gpu-queue"]
    job = render(spec)[1]["spec"]
    assert job["activeDeadlineSeconds"] == spec.active_deadline_s
    assert "ttlSecondsAfterFinished" not in job
    assert render(CASES["one-cpu"])[1]["spec"]["ttlSecondsAfterFinished"] == 86400


# --- what schedulers and the CLI take from here ------------------------------------------


def test_local_schedulers_get_the_rendered_container():
    spec = CASES["two-cpu"]
    job = render(spec)[1]
    assert trainer_container(spec) == job["spec"]["template"]["spec"]["containers"][0]
    assert pod_template(spec) == job["spec"]["template"]
    assert pod_env(spec, 1) == {**env_of(trainer_container(spec)), "JOB_COMPLETION_INDEX": "1"}


@pytest.mark.parametrize("target", K8S_TARGETS)
def test_yaml_round_trips_and_write_dir_writes_one_file_per_object(target, tmp_path):
    objs = render(CASES["two-gpu-queue"], target)
    assert list(yaml.safe_load_all(to_yaml(objs))) == objs
    written = write_dir(objs, tmp_path / "out")
    assert len(written) == len(objs) == len(list((tmp_path / "out").iterdir()))
    assert [yaml.safe_load(p.read_text()) for p in written] == objs


def test_write_dir_leaves_nothing_behind_when_a_file_cannot_be_written(tmp_path):
    objs = render(CASES["two-cpu"])
    # The last file's temporary name is taken by a folder, so writing it fails after the others were staged.
    blocker = tmp_path / f".{file_name(objs[-1])}.tmp"
    blocker.mkdir()
    with pytest.raises(BadInput) as caught:
        write_dir(objs, tmp_path)
    assert caught.value.field == "--output-dir"
    assert list(tmp_path.iterdir()) == [blocker]


def test_write_dir_takes_an_sbatch_script(tmp_path):
    script = render(CASES["two-cpu"], "slurm")
    (path,) = write_dir(script, tmp_path)
    assert path.read_text() == script


def test_render_is_pure():
    spec = CASES["wide-volumes-secrets"]
    before = dataclasses.asdict(spec)
    assert render(spec, "jobset") == render(spec, "jobset")
    assert dataclasses.asdict(spec) == before


def test_rendering_imports_neither_torch_nor_the_kubernetes_client():
    code = """
import json, sys
from ddpk.render import TARGETS, render, to_yaml
from ddpk.spec import JobSpec
spec = JobSpec(name="big", replicas=256, gpus_per_replica=8, queue="q")
for target in TARGETS:
    out = render(spec, target)
    if not isinstance(out, str):
        to_yaml(out)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "kubernetes", "ddpk_trainer"))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout) == []
