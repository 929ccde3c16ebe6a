"""The docker scheduler, for real: the ddpk:cpu image run as two pod-like containers."""

from __future__ import annotations

import json
import os
import secrets
import subprocess

import pytest

from conftest import run_ddpk

pytestmark = pytest.mark.e2e

IMAGE = os.environ.get("DDPK_CPU_IMAGE", "ddpk:cpu")  # what the cpu_image fixture builds
TINY = ["--epochs", "1", "--max-steps", "10", "--batch-size", "16"]
D = ("-s", "docker")


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def engine(cpu_image):
    """An engine that answers and ddpk:cpu built from this tree (tests/conftest.py)."""
    return cpu_image


@pytest.fixture
def job_name(engine, ddpk_home):
    name = f"e2e-{secrets.token_hex(3)}"
    yield name
    # Whatever a failed assertion left behind.
    docker("rm", "-f", *docker("ps", "-aq", "--filter", f"label=ddpk.job={name}").stdout.split())
    docker("network", "rm", name)
    docker("volume", "rm", f"{name}-checkpoints")


def leftovers(name: str) -> dict:
    return {
        "containers": docker("ps", "-aq", "--filter", f"label=ddpk.job={name}").stdout.split(),
        "networks": [n for n in docker("network", "ls", "--format", "{{.Name}}").stdout.split() if n == name],
        "volumes": [v for v in docker("volume", "ls", "-q").stdout.split() if v == f"{name}-checkpoints"],
    }


def test_two_containers_train_to_completion_and_every_view_agrees(job_name, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    # The image's user (uid 10001) writes checkpoints into the bind mount.
    if os.geteuid() == 0:
        os.chown(ck, 10001, 10001)
    else:
        ck.chmod(0o777)
    result = run_ddpk("submit", *D, "--image", IMAGE, "--replicas", "2", "--name", job_name,
                      "--checkpoint-pvc", str(ck), "-f", "--", *TINY, timeout=600)
    assert result.code == 0, result.err
    assert result.out.splitlines()[0].startswith(f"{job_name} -> docker (2 container(s) of {IMAGE}")
    assert f"master={job_name}-0.{job_name}:29500" in result.out
    assert "[rank 0] ddpk-train: done steps=10" in result.out

    metrics = [json.loads(line) for line in (ck / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 10 and metrics[-1]["world_size"] == 2
    assert list(ck.glob("ckpt-*.pt"))

    inspect = json.loads(docker("inspect", f"{job_name}-1").stdout)[0]
    assert inspect["Config"]["Hostname"] == f"{job_name}-1"
    # The job's supervisor is the one restarter; the engine restarts nothing on its own.
    assert inspect["HostConfig"]["RestartPolicy"]["Name"] == "no"
    assert f"{job_name}-1.{job_name}" in inspect["NetworkSettings"]["Networks"][job_name]["Aliases"]
    assert inspect["Config"]["User"] in ("", "10001")

    status = json.loads(run_ddpk("status", job_name, *D, "-o", "json").out)
    assert status["phase"] == "Succeeded"
    assert [(r["state"], r["exit_code"]) for r in status["replicas"]] == [("Succeeded", 0)] * 2
    rank1 = run_ddpk("logs", job_name, *D, "--rank", "1").out.splitlines()
    assert rank1 and all(line.startswith("[rank 1] ") for line in rank1)
    assert any("node_rank=1" in line for line in rank1)
    listed = {j["name"]: j["phase"] for j in json.loads(run_ddpk("list", *D, "-o", "json").out)}
    assert listed[job_name] == "Succeeded"

    assert run_ddpk("delete", job_name, *D).code == 0
    assert leftovers(job_name) == {"containers": [], "networks": [], "volumes": []}


def test_a_user_error_fails_and_delete_volumes_leaves_nothing(job_name):
    result = run_ddpk("submit", *D, "--image", IMAGE, "--replicas", "2", "--name", job_name,
                      "--max-restarts", "1", "-f", "--", "--epochs", "0", timeout=300)
    assert result.code == 1 and "user error" in result.err
    assert leftovers(job_name)["volumes"] == [f"{job_name}-checkpoints"]
    assert run_ddpk("delete", job_name, *D, "--volumes").code == 0
    assert leftovers(job_name) == {"containers": [], "networks": [], "volumes": []}


def test_a_missing_image_is_bad_input_and_creates_nothing(job_name):
    result = run_ddpk("submit", *D, "--image", "ddpk:no-such-tag", "--image-pull-policy", "Never",
                      "--name", job_name)
    assert result.code == 2 and "--image" in result.err
    assert leftovers(job_name) == {"containers": [], "networks": [], "volumes": []}


def test_an_unreachable_engine_is_exit_3_with_a_hint(tmp_path):
    result = run_ddpk("list", *D, env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert result.code == 3
    assert result.err.strip().count("\n") == 0 and "DOCKER_HOST" in result.err
