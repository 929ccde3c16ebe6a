"""Section 4: time from `ddpk submit` to the first training step, locally and in Docker.

The bench notes the wall clock, runs `ddpk submit -s SCHED --replicas 2 --follow` with
a one-step convnet job, then reads `ddpk logs --timestamps` (the per-line timestamps
that the local supervisor or dockerd recorded as each line arrived) and measures, from
the moment `ddpk` was started, rank 0's
  - launcher topology line (the pod's entrypoint is running),
  - trainer line `world_size=…`, printed once the process group is up: the gap from the
    launcher line is the trainer's start-up (torch import, data, model) plus the rendezvous,
  - line for step 1. The trainer prints progress every few seconds, not at step 1, so
    the job stops after one step and its epoch-end line is taken: an upper bound that
    includes one pass over the synthetic test split.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from .common import Row, Section, median, tool

NAME = "first step"
TRAINER_ARGS = ["--model", "convnet", "--dataset", "synthetic", "--epochs", "1", "--max-steps", "1",
                "--num-threads", "1"]
IMAGE = "ddpk:cpu"
_TS = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d))")
LAUNCH_RE = re.compile(r"environment=\S+ node_rank=0\b")
RDZV_RE = re.compile(r"ddpk-train: world_size=\d+ ")
STEP_RE = re.compile(r"ddpk-train: (?:epoch \S+ )?step 1\b")
RENDEZVOUS_S_RE = re.compile(r"ddpk-train: world_size=\d+ .* rendezvous_s=([\d.]+)")


def _epoch_seconds(ts: str) -> float:
    head, _, frac = ts.rstrip("Z").partition(".")
    zone = "+00:00"
    if not ts.endswith("Z"):
        head, zone = head[:-6], head[-6:]
        frac = frac[:-6] if frac else frac
    return datetime.fromisoformat(head + zone).timestamp() + float(f"0.{frac or 0}")


def milestones(log_text: str, t0: float) -> dict[str, float]:
    """Seconds from t0 to the first line of each milestone, from `ddpk logs --timestamps` output."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        m = _TS.search(line)
        if not m:
            continue
        text = line[m.end():]
        at = _epoch_seconds(m.group(1)) - t0
        for key, pattern in (("launch", LAUNCH_RE), ("rdzv", RDZV_RE), ("step", STEP_RE)):
            if key not in found and pattern.search(text):
                found[key] = at
        took = RENDEZVOUS_S_RE.search(text)
        if took and "rendezvous" not in found:
            found["rendezvous"] = float(took.group(1))  # the trainer's own init_process_group time
    return found


def one_run(scheduler: str, env: dict, name: str, extra: list[str]) -> dict[str, float]:
    ddpk = tool("ddpk")
    t0 = time.time()
    submit = subprocess.run([ddpk, "submit", "-s", scheduler, "--replicas", "2", "--name", name,
                             "--replace", "--follow", *extra, "--", *TRAINER_ARGS],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=600, check=False)
    try:
        if submit.returncode != 0:
            raise RuntimeError(f"ddpk submit -s {scheduler} exited {submit.returncode}: "
                               + " | ".join(submit.stdout.strip().splitlines()[-4:]))
        read = subprocess.run([ddpk, "logs", name, "-s", scheduler, "--rank", "0", "--timestamps"],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
        if read.returncode != 0:
            raise RuntimeError(f"ddpk logs -s {scheduler} exited {read.returncode}: {read.stderr.strip()[-300:]}")
        logs = read.stdout
    finally:
        # --volumes: the docker scheduler keeps a job's checkpoint volume unless told otherwise.
        cleanup = ["--volumes"] if scheduler == "docker" else []
        subprocess.run([ddpk, "delete", name, "-s", scheduler, *cleanup], env=env, capture_output=True,
                       timeout=120, check=False)
    found = milestones(logs, t0)
    missing = {"launch", "rdzv", "step"} - set(found)
    if missing:
        raise RuntimeError(f"no {', '.join(sorted(missing))} line in rank 0's log:\n"
                           + "\n".join(logs.splitlines()[:12]))
    return found


def one_run_retried(scheduler: str, env: dict, index: int, extra: list[str]) -> dict[str, float]:
    """One measurement, tried a second time under a new name if the first attempt fails: on a
    shared engine another program's cleanup can remove a job's containers under it."""
    # Docker names are host-wide: the pid keeps two bench runs on one engine apart.
    name = f"bench-first-step-{os.getpid()}-{index}"
    try:
        return one_run(scheduler, env, name, extra)
    except RuntimeError:
        return one_run(scheduler, env, name + "-again", extra)


def docker_ready() -> str | None:
    """None when an engine answers and the image exists, else why the docker rows are skipped."""
    import docker
    from docker.errors import DockerException, ImageNotFound

    try:
        client = docker.from_env()
        client.ping()
    except DockerException as err:
        return f"no Docker engine answers ({type(err).__name__})"
    try:
        client.images.get(IMAGE)
    except ImageNotFound:
        return f"image {IMAGE} is not built (make image-cpu)"
    return None


def run(quick: bool) -> Section:
    sec = Section()
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="ddpk-bench-home-") as home:
        env = dict(os.environ, DDPK_HOME=home, NO_COLOR="1")
        targets = [("local", [])]
        why_not = docker_ready()
        if why_not is None:
            targets.append(("docker", ["--image", IMAGE]))
        else:
            sec.notes.append(f"time to first step with -s docker skipped: {why_not}.")
        for scheduler, extra in targets:
            try:
                runs = [one_run_retried(scheduler, env, i, extra) for i in range(repeats)]
            except (RuntimeError, subprocess.SubprocessError) as err:
                # One scheduler failing must not take the other's figures with it.
                sec.notes.append(f"time to first step with -s {scheduler} FAILED: {err}")
                continue
            step = median([r["step"] for r in runs])
            up = median([r["rdzv"] - r["launch"] for r in runs])
            start = median([r["launch"] for r in runs])
            sec.rows.append(Row(NAME, f"`ddpk submit -s {scheduler} --replicas 2` → step 1 done",
                                step, "s", target="report",
                                note=f"launcher running at {start:.2f} s"))
            sec.rows.append(Row(NAME, f"{scheduler}: launcher → process group up "
                                      "(torch import, data, model, rendezvous)", up, "s", target="report"))
            rendezvous = [r["rendezvous"] for r in runs if "rendezvous" in r]
            if rendezvous:
                sec.rows.append(Row(NAME, f"{scheduler}: rendezvous alone (rank 0's init_process_group, "
                                          "waiting for every rank to join)", median(rendezvous), "s",
                                    target="report"))
    sec.notes.append(f"first step: median of {repeats} runs of a convnet/synthetic job, 2 replicas × 1 rank, "
                     "milestones read from rank 0's timestamped log lines (`ddpk logs --timestamps`).")
    return sec
