"""--help, render and submit --dry-run import neither torch nor the cluster/engine SDKs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import json, sys
from ddpk.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "kubernetes", "docker", "ddpk_trainer") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["submit", "--help"],
        ["render", "--replicas", "2", "--name", "fast"],
        ["render", "--target", "slurm", "--replicas", "2", "--name", "fast"],
        ["submit", "--dry-run", "--replicas", "2", "--name", "fast"],
        ["submit", "--dry-run", "-s", "kubernetes", "--replicas", "2", "--name", "fast"],
        ["submit", "--dry-run", "-s", "docker", "--replicas", "2", "--name", "fast"],
    ],
)
def test_light_commands_import_no_heavy_module(tmp_path, args):
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "DDPK_HOME": str(tmp_path / "home")})
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), proc.stderr
    assert report["heavy"] == []
    assert not (tmp_path / "home").exists()
