"""The kill tests' docker image: ddpk:cpu built from this tree.

Without a Docker engine the docker cases skip with one line, except where
DDPK_REQUIRE_DOCKER=1 (CI), where a missing engine is a failure.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_IMAGE = os.environ.get("DDPK_CPU_IMAGE", "ddpk:cpu")
BUILD_TIMEOUT_S = 1800


def no_engine(reason: str) -> None:
    if os.environ.get("DDPK_REQUIRE_DOCKER") == "1":
        pytest.fail(f"DDPK_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_image() -> str:
    """ddpk:cpu built from this tree (make image-cpu reuses the layer cache), once per session."""
    try:
        import docker

        client = docker.from_env(timeout=60)
        client.ping()
        client.close()
    except Exception as exc:  # any failure to reach the engine means the same thing here
        no_engine(f"no Docker engine answers ({type(exc).__name__})")
    proc = subprocess.run(
        ["make", "--no-print-directory", "image-cpu", f"CPU_IMAGE={CPU_IMAGE}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        pytest.fail(f"make image-cpu failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}", pytrace=False)
    return CPU_IMAGE
