"""Helpers for the CLI tests: run ``ddpk`` in-process or as the console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Result:
    code: int
    out: str
    err: str


def ddpk_exe() -> str:
    """The console script of the interpreter running the tests (same venv), else PATH's."""
    beside = Path(sys.executable).parent / "ddpk"
    return str(beside) if beside.exists() else shutil.which("ddpk")


@pytest.fixture
def ddpk_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "ddpk-home"
    monkeypatch.setenv("DDPK_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    return home


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``ddpk ARGS`` in this process; returns its exit code and output."""
    from ddpk.cli import main

    monkeypatch.setenv("NO_COLOR", "1")

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def run_ddpk(*args: str, env: dict | None = None, timeout: float = 120, cwd=None) -> Result:
    """Run the real console script."""
    proc = subprocess.run([ddpk_exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    return Result(proc.returncode, proc.stdout, proc.stderr)
