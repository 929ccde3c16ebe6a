"""ddpk-launch on every path it supports, with two nodes emulated as two local launchers.

Each node is a real ddpk-launch process on 127.0.0.1 with the variables its
environment would set; together they train a few steps of the demo with gloo.
Also here: the launcher's bounded waits, and the gang behaviour when a rank fails.
"""

import json
import os
import re
import signal
import sys
import time

import pytest

from trainer_helpers import clean_env, free_port, run, script, start

pytestmark = pytest.mark.integration

# `fake` is the cheapest set to build; these tests are about who talks to whom, not learning.
TRAIN = ["--dataset", "fake", "--max-steps", "3", "--batch-size", "16", "--resume", "none"]
SUMMARY = re.compile(r"^ddpk-train: done .* eval_acc=(\d\.\d+)$", re.M)


def _node_envs(kind: str, port: int) -> list[dict[str, str]]:
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if kind == "indexed-job":
        return [clean_env(JOB_COMPLETION_INDEX=str(i), DDPK_NNODES="2", DDPK_NPROC_PER_NODE="1", **common)
                for i in range(2)]
    if kind == "pytorchjob":
        return [clean_env(RANK=str(i), WORLD_SIZE="2", PET_NNODES="2", PET_NPROC_PER_NODE="1",
                          PET_NODE_RANK=str(i), **common) for i in range(2)]
    if kind == "slurm":
        return [clean_env(SLURM_PROCID=str(i), SLURM_NTASKS="2", SLURM_NODEID=str(i), SLURM_LOCALID="0",
                          SLURM_JOB_NODELIST="node[01-02]", SLURM_JOB_NUM_NODES="2", **common) for i in range(2)]
    raise ValueError(kind)


def _finish(procs, timeout=240):
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except Exception:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
        outs.append(out)
    return [p.returncode for p in procs], outs


@pytest.mark.parametrize("kind", ["indexed-job", "pytorchjob", "slurm"])
def test_two_emulated_nodes_train_together(kind):
    port = free_port()
    procs = [start([script("ddpk-launch"), "--", *TRAIN], env) for env in _node_envs(kind, port)]
    codes, outs = _finish(procs)
    assert codes == [0, 0], outs
    for rank, out in enumerate(outs):
        assert f"ddpk-launch: environment={kind} node_rank={rank} nnodes=2 nproc_per_node=1 world_size=2" in out
    assert "world_size=2" in outs[0] and SUMMARY.search(outs[0]), outs[0]
    assert not SUMMARY.search(outs[1])  # rank 0 alone reports


def test_two_emulated_nodes_under_torchrun():
    port = free_port()
    procs = [
        start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               script("ddpk-launch"), "--", *TRAIN], clean_env())
        for i in range(2)
    ]
    codes, outs = _finish(procs)
    assert codes == [0, 0], outs
    assert "ddpk-launch: environment=torchrun node_rank=0 nnodes=2 nproc_per_node=1 world_size=2" in outs[0]
    assert "environment=torchrun node_rank=1" in outs[1]
    assert SUMMARY.search(outs[0]), outs[0]


