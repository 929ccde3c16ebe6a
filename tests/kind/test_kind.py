"""kind: a 2-replica job submitted with the real CLI to a kind cluster, followed to completion.

Runs where ``kind`` is on PATH and either the cluster DDPK_KIND_CLUSTER (default
``ddpk``) is running or a node image exists locally (DDPK_KIND_NODE_IMAGE, else the
newest ``kindest/node:*``); skips with one line elsewhere. A cluster this test
created is deleted afterwards unless DDPK_KIND_KEEP=1; one it found is left running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kind, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CLUSTER = os.environ.get("DDPK_KIND_CLUSTER", "ddpk")
IMAGE = os.environ.get("DDPK_CPU_IMAGE", "ddpk:cpu")
KIND_CONFIG = REPO / "k8s" / "kind-config.yaml"
NODE_REPO = "kindest/node"


def _run(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, **kwargs)


def _check(argv: list[str], timeout: float, **kwargs) -> str:
    proc = _run(argv, timeout, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-4000:]}", pytrace=False)
    return proc.stdout


def pick_node_image(requested: str | None, local_tags: list[str]) -> str | None:
    """The node image to create the cluster from: the requested one if present, else the newest kindest/node."""
    if requested:
        return requested if requested in local_tags else None
    nodes = [t for t in local_tags if t.startswith(NODE_REPO + ":") and not t.endswith(":<none>")]

    def version(tag: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", tag.split(":", 1)[1]))

    return max(nodes, key=version, default=None)


def _ddpk() -> str:
    beside = Path(sys.executable).parent / "ddpk"
    found = str(beside) if beside.exists() else shutil.which("ddpk")
    if not found:
        pytest.fail("the ddpk console script is not installed (pip install -e cli)", pytrace=False)
    return found


@pytest.fixture(scope="module")
def kind_kubeconfig(tmp_path_factory):
    """A kubeconfig for a running kind cluster holding ddpk:cpu."""
    kind = shutil.which("kind")
    if kind is None:
        pytest.skip("kind is not on PATH")
    if shutil.which("docker") is None or _run(["docker", "info"], 60).returncode != 0:
        pytest.skip("no Docker engine answers, and kind runs its nodes in Docker")

    created = False
    clusters = _check([kind, "get", "clusters"], 60).split()
    if CLUSTER not in clusters:
        tags = _check(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"], 60).split()
        requested = os.environ.get("DDPK_KIND_NODE_IMAGE")
        node_image = pick_node_image(requested, tags)
        if node_image is None:
            pytest.skip(f"no kind node image ({requested or NODE_REPO + ':*'}) in the local image store")
        _check([kind, "create", "cluster", "--name", CLUSTER, "--config", str(KIND_CONFIG),
                "--image", node_image, "--wait", "300s"], 900)
        created = True
    try:
        kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
        kubeconfig.write_text(_check([kind, "get", "kubeconfig", "--name", CLUSTER], 60))
        _check(["make", "--no-print-directory", "image-cpu", f"CPU_IMAGE={IMAGE}"], 1800, cwd=REPO)
        _check([kind, "load", "docker-image", IMAGE, "--name", CLUSTER], 900)
        yield str(kubeconfig)
    finally:
        if created and os.environ.get("DDPK_KIND_KEEP") != "1":
            _run([kind, "delete", "cluster", "--name", CLUSTER], 300)


def test_pick_node_image_prefers_request_then_newest():
    tags = ["kindest/node:v1.29.2", "kindest/node:v1.31.0", "ddpk:cpu", "kindest/node:<none>"]
    assert pick_node_image(None, tags) == "kindest/node:v1.31.0"
    assert pick_node_image("kindest/node:v1.29.2", tags) == "kindest/node:v1.29.2"
    assert pick_node_image("kindest/node:v1.30.0", tags) is None
    assert pick_node_image(None, ["ddpk:cpu"]) is None


def test_two_replica_job_completes_on_kind(kind_kubeconfig):
    ddpk = _ddpk()
    job = f"kind-{uuid.uuid4().hex[:6]}"
    target = ["-s", "kubernetes", "--kubeconfig", kind_kubeconfig]
    try:
        proc = _run([ddpk, "submit", *target, "--name", job, "--image", IMAGE, "--image-pull-policy", "Never",
                     "--replicas", "2", "--nproc-per-node", "1", "-f",
                     "--", "--epochs", "1", "--dataset", "synthetic", "--num-threads", "1"], 1800)
        assert proc.returncode == 0, f"ddpk submit exited {proc.returncode}:\n{proc.stdout[-4000:]}"
        assert re.search(r"eval_acc=[0-9.]+\s*$", proc.stdout, re.MULTILINE), proc.stdout[-4000:]
    finally:
        _run([ddpk, "delete", job, *target], 300)
