"""Section 2: DDP scaling on CPU, per-rank samples/s at 2 ranks over 1 rank, and the all-reduce share."""

from __future__ import annotations

import json
import subprocess
import sys

from .common import Row, Section
from .training import ROUNDS, Workspace, alternate, child_env, plans, run_trainer, run_trainer_side_by_side, steady_rate

NAME = "scaling"
TARGET = 0.85


def allreduce_share(ws: Workspace, model: str, batch: int, steps: int) -> dict:
    out = ws.run_dir() / "allreduce.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.allreduce", "--model", model, "--batch-size", str(batch),
           "--steps", str(steps), "--num-threads", "1", "--out", str(out)]
    env = child_env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.allreduce exited {proc.returncode}: {proc.stdout.strip()[-500:]}")
    return json.loads(out.read_text())


def run(ws: Workspace, quick: bool) -> Section:
    sec = Section()
    for model, plan in plans(quick).items():
        # One rank reads the same files, so its epoch is twice the steps at the same per-rank batch.
        # The throughput section measures both sides in its rounds; run alone, this one does.
        got = alternate({
            "trainer": lambda r: run_trainer(ws, plan, 2, repeat=r),
            "trainer-1": lambda r: run_trainer(ws, plan, 1, repeat=r),
        }, 1 if quick else ROUNDS)
        two, one = got.median("trainer") / 2, got.median("trainer-1")
        eff, _, _ = got.ratio("trainer", "trainer-1", scale=0.5)
        sec.rows.append(Row(NAME, f"{model} per-rank samples/s, 2 ranks × 1 thread over 1 rank × 1 thread",
                            two, "samples/s/rank", one, "1 rank", eff, f"≥ {TARGET}", eff >= TARGET,
                            note=got.spread("trainer", "trainer-1", scale=0.5)))
        pair = [steady_rate(m) for m in run_trainer_side_by_side(ws, plan)]
        ceiling = sum(pair) / len(pair)
        sec.rows.append(Row(NAME, f"{model} machine ceiling: two independent 1-rank trainers at once, "
                                  "per process, over 1 rank alone", ceiling, "samples/s/process", one,
                            "1 rank", ceiling / one, "report"))
        sec.rows.append(Row(NAME, f"{model} DDP per rank over that ceiling", two, "samples/s/rank", ceiling,
                            "independent processes", two / ceiling, "report"))
        # About five seconds of timed steps of each kind per model.
        steps = {"convnet": 40, "resnet18": 6}[model] // (4 if quick else 1) or 1
        share = allreduce_share(ws, model, plan.batch, steps)
        sec.rows.append(Row(NAME, f"{model} all-reduce share of a DDP step "
                            f"({share['grad_mb']:.1f} MB of fp32 gradients)",
                            100 * share["allreduce_share"], "%", None, "", None, "report",
                            note=f"step {1000 * share['step_s']:.0f} ms, "
                                 f"no_sync {1000 * share['no_sync_step_s']:.0f} ms"))
    sec.notes.append(
        "machine ceiling: two single-rank trainers started together on the same files, never "
        "communicating; what they lose against one alone is the cores' own contention (shared caches, "
        "memory bandwidth, other load), which no DDP implementation can win back.")
    sec.notes.append(
        "all-reduce share: median DDP step against median `no_sync()` step, timed alternately on "
        "in-memory random batches after a barrier (bench/allreduce.py), same model and per-rank batch; "
        "it counts the communication backward does not hide plus waiting for the slower rank.")
    return sec