def test_single_node_starts_two_local_ranks(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = run([script("ddpk-launch"), "--nproc-per-node", "2", "--", *TRAIN, "--metrics-file", str(metrics)],
                 clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ddpk-launch: environment=single node_rank=0 nnodes=1 nproc_per_node=2 world_size=2" in result.stdout
    assert len(SUMMARY.findall(result.stdout)) == 1
    (record,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert record["world_size"] == 2 and record["step"] == 3 and 0 <= record["eval_acc"] <= 1
    assert {"epoch", "train_loss", "eval_loss", "samples_per_sec", "elapsed_s"} <= record.keys()


def test_failing_rank_takes_the_gang_down_with_its_exit_code(tmp_path):
    # Only rank 0 checks the checkpoint folder, so rank 1 goes on to wait at the rendezvous
    # (for --timeout 300 s): the launcher must stop it and exit with rank 0's 2.
    (tmp_path / "file").write_text("")
    result = run([script("ddpk-launch"), "--nproc-per-node", "2", "--", "--checkpoint-dir", str(tmp_path / "file" / "x")],
                 clean_env(), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and "--checkpoint-dir" in lines[0]


def test_master_name_that_never_resolves_is_a_bounded_wait():
    env = clean_env(JOB_COMPLETION_INDEX="1", DDPK_NNODES="2", MASTER_ADDR="ddpk-absent-0.ddpk-absent.invalid",
                    MASTER_PORT="29500")
    t0 = time.monotonic()
    result = run([script("ddpk-launch"), "--rdzv-timeout", "5", "--", *TRAIN], env, timeout=60)
    elapsed = time.monotonic() - t0
    assert result.returncode not in (0, 2)  # retryable: the pod may come up on the next try
    assert "ddpk-absent-0.ddpk-absent.invalid" in result.stderr and "did not resolve" in result.stderr
    assert elapsed <= 5 * 1.1


def test_master_port_that_never_opens_is_a_bounded_wait():
    port = free_port()
    env = clean_env(JOB_COMPLETION_INDEX="1", DDPK_NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.monotonic()
    result = run([script("ddpk-launch"), "--rdzv-timeout", "5", "--", *TRAIN], env, timeout=60)
    elapsed = time.monotonic() - t0
    assert result.returncode not in (0, 2)
    assert f"'127.0.0.1' accepted no connection on port {port}" in result.stderr
    assert elapsed <= 5 * 1.1


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_worker_ranks_start_before_the_master_and_their_timeout_starts_with_it():
    # A worker node's ranks start once the master's name resolves and get ready (torch, data,
    # model) while the launcher waits for the port; they hold at the gate until it opens. The
    # master here comes up 20 s later, four times the collective --timeout: had a rank begun its
    # rendezvous at once, it would have given up waiting for the store before the master came.
    port = free_port()
    env0, env1 = _node_envs("indexed-job", port)
    train = [*TRAIN, "--timeout", "5"]
    node1 = start([script("ddpk-launch"), "--rdzv-timeout", "120", "--", *train], env1)
    node0 = None
    try:
        deadline = time.monotonic() + 60
        while not _children(node1.pid):
            assert time.monotonic() < deadline and node1.poll() is None, "the worker's rank never started"
            time.sleep(0.05)
        time.sleep(20)
        assert node1.poll() is None and _children(node1.pid), "the worker gave up before its master came"
        node0 = start([script("ddpk-launch"), "--", *train], env0)
        codes, outs = _finish([node0, node1])
    finally:
        _kill_nodes(*[n for n in (node0, node1) if n is not None])
    assert codes == [0, 0], outs
    assert SUMMARY.search(outs[0]), outs[0]


def _two_nodes_past_first_checkpoint(tmp_path, extra: list[str]):
    """Two emulated nodes training, returned once a checkpoint shows training is under way."""
    port = free_port()
    train = ["--epochs", "50", "--batch-size", "16", "--resume", "none", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "2", *extra]
    node0, node1 = [start([script("ddpk-launch"), "--", *train], env) for env in _node_envs("indexed-job", port)]
    deadline = time.monotonic() + 180
    while not any(n.startswith("ckpt-") for n in os.listdir(tmp_path)):
        if time.monotonic() >= deadline or node0.poll() is not None:
            _kill_nodes(node0, node1)
            raise AssertionError(node0.communicate()[0])
        time.sleep(0.05)
    return node0, node1


def _kill_nodes(*nodes) -> None:
    for proc in nodes:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_rank_whose_peer_hangs_mid_all_reduce_exits_within_the_collective_timeout(tmp_path):
    timeout_s = 10
    node0, node1 = _two_nodes_past_first_checkpoint(tmp_path, ["--timeout", str(timeout_s)])
    try:
        (peer,) = _children(node1.pid)
        os.kill(peer, signal.SIGSTOP)  # a peer that vanished without closing its sockets
        t0 = time.monotonic()
        out, _ = node0.communicate(timeout=timeout_s * 3)
        elapsed = time.monotonic() - t0
    finally:
        _kill_nodes(node0, node1)
        for child in _children(node1.pid) if node1.poll() is None else []:
            os.kill(child, signal.SIGKILL)
        node1.wait()
    assert node0.returncode not in (0, 2), out
    # Where the hang meets the survivor decides gloo's wording: "Timed out waiting ... for recv"
    # in an all-reduce, "Application timeout caused pair closure" in DDP's buffer broadcast.
    assert re.search(r"^ddpk-train: rank 0: collective failed: .*([Tt]imed out|timeout)", out, re.M), out
    assert "Traceback" not in out, out
    assert elapsed <= timeout_s * 1.1, out


def test_survivor_of_a_killed_peer_says_collective_failed_in_one_line(tmp_path):
    node0, node1 = _two_nodes_past_first_checkpoint(tmp_path, [])
    try:
        os.killpg(node1.pid, signal.SIGKILL)  # the peer's whole node, its sockets closed by the kernel
        out, _ = node0.communicate(timeout=120)
    finally:
        _kill_nodes(node0, node1)
        for proc in (node0, node1):
            proc.wait()
    assert node0.returncode not in (0, 2), out
    assert "Traceback" not in out, out
    assert re.search(r"^ddpk-train: rank 0: collective failed: .+$", out, re.M), out
