"""The local scheduler, for real: 2-replica DDP jobs through the console script."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ddpk_exe, run_ddpk

pytestmark = pytest.mark.integration

TINY = ["--epochs", "1", "--max-steps", "12", "--batch-size", "16"]


def marked(run_id: str) -> list[int]:
    """Live processes carrying the job's marker in their environment (the replicas and all their ranks)."""
    needle = f"DDPK_LOCAL_RUN={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def run_id(home: Path, name: str) -> str:
    return json.loads((home / "runs" / name / "plan.json").read_text())["run_id"]


def test_two_replicas_run_to_completion_and_every_view_agrees(ddpk_home):
    result = run_ddpk("submit", "--replicas", "2", "--name", "two", "-f", "--", *TINY, timeout=600)
    assert result.code == 0, result.err
    assert result.out.splitlines()[0].startswith("two -> local (2 replica(s)")
    assert "[rank 0] ddpk-train: done steps=12" in result.out
    assert "eval_acc=" in result.out

    ck = ddpk_home / "runs" / "two" / "checkpoints"
    metrics = [json.loads(line) for line in (ck / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 12 and metrics[-1]["world_size"] == 2
    assert list(ck.glob("ckpt-*.pt"))

    status = json.loads(run_ddpk("status", "two", "-o", "json").out)
    assert status["phase"] == "Succeeded"
    assert [(r["state"], r["restarts"], r["exit_code"]) for r in status["replicas"]] == [("Succeeded", 0, 0)] * 2

    rank1 = run_ddpk("logs", "two", "--rank", "1")
    assert rank1.code == 0
    lines = rank1.out.splitlines()
    assert lines and all(line.startswith("[rank 1] ") for line in lines)
    assert any("node_rank=1" in line for line in lines)

    listed = json.loads(run_ddpk("list", "-o", "json").out)
    assert [(j["name"], j["phase"]) for j in listed] == [("two", "Succeeded")]

    rid = run_id(ddpk_home, "two")
    assert run_ddpk("delete", "two").code == 0
    assert not (ddpk_home / "runs" / "two").exists()
    assert marked(rid) == []
    assert json.loads(run_ddpk("list", "-o", "json").out) == []


def test_a_user_error_fails_the_job_at_once_without_restarts(ddpk_home):
    result = run_ddpk("submit", "--replicas", "2", "--name", "typo", "--max-restarts", "3", "-f",
                      "--", "--epochs", "0", timeout=300)
    assert result.code == 1
    assert "user error" in result.err
    status = json.loads(run_ddpk("status", "typo", "-o", "json").out)
    assert status["phase"] == "Failed" and {r["restarts"] for r in status["replicas"]} == {0}
    assert run_ddpk("delete", "typo").code == 0


def test_a_killed_replica_restarts_the_gang_from_the_last_checkpoint(ddpk_home):
    args = ["--epochs", "1", "--max-steps", "40", "--batch-size", "16", "--checkpoint-every", "5"]
    assert run_ddpk("submit", "--replicas", "2", "--name", "gang", "--", *args).code == 0
    ck = ddpk_home / "runs" / "gang" / "checkpoints"
    wait_until(lambda: list(ck.glob("ckpt-*.pt")), what="a first checkpoint")
    state = json.loads((ddpk_home / "runs" / "gang" / "state.json").read_text())
    os.killpg(state["replicas"][1]["pid"], signal.SIGKILL)

    assert run_ddpk("wait", "gang", "--timeout", "10m", timeout=700).code == 0
    status = json.loads(run_ddpk("status", "gang", "-o", "json").out)
    assert [r["restarts"] for r in status["replicas"]] == [1, 1]
    assert "replica 1 failed with exit code 137 (SIGKILL)" in status["reason"]
    out = run_ddpk("logs", "gang", "--rank", "0").out
    assert "resumed from" in out and "done steps=40" in out
    rid = run_id(ddpk_home, "gang")
    assert run_ddpk("delete", "gang").code == 0
    assert marked(rid) == []


def test_ctrl_c_while_following_ends_every_process_of_the_job(ddpk_home):
    follower = subprocess.Popen([ddpk_exe(), "submit", "--replicas", "2", "--name", "intr", "-f", "--",
                                 "--epochs", "5", "--batch-size", "16"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (ddpk_home / "runs" / "intr" / "state.json").exists(), what="the job to start")
        rid = run_id(ddpk_home, "intr")
        wait_until(lambda: len(marked(rid)) >= 4, what="both replicas and their ranks")
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert follower.returncode == 130, err
    assert marked(rid) == []
    status = json.loads(run_ddpk("status", "intr", "-o", "json").out)
    assert status["phase"] == "Failed" and "interrupted" in status["reason"]
    assert run_ddpk("delete", "intr").code == 0


def test_a_name_clash_names_the_existing_job(ddpk_home):
    assert run_ddpk("submit", "--name", "same", "--", "--epochs", "0").code == 0
    clash = run_ddpk("submit", "--name", "same")
    assert clash.code == 2 and "job same already exists" in clash.err
    replaced = run_ddpk("submit", "--name", "same", "--replace", "-f", "--", "--epochs", "0")
    assert replaced.code == 1 and "user error" in replaced.err
    assert run_ddpk("delete", "same").code == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_busy_port_from_the_config_file_is_refused_before_anything_is_created(ddpk_home):
    port = free_port()
    (ddpk_home.parent / "ddpk.toml").write_text(f"port = {port}\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        refused = run_ddpk("submit", "--name", "busyport")
    assert refused.code == 2 and refused.err == f"error: --port: {port} is in use on this machine\n"
    assert not (ddpk_home / "runs").exists()


def test_without_a_port_each_gang_start_gets_a_free_one(ddpk_home):
    result = run_ddpk("submit", "--name", "anyport", "-f", "--", "--max-steps", "1", "--dataset", "fake",
                      timeout=300)
    assert result.code == 0, result.err
    assert "master=127.0.0.1:29500" not in result.out and "master=127.0.0.1:" in result.out
    assert run_ddpk("delete", "anyport").code == 0


def test_the_given_port_is_the_rendezvous_port_from_the_flag_and_the_config_file(ddpk_home):
    port = free_port()
    result = run_ddpk("submit", "--name", "flagport", "--port", str(port), "-f", "--", "--max-steps", "1",
                      "--dataset", "fake", timeout=300)
    assert result.code == 0, result.err
    assert f"master=127.0.0.1:{port}" in result.out
    assert run_ddpk("delete", "flagport").code == 0
    (ddpk_home.parent / "ddpk.toml").write_text(f"port = {port}\n")
    result = run_ddpk("submit", "--name", "fileport", "-f", "--", "--max-steps", "1", "--dataset", "fake",
                      timeout=300)
    assert result.code == 0, result.err
    assert f"master=127.0.0.1:{port}" in result.out
    assert run_ddpk("delete", "fileport").code == 0
