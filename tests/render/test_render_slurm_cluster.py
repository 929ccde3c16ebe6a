"""The rendered sbatch script under a real single-node Slurm (Debian slurm-wlm + munge), started and stopped here.

Two Slurm nodes need two hosts, so the 2-node script is submitted with
``--nodes=1 --ntasks-per-node=2`` on the command line (which overrides its
#SBATCH lines): two tasks on one host, each a ddpk-launch "node" with one rank,
exactly as they would be on two hosts. The training is tiny; the real launcher
and trainer from this environment do it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ddpk.render import render
from ddpk.spec import JobSpec

pytestmark = pytest.mark.slurm

DAEMONS = ("mungekey", "munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel")
START_TIMEOUT_S = 60
JOB_TIMEOUT_S = 300
# The daemons live in /usr/sbin, which a non-login PATH may lack; ddpk-launch lives beside this Python.
SEARCH_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), "/usr/sbin"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 8) -> str:
    if not path.exists():
        return f"({path.name}: no log)"
    return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])


class Cluster:
    """munged, slurmctld and slurmd in the foreground, their files under one directory."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o700)
        self.socket = root / "munge" / "munge.sock"
        self.conf = root / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)
        self.env["PATH"] = SEARCH_PATH

    def write_conf(self) -> None:
        r = self.root
        self.conf.write_text(
            f"""ClusterName=ddpktest
SlurmctldHost={self.node}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
# No cgroups: containers rarely delegate them, and nothing here needs confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def spawn(self, *argv: str) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}.out", "wb")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    def start(self) -> str | None:
        """None when the node is idle and takes jobs, else why not."""
        key = self.root / "munge" / "munge.key"
        made = subprocess.run(["mungekey", "--create", f"--keyfile={key}"], capture_output=True, text=True)
        if made.returncode != 0:
            return f"mungekey failed: {made.stderr.strip()}"
        key.chmod(0o400)
        self.spawn("munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                   f"--log-file={self.root / 'log' / 'munged.log'}",
                   f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                   f"--seed-file={self.root / 'munge' / 'munged.seed'}")
        self.write_conf()
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                return f"munged did not start: {tail(self.root / 'log' / 'munged.log')}"
            time.sleep(0.1)
        self.spawn("slurmctld", "-D", "-i")
        self.spawn("slurmd", "-D")
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                return f"{', '.join(dead)} exited: " + tail(self.root / "log" / f"{dead[0]}.log")
            out = subprocess.run(["sinfo", "--noheader", "--format=%t"], env=self.env, capture_output=True, text=True)
            state = (out.stdout or out.stderr).strip()
            if state == "idle":
                return None
            time.sleep(0.5)
        return (f"node never became idle (last state {state!r}): slurmctld: {tail(self.root / 'log' / 'slurmctld.log')}"
                f"; slurmd: {tail(self.root / 'log' / 'slurmd.log')}")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def cluster():
    missing = [name for name in DAEMONS if shutil.which(name, path=SEARCH_PATH) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start job steps")
    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)
    except OSError:
        pytest.skip(f"this host's name {node!r} does not resolve, and Slurm's node name must")
    # A Unix socket path must fit 108 bytes; pytest's temporary paths can be longer.
    root = Path(tempfile.mkdtemp(prefix="ddpk-slurm-"))
    c = Cluster(root)
    try:
        reason = c.start()
        if reason is not None:
            pytest.skip(f"Slurm could not start here: {reason}")
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_sbatch_script_trains_to_completion_under_slurm(cluster):
    port = free_port()
    spec = JobSpec(
        name="slurm-smoke",
        replicas=2,
        nproc_per_node="1",
        port=port,
        rdzv_timeout_s=60,
        max_restarts=0,
        trainer_args=["--epochs", "1", "--max-steps", "4", "--batch-size", "16"],
    )
    script = cluster.root / "job.sbatch"
    script.write_text(render(spec, "slurm"))
    try:
        result = subprocess.run(
            ["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks-per-node=2", str(script)],
            cwd=cluster.root, env=cluster.env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not finish in {JOB_TIMEOUT_S} s: {tail(cluster.root / 'log' / 'slurmd.log')}")
    job_id = result.stdout.strip().split(";")[0]
    output = (cluster.root / f"slurm-smoke-{job_id}.out").read_text(errors="replace")
    assert result.returncode == 0, f"{result.stderr}\n{output}"
    launches = re.findall(r"ddpk-launch: environment=slurm node_rank=(\d) nnodes=2 nproc_per_node=1 world_size=2 "
                          rf"master=(\S+):{port}", output)
    assert sorted(rank for rank, _ in launches) == ["0", "1"], output
    assert {master for _, master in launches} == {cluster.node}
    assert re.search(r"ddpk-train: done steps=4 world_size=2 .*eval_acc=[0-9.]+$", output, re.M), output
    checkpoints = cluster.root / "slurm-smoke-checkpoints"
    assert any(checkpoints.glob("*.pt")), sorted(p.name for p in checkpoints.iterdir())
    assert (checkpoints / "metrics.jsonl").stat().st_size > 0
