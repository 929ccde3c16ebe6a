"""The sbatch script: valid bash, clean under shellcheck, one task per node, the gang rerun on failure."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest
from render_cases import CASES

from ddpk.render import render

pytestmark = pytest.mark.unit

SLURM_CASES = {
    name: dataclasses.replace(spec, env_from_secrets=[], data_pvc=None, checkpoint_pvc=None)
    for name, spec in CASES.items()
}
SLURM_CASES["paths"] = dataclasses.replace(
    CASES["two-cpu"], data_pvc="/shared/data set", checkpoint_pvc="/shared/ckpt", env={"NOTE": "it's $HOME; `x`"}
)


def scripts() -> list:
    return [
        pytest.param(render(spec, "slurm", container=container), id=f"{name}-container={container}")
        for name, spec in sorted(SLURM_CASES.items())
        for container in (False, True)
    ]


@pytest.mark.parametrize("script", scripts())
def test_bash_parses_it(script, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", scripts())
def test_shellcheck_is_clean(script, tmp_path):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck)")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


def test_directives():
    spec = SLURM_CASES["two-gpu-queue"]
    script = render(spec, "slurm")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=1" in lines
    assert "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --time=1440" in lines
    assert not any("--gpus-per-node" in line for line in render(SLURM_CASES["two-cpu"], "slurm").splitlines())
    cpu = render(SLURM_CASES["two-cpu"], "slurm").splitlines()
    assert "#SBATCH --cpus-per-task=1" in cpu and "#SBATCH --mem=4096M" in cpu


def test_master_is_the_first_host_and_srun_runs_the_launcher():
    spec = SLURM_CASES["two-cpu"]
    script = render(spec, "slurm")
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"' in script
    srun = next(line.strip() for line in script.splitlines() if line.strip().startswith("srun "))
    assert "ddpk-launch --rdzv-timeout 600 -- --epochs 2 --model convnet" in srun
    assert "--container-image" not in srun
    container = render(spec, "slurm", container=True)
    assert f"--container-image={spec.image}" in container


def _run(script: str, tmp_path, srun_exits: list[int]) -> tuple[int, int]:
    """Run the script with stub scontrol/srun that exit with the given codes; (exit code, srun calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\necho node2\n")
    calls = tmp_path / "calls"
    codes = " ".join(str(c) for c in srun_exits)
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho x >> "{calls}"\nn=$(wc -l < "{calls}")\ncodes=({codes})\nexit "${{codes[$((n-1))]}}"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(tmp_path)}
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert calls.exists(), (result.returncode, result.stdout, result.stderr)
    return result.returncode, len(calls.read_text().splitlines())


def test_gang_reruns_until_max_restarts(tmp_path):
    spec = dataclasses.replace(SLURM_CASES["two-cpu"], max_restarts=2)
    assert _run(render(spec, "slurm"), tmp_path, [1, 137, 0]) == (0, 3)


def test_gives_up_after_max_restarts(tmp_path):
    spec = dataclasses.replace(SLURM_CASES["two-cpu"], max_restarts=1)
    assert _run(render(spec, "slurm"), tmp_path, [1, 1, 0]) == (1, 2)


def test_user_error_is_never_rerun(tmp_path):
    assert _run(render(SLURM_CASES["two-cpu"], "slurm"), tmp_path, [2, 0]) == (2, 1)
