"""Bad input, one table: CLI flags, the config file, trainer and launcher flags, data files.

Every row runs the real program (``ddpk``, ``ddpk-train`` or ``ddpk-launch``) as a
subprocess in a folder of its own and expects its documented exit code (2 bad
input; 3 where the documented answer is "cluster or engine unreachable"), exactly
one line on stderr that names the input, no traceback, and nothing half-applied:
the row's folder (DDPK_HOME, the checkpoint and output folders, the working
directory) is byte for byte what it was, and the Docker engine holds no container,
network or volume of the row's job.

The rows run concurrently once per module (each costs a Python start, most a torch
import); the tests then read their outcomes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BAD_INPUT, UNREACHABLE = 2, 3
RUN_TIMEOUT_S = 180
WORKERS = 4
CLEARED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "JOB_COMPLETION_INDEX", "KUBECONFIG", "DOCKER_HOST")
CLEARED_PREFIXES = ("DDPK_", "SLURM_", "PET_", "TORCHELASTIC_")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    program: str
    """ddpk, ddpk-train or ddpk-launch."""
    args: tuple[str, ...]
    """Arguments; ``{name}`` is filled from what ``setup`` returns."""
    names: str
    """What the one-line message must name: the flag, the config key, the file or the address."""
    code: int = BAD_INPUT
    setup: Callable[[Path], dict[str, str]] | None = None
    env: tuple[tuple[str, str], ...] = ()
    docker: bool = False
    """Needs a Docker engine that answers."""


# --- what some rows need on disk ----------------------------------------------------------


def a_file(folder: Path) -> dict[str, str]:
    (folder / "afile").write_text("not a folder\n")
    return {"file": str(folder / "afile")}


def config(text: str | bytes) -> Callable[[Path], dict[str, str]]:
    def setup(folder: Path) -> dict[str, str]:
        path = folder / "ddpk.toml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return {}

    return setup


def cifar_batches(damage: Callable[[Path], None]) -> Callable[[Path], dict[str, str]]:
    """The five train batches and the test batch in the standard pickle format, 8 images each, one damaged."""

    def setup(folder: Path) -> dict[str, str]:
        import numpy as np

        data = folder / "data" / "cifar-10-batches-py"
        data.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            batch = {b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), b"labels": list(range(8))}
            # Protocol 2, as the published files are written.
            (data / name).write_bytes(pickle.dumps(batch, protocol=2))
        damage(data)
        return {"data": str(folder / "data")}

    return setup


def truncate(name: str) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        blob = (data / name).read_bytes()
        (data / name).write_bytes(blob[: len(blob) // 2])

    return damage


def overwrite(name: str, blob: bytes) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        (data / name).write_bytes(blob)

    return damage


def wrong_shape(name: str) -> Callable[[Path], None]:
    def damage(data: Path) -> None:
        import numpy as np

        batch = {b"data": np.zeros((8, 100), dtype=np.uint8), b"labels": list(range(8))}
        (data / name).write_bytes(pickle.dumps(batch, protocol=2))

    return damage


def checkpoint_dir_with(blob: Callable[[], bytes]) -> Callable[[Path], dict[str, str]]:
    """A checkpoint folder whose newest checkpoint is the given bytes."""

    def setup(folder: Path) -> dict[str, str]:
        ckpt = folder / "ckpt"
        ckpt.mkdir()
        (ckpt / "ckpt-000000010.pt").write_bytes(blob())
        return {"ckpt": str(ckpt), "newest": str(ckpt / "ckpt-000000010.pt")}

    return setup


def foreign_torch_file() -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"weights": torch.zeros(3)}, buf)
    return buf.getvalue()


def immutable_dir(folder: Path) -> dict[str, str]:
    """A folder nobody can write to: mode 0555, and immutable too when running as root (root ignores modes)."""
    ro = folder / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(ro)], capture_output=True)
        if done.returncode != 0:
            pytest.fail(f"running as root and chattr +i failed, so no folder is unwritable: {done.stderr!r}")
    return {"ro": str(ro)}


def release_immutable(folder: Path) -> None:
    ro = folder / "readonly"
    if ro.exists() and os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)


def kubeconfig_to_nowhere(folder: Path) -> dict[str, str]:
    """A kubeconfig whose API server address refuses connections (port 1 on loopback)."""
    path = folder / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\n"
        "users:\n- name: u\n  user: {token: t}\n"
        "contexts:\n- name: x\n  context: {cluster: c, user: u, namespace: default}\n"
        "current-context: x\n"
    )
    return {"kubeconfig": str(path)}


def docker_host_to_nowhere(folder: Path) -> dict[str, str]:
    return {"sock": f"unix://{folder}/no-engine.sock"}


def empty_dir(folder: Path) -> dict[str, str]:
    (folder / "empty").mkdir()
    return {"empty": str(folder / "empty")}


# --- the table -----------------------------------------------------------------------------

SUBMIT = ("submit", "--dry-run")
TRAIN = "ddpk-train"

CASES = [
    # CLI job flags
    Case("name-too-long-for-pod-hostnames", "ddpk", (*SUBMIT, "--name", "a" * 60, "--replicas", "1000"), "--name"),
    Case("name-over-63-characters", "ddpk", ("render", "--name", "b" * 64), "--name"),
    Case("replicas-zero", "ddpk", (*SUBMIT, "--replicas", "0"), "--replicas"),
    Case("replicas-million", "ddpk", (*SUBMIT, "--replicas", "1000000"), "--replicas"),
    Case("replicas-million-jobset", "ddpk", ("render", "-t", "jobset", "--replicas", "1000000"), "--replicas"),
    Case("cpu-unparsable", "ddpk", (*SUBMIT, "--cpu", "2cores"), "--cpu"),
    Case("memory-unparsable", "ddpk", ("render", "--memory", "4GB"), "--memory"),
    Case("shm-size-unparsable", "ddpk", (*SUBMIT, "--shm-size", "1 GiB"), "--shm-size"),
    Case("memory-limit-below-request", "ddpk", ("render", "--memory", "4Gi", "--memory-limit", "2Gi"), "--memory-limit"),
    Case("port-out-of-range", "ddpk", (*SUBMIT, "--port", "65536"), "--port"),
    Case("port-in-use-local", "ddpk",
         ("submit", "-s", "local", "--name", "busy-port", "--port", "{busy_port}", "--", "--max-steps", "1"), "--port"),
    Case("secret-on-local", "ddpk", (*SUBMIT, "-s", "local", "--env-from-secret", "hf-token"), "--env-from-secret"),
    Case("secret-on-slurm", "ddpk", ("render", "-t", "slurm", "--env-from-secret", "hf-token"), "--env-from-secret"),
    Case("claim-name-on-slurm", "ddpk", ("render", "-t", "slurm", "--checkpoint-pvc", "my-claim"), "--checkpoint-pvc"),
    Case("data-and-checkpoint-same-mount", "ddpk",
         ("render", "--data-pvc", "data", "--data-mount", "/checkpoints"), "--data-mount"),
    Case("reserved-env", "ddpk", (*SUBMIT, "--env", "WORLD_SIZE=8"), "--env"),
    Case("env-given-twice", "ddpk", ("render", "--env", "A=1", "--env", "A=2"), "--env"),
    Case("nproc-zero", "ddpk", (*SUBMIT, "--nproc-per-node", "0"), "--nproc-per-node"),
    Case("max-restarts-negative", "ddpk", ("render", "--max-restarts", "-1"), "--max-restarts"),
    Case("unknown-target", "ddpk", ("render", "--target", "helm"), "--target"),
    Case("output-dir-is-a-file", "ddpk", ("render", "--output-dir", "{file}"), "--output-dir", setup=a_file),
    Case("unknown-scheduler", "ddpk", (*SUBMIT, "-s", "nomad"), "--scheduler"),
    Case("logs-bad-since", "ddpk", ("logs", "some-job", "--since", "5days"), "--since"),
    Case("logs-unknown-job", "ddpk", ("logs", "ghost-job", "-s", "local"), "ghost-job"),
    Case("status-bad-output", "ddpk", ("status", "some-job", "-o", "xml"), "--output"),
    Case("wait-bad-timeout", "ddpk", ("wait", "some-job", "--timeout", "soon"), "--timeout"),
    Case("delete-unknown-job", "ddpk", ("delete", "ghost-job", "-s", "local"), "ghost-job"),
    Case("kubeconfig-missing", "ddpk", (*SUBMIT, "-s", "kubernetes", "--kubeconfig", "nowhere.yaml"), "--kubeconfig"),
    Case("kubernetes-unreachable", "ddpk", ("list", "-s", "kubernetes", "--kubeconfig", "{kubeconfig}"),
         "127.0.0.1:1", code=UNREACHABLE, setup=kubeconfig_to_nowhere),
    Case("docker-unreachable", "ddpk", ("submit", "-s", "docker", "--name", "no-engine"), "no-engine.sock",
         code=UNREACHABLE, setup=docker_host_to_nowhere, env=(("DOCKER_HOST", "{sock}"),)),
    Case("missing-image-never-pull", "ddpk",
         ("submit", "-s", "docker", "--name", "bad-image-a", "--image", "ddpk-missing:0", "--image-pull-policy", "Never"),
         "--image", docker=True),
    Case("missing-image-unpullable", "ddpk",
         ("submit", "-s", "docker", "--name", "bad-image-b", "--image", "localhost:1/ddpk-missing:0"),
         "--image", docker=True),
    # the config file (./ddpk.toml)
    Case("config-malformed", "ddpk", SUBMIT, "ddpk.toml", setup=config("replicas = \n")),
    Case("config-unknown-key", "ddpk", SUBMIT, "gpu_count", setup=config("gpu_count = 1\n")),
    Case("config-wrong-type", "ddpk", SUBMIT, "replicas", setup=config("replicas = 'two'\n")),
    Case("config-bad-value", "ddpk", SUBMIT, "name", setup=config("name = 'Bad_Name'\n")),
    Case("config-not-utf8", "ddpk", SUBMIT, "ddpk.toml", setup=config(b"replicas = 2\nname = '\xff'\n")),
    Case("config-env-not-strings", "ddpk", SUBMIT, "env", setup=config("[env]\nA = 1\n")),
    Case("config-file-missing", "ddpk", (*SUBMIT, "--config", "missing.toml"), "--config"),
    # trainer flags
    Case("train-epochs-zero", TRAIN, ("--epochs", "0"), "--epochs"),
    Case("train-lr-zero", TRAIN, ("--lr", "0"), "--lr"),
    Case("train-batch-size-text", TRAIN, ("--batch-size", "big"), "--batch-size"),
    Case("train-unknown-model", TRAIN, ("--model", "vgg99"), "--model"),
    Case("train-unknown-dataset", TRAIN, ("--dataset", "mnist"), "--dataset"),
    Case("train-amp-fp8", TRAIN, ("--amp", "fp8"), "--amp"),
    Case("train-label-smoothing-one", TRAIN, ("--label-smoothing", "1.0"), "--label-smoothing"),
    Case("train-timeout-zero", TRAIN, ("--timeout", "0"), "--timeout"),
    Case("train-unknown-flag", TRAIN, ("--learning-rate", "0.1"), "--learning-rate"),
    Case("train-download-synthetic", TRAIN, ("--download",), "--download"),
    Case("train-checkpoint-every-without-dir", TRAIN, ("--checkpoint-every", "5"), "--checkpoint-every"),
    Case("train-nccl-on-cpu", TRAIN, ("--backend", "nccl", "--device", "cpu"), "--backend"),
    Case("train-dp-with-two-ranks", TRAIN, ("--strategy", "dp"), "--strategy",
         env=(("WORLD_SIZE", "2"), ("RANK", "0"))),
    Case("train-resume-missing-file", TRAIN, ("--resume", "nowhere.pt"), "--resume"),
    Case("train-checkpoint-dir-unwritable", TRAIN, ("--checkpoint-dir", "{ro}"), "--checkpoint-dir",
         setup=immutable_dir),
    Case("train-checkpoint-dir-under-a-file", TRAIN, ("--checkpoint-dir", "{file}/ckpt"), "--checkpoint-dir",
         setup=a_file),
    Case("train-metrics-file-is-a-folder", TRAIN, ("--metrics-file", "{empty}"), "--metrics-file", setup=empty_dir),
    # data files
    Case("cifar-missing-data-dir", TRAIN, ("--dataset", "cifar10", "--data-dir", "no-such-dir"), "--data-dir"),
    Case("cifar-without-data-dir", TRAIN, ("--dataset", "cifar10"), "--data-dir"),
    Case("cifar-empty-data-dir", TRAIN, ("--dataset", "cifar10", "--data-dir", "{empty}"), "--data-dir",
         setup=empty_dir),
    Case("cifar-truncated-batch", TRAIN, ("--dataset", "cifar10", "--data-dir", "{data}"), "data_batch_3",
         setup=cifar_batches(truncate("data_batch_3"))),
    Case("cifar-corrupt-test-batch", TRAIN, ("--dataset", "cifar10", "--data-dir", "{data}"), "test_batch",
         setup=cifar_batches(overwrite("test_batch", random.Random(7).randbytes(4096)))),
    Case("cifar-wrong-shape", TRAIN, ("--dataset", "cifar10", "--data-dir", "{data}"), "data_batch_1",
         setup=cifar_batches(wrong_shape("data_batch_1"))),
    Case("imagefolder-without-train-folder", TRAIN, ("--dataset", "imagefolder", "--data-dir", "{empty}"),
         "--data-dir", setup=empty_dir),
    Case("corrupt-checkpoint", TRAIN, ("--dataset", "fake", "--checkpoint-dir", "{ckpt}", "--resume", "{newest}"),
         "--resume", setup=checkpoint_dir_with(lambda: b"PK\x03\x04 not really a zip")),
    Case("foreign-checkpoint", TRAIN, ("--dataset", "fake", "--checkpoint-dir", "{ckpt}", "--resume", "{newest}"),
         "--resume", setup=checkpoint_dir_with(foreign_torch_file)),
    # launcher flags and environment
    Case("launch-rdzv-timeout-zero", "ddpk-launch", ("--rdzv-timeout", "0"), "--rdzv-timeout"),
    Case("launch-nproc-text", "ddpk-launch", ("--nproc-per-node", "many"), "--nproc-per-node"),
    Case("launch-nnodes-text", "ddpk-launch", (), "DDPK_NNODES",
         env=(("DDPK_NNODES", "abc"), ("JOB_COMPLETION_INDEX", "0"), ("MASTER_ADDR", "x"), ("MASTER_PORT", "1"))),
]


# --- running the rows ----------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    code: int
    out: str
    err: str
    before: dict[str, tuple]
    after: dict[str, tuple]
    leftovers: list[str]


def program(name: str) -> str:
    """A console script beside the interpreter running the tests (same venv), else PATH's."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e trainer -e cli)"
    return found


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every path under ``folder`` with its type, size and content hash."""
    import hashlib

    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = ("file", path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def docker_objects(job: str) -> list[str]:
    """Containers, networks and volumes a docker job named ``job`` would have created."""
    queries = {
        "container": ["ps", "-a", "--filter", f"label=ddpk.job={job}", "--format", "{{.Names}}"],
        "network": ["network", "ls", "--filter", f"name={job}", "--format", "{{.Name}}"],
        "volume": ["volume", "ls", "--filter", f"name={job}", "--format", "{{.Name}}"],
    }
    found = []
    for kind, query in queries.items():
        listed = subprocess.run(["docker", *query], capture_output=True, text=True, timeout=60)
        found += [f"{kind} {name}" for name in listed.stdout.split()]
    return found


def docker_answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def job_name(case: Case) -> str | None:
    return case.args[case.args.index("--name") + 1] if "--name" in case.args else None


def run_case(case: Case, folder: Path, values: dict[str, str]) -> Outcome:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV and not k.startswith(CLEARED_PREFIXES)}
    env.update(DDPK_HOME=str(folder / "ddpk-home"), XDG_CONFIG_HOME=str(folder / "config"), NO_COLOR="1")
    env.update({k: v.format(**values) for k, v in case.env})
    argv = [program(case.program), *(a.format(**values) for a in case.args)]
    before = snapshot(folder)
    proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    after = snapshot(folder)
    leftovers = docker_objects(job_name(case)) if case.docker else []
    clean_up(case, folder, env)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, before, after, leftovers)


def clean_up(case: Case, folder: Path, env: dict[str, str]) -> None:
    """Remove what a row wrongly created, so a defect does not leave a job running."""
    runs = folder / "ddpk-home" / "runs"
    if runs.is_dir():
        for job in runs.iterdir():
            subprocess.run([program("ddpk"), "delete", job.name, "-s", "local"], env=env, capture_output=True,
                           timeout=60)
    if case.docker and job_name(case):
        subprocess.run([program("ddpk"), "delete", job_name(case), "-s", "docker", "--volumes"], env=env,
                       capture_output=True, timeout=60)
    release_immutable(folder)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, Outcome]:
    """Run the selected rows, a few at a time."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("case"), Case)}
    engine = docker_answers()
    cases = [c for c in CASES if c.id in selected and (engine or not c.docker)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        prepared = []
        for case in cases:
            folder = tmp_path_factory.mktemp(case.id)
            values = {"busy_port": str(busy.getsockname()[1])}
            if case.setup is not None:
                values.update(case.setup(folder))
            prepared.append((case, folder, values))
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = {case.id: pool.submit(run_case, case, folder, values) for case, folder, values in prepared}
            return {case_id: future.result() for case_id, future in futures.items()}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.e2e] if c.docker else [])
                                  for c in CASES])
def test_bad_input_is_refused_with_one_line_and_nothing_applied(case, outcomes):
    if case.id not in outcomes:
        assert case.docker
        if os.environ.get("DDPK_REQUIRE_DOCKER") == "1":
            pytest.fail("DDPK_REQUIRE_DOCKER=1 but no Docker engine answers", pytrace=False)
        pytest.skip("no Docker engine answers")
    result = outcomes[case.id]
    said = f"exit {result.code}\nstdout: {result.out[-1500:]}\nstderr: {result.err[-3000:]}"
    assert "Traceback" not in result.err + result.out, f"a traceback instead of one line:\n{said}"
    assert result.code == case.code, f"expected exit {case.code}:\n{said}"
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr:\n{said}"
    assert case.names in lines[0], f"the message does not name {case.names!r}: {lines[0]}"
    created = sorted(set(result.after) - set(result.before))
    changed = sorted(k for k in result.before if result.after.get(k) != result.before[k])
    assert not created and not changed, f"half-applied: created {created}, changed {changed}\n{said}"
    assert result.leftovers == [], f"left in the Docker engine: {result.leftovers}"

