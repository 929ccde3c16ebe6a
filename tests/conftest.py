"""Fixtures every tier shares: a Docker engine and the ddpk:cpu image built from this tree.

Without an engine, tests that need one skip with one line, except where
DDPK_REQUIRE_DOCKER=1 (CI), where a missing engine is a failure. The image is
built once per session by `make image-cpu`, so no test runs a stale trainer.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_IMAGE = os.environ.get("DDPK_CPU_IMAGE", "ddpk:cpu")
BUILD_TIMEOUT_S = 1800


def no_engine(reason: str) -> None:
    if os.environ.get("DDPK_REQUIRE_DOCKER") == "1":
        pytest.fail(f"DDPK_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client():
    """A docker SDK client whose engine answered a ping."""
    try:
        import docker
    except ImportError:
        no_engine("the docker Python SDK is not installed")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # any failure to reach the engine means the same thing here
        no_engine(f"no Docker engine answers ({type(exc).__name__})")
    yield client
    client.close()


@pytest.fixture(scope="session")
def cpu_image(docker_client) -> str:
    """ddpk:cpu built from this tree by `make image-cpu` (which builds the CPU base only when missing)."""
    proc = subprocess.run(
        ["make", "--no-print-directory", "image-cpu", f"CPU_IMAGE={CPU_IMAGE}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        pytest.fail(f"make image-cpu failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}", pytrace=False)
    return CPU_IMAGE
