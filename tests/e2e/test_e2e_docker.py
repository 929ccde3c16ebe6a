"""e2e-docker: the real image, run as the two pods of an Indexed Job would run.

Each container takes the rendered trainer container of the Indexed Job (command,
env, hardening, mounts) and pod i's identity: name and hostname ``<job>-<i>``, the
network alias ``<job>-<i>.<service>`` on a user-defined network, whose embedded DNS
plays the headless Service. They rendezvous through ``MASTER_ADDR``, train one epoch
on ``synthetic``, and rank 0 writes its checkpoint and metrics to a shared folder.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from ddpk import render
from ddpk.quantity import parse_quantity
from ddpk.spec import JobSpec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

REPLICAS = 2
RUN_TIMEOUT_S = 900
TEST_LABEL = "ddpk.e2e"


def docker_run_kwargs(container: dict, spec: JobSpec, index: int, host_checkpoints: str) -> dict:
    """docker-SDK ``containers.create`` arguments for pod ``index`` from the rendered trainer container."""
    env = {item["name"]: item["value"] for item in container["env"]}
    env["JOB_COMPLETION_INDEX"] = str(index)
    security = container["securityContext"]
    tmpfs, volumes = {}, {}
    for mount in container["volumeMounts"]:
        if mount["name"] == "checkpoints":
            volumes[host_checkpoints] = {"bind": mount["mountPath"], "mode": "rw"}
        elif mount["name"] == "tmp":
            tmpfs[mount["mountPath"]] = ""
        elif mount["name"] != "dshm":  # /dev/shm is docker's own tmpfs, sized by shm_size
            raise ValueError(f"no docker counterpart for the pod volume {mount['name']!r}")
    host = render.hostname(spec, index)
    return {
        "name": host,
        "hostname": host,
        "entrypoint": container["command"][:1],
        "command": container["command"][1:],
        "environment": env,
        "user": f"{security['runAsUser']}:{security['runAsGroup']}",
        "read_only": security["readOnlyRootFilesystem"],
        "cap_drop": security["capabilities"]["drop"],
        "security_opt": [] if security["allowPrivilegeEscalation"] else ["no-new-privileges"],
        "tmpfs": tmpfs,
        "shm_size": int(parse_quantity(spec.shm_size, "shm_size")),
        "volumes": volumes,
        "labels": {TEST_LABEL: spec.name},
    }


def _leftovers(client, job: str) -> list[str]:
    containers = client.containers.list(all=True, filters={"label": f"{TEST_LABEL}={job}"})
    networks = client.networks.list(names=[job])
    return [f"container {c.name}" for c in containers] + [f"network {n.name}" for n in networks]


def _remove(client, containers: list, network) -> None:
    for c in containers:
        try:
            c.remove(force=True)
        except Exception:  # already gone; the leftovers check below catches what is not
            pass
    if network is not None:
        try:
            network.remove()
        except Exception:
            pass


def _wait_all(containers: list, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    codes = {}
    for c in containers:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            codes[c.name] = c.wait(timeout=remaining)["StatusCode"]
        except Exception as exc:  # the SDK raises the transport's timeout error
            pytest.fail(f"{c.name} did not finish within {timeout_s:.0f} s ({type(exc).__name__})")
    return codes


def test_two_containers_train_like_indexed_job_pods(docker_client, cpu_image, tmp_path):
    import torch

    job = f"e2e-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(
        name=job,
        image=cpu_image,
        replicas=REPLICAS,
        nproc_per_node="1",
        rdzv_timeout_s=180,
        trainer_args=["--epochs", "1", "--dataset", "synthetic", "--num-threads", "1"],
    )
    rendered = render.trainer_container(spec)
    assert render.master_addr(spec) == f"{job}-0.{spec.service_name}"

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    # The containers run as the image's UID, like pods with fsGroup on a volume.
    os.chmod(checkpoints, 0o777)

    containers = []
    network = None
    try:
        network = docker_client.networks.create(job, driver="bridge", labels={TEST_LABEL: job})
        for index in range(REPLICAS):
            kwargs = docker_run_kwargs(rendered, spec, index, str(checkpoints))
            alias = f"{render.hostname(spec, index)}.{spec.service_name}"
            endpoint = docker_client.api.create_endpoint_config(aliases=[alias])
            containers.append(docker_client.containers.create(
                cpu_image, network=job, networking_config={job: endpoint}, **kwargs))
        # Pod 1 starts first, as it may on a cluster: its launcher must wait for pod 0's name.
        for c in reversed(containers):
            c.start()

        codes = _wait_all(containers, RUN_TIMEOUT_S)
        logs = {c.name: c.logs().decode(errors="replace") for c in containers}
        for name, code in codes.items():
            assert code == 0, f"{name} exited {code}:\n{logs[name][-3000:]}"
        rank0 = logs[f"{job}-0"]
        assert re.search(r"eval_acc=[0-9.]+\s*$", rank0, re.MULTILINE), rank0[-3000:]
    finally:
        _remove(docker_client, containers, network)

    assert _leftovers(docker_client, job) == []

    metrics = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, "rank 0 wrote no metrics"
    assert {m["world_size"] for m in metrics} == {REPLICAS * int(spec.nproc_per_node)}

    saved = sorted(checkpoints.glob("ckpt-*.pt"))
    assert saved, f"no checkpoint in {sorted(p.name for p in checkpoints.iterdir())}"
    state = torch.load(saved[-1], map_location="cpu", weights_only=True)
    assert state["epoch"] >= 0 and state["global_step"] > 0
    assert state["model"], "the checkpoint holds no model weights"


def test_image_is_unprivileged_and_has_no_compiler(docker_client, cpu_image):
    def run(*argv: str, entrypoint: str | None = None) -> str:
        out = docker_client.containers.run(
            cpu_image, list(argv), entrypoint=entrypoint, remove=True, network_mode="none",
            labels={TEST_LABEL: "hygiene"},
        )
        return out.decode().strip()

    config = docker_client.images.get(cpu_image).attrs["Config"]
    assert config["User"] == "10001"
    assert config["Entrypoint"] == ["ddpk-launch"]
    assert config["Env"] and "PYTHONUNBUFFERED=1" in config["Env"]
    assert {"org.opencontainers.image.title", "org.opencontainers.image.version"} <= set(config["Labels"])

    assert run("-u", entrypoint="id") != "0"
    assert "usage" in run("--help").lower()
    found = run("-c", "for c in gcc cc c++ g++ clang; do command -v $c || true; done", entrypoint="sh")
    assert found == "", f"compilers in the final image: {found}"
