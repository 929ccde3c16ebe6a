"""Helpers for the trainer tests: a clean environment, the console scripts of this interpreter, free ports."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Variables any launcher or scheduler might have left in the test's own environment.
_TOPOLOGY_PREFIXES = ("SLURM_", "PET_", "DDPK_", "TORCHELASTIC_")
_TOPOLOGY_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                   "MASTER_PORT", "JOB_COMPLETION_INDEX", "CUDA_VISIBLE_DEVICES"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _TOPOLOGY_NAMES and not k.startswith(_TOPOLOGY_PREFIXES)}
    # No GPUs in these tests, and one thread per rank so two ranks share two cores without thrashing.
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def script(name: str) -> str:
    """A console script installed beside this interpreter (ddpk-launch, ddpk-train)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        pytest.fail(f"{name} is not installed beside {sys.executable}; pip install -e trainer")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], env: dict[str, str], timeout: float = 180, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # Own session, so a test can signal the whole tree and nothing outlives it.
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def write_cifar(root: str, per_batch: int = 40, seed: int = 0, style: str = "py2") -> str:
    """CIFAR-10 in its on-disk format: cifar-10-batches-py/{data_batch_1..5,test_batch} as pickled dicts.

    ``py2`` writes the download's exact layout (Python 2 strings, pixels as one raw string);
    ``protocol2`` and ``protocol4`` are what Python 3's pickle makes of the same dicts (bytes
    through ``_codecs.encode``, and BINBYTES), which the reader must take too."""
    if style == "py2":
        from bench.cifar_files import write_cifar10

        return str(write_cifar10(Path(root), 5 * per_batch, per_batch, seed))
    import numpy as np

    protocol = {"protocol2": 2, "protocol4": 4}[style]
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch).tolist()
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)],
        }
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({b"label_names": [f"class{i}".encode() for i in range(10)]}, f, protocol=protocol)
    return folder
