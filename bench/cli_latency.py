"""Section 3: wall time of the everyday CLI commands, against TorchX in the same run.

TorchX comes from PyPI into its own venv, bench/.torchx-venv (git-ignored), created on
first use with `pip install "torchx[kubernetes]"`: torchx itself does not depend on
torch, and its kubernetes scheduler needs the kubernetes client to render a dry run.
Every command runs once to warm the page cache, then `repeats` times; the figure is
the median wall time of the whole process, start to exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import REPO, Row, Section, median, timed_run, tool

NAME = "cli"
TARGET_S = 0.3
RENDER_TARGET_S = 0.5
TARGET_RATIO = 3.0
TORCHX_VENV = REPO / "bench" / ".torchx-venv"


def torchx() -> Path:
    """The torchx console script in the bench's own venv, installed on first use."""
    exe = TORCHX_VENV / "bin" / "torchx"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TORCHX_VENV)], check=True)
        subprocess.run([str(TORCHX_VENV / "bin" / "pip"), "install", "--quiet", "torchx[kubernetes]"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    return exe


def _torchx_version() -> str:
    proc = subprocess.run([str(TORCHX_VENV / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('torchx'))"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"


def wall(cmd: list[str], cwd: Path, env: dict, repeats: int) -> float:
    timed_run(cmd, cwd=cwd, env=env)
    return median([timed_run(cmd, cwd=cwd, env=env) for _ in range(repeats)])


def run(quick: bool) -> Section:
    sec = Section()
    repeats = 3 if quick else 9
    ddpk = tool("ddpk")
    with tempfile.TemporaryDirectory(prefix="ddpk-bench-cli-") as tmp:
        cwd = Path(tmp)
        (cwd / "x.py").write_text("print('hello')\n")
        # A clean home: no user config file changes what either tool does.
        env = dict(os.environ, HOME=str(cwd), XDG_CONFIG_HOME=str(cwd / ".config"), NO_COLOR="1")
        for var in ("KUBECONFIG", "DDPK_CONFIG"):
            env.pop(var, None)
        ours = {
            "help": wall([ddpk, "--help"], cwd, env, repeats),
            "render": wall([ddpk, "render", "--name", "bench", "--replicas", "256"], cwd, env, repeats),
            "dryrun": wall([ddpk, "submit", "-s", "kubernetes", "--dry-run", "--name", "bench",
                            "--replicas", "2"], cwd, env, repeats),
        }
        theirs: dict[str, float] = {}
        try:
            tx = str(torchx())
            theirs["help"] = wall([tx, "--help"], cwd, env, repeats)
            # --workspace "" stops torchx from building an image of the working tree, which a dry
            # run would otherwise do; queue is the one option its kubernetes scheduler requires.
            theirs["dryrun"] = wall([tx, "run", "--dryrun", "--workspace", "", "-s", "kubernetes",
                                     "-cfg", "queue=default", "dist.ddp", "-j", "2x1", "--script", "x.py"],
                                    cwd, env, repeats)
            sec.notes.append(f"torchx {_torchx_version()} in bench/.torchx-venv (pip install "
                             "\"torchx[kubernetes]\"; it pulls no torch); dry run: `torchx run --dryrun "
                             "--workspace '' -s kubernetes -cfg queue=default dist.ddp -j 2x1 --script x.py`.")
        except (subprocess.SubprocessError, OSError, RuntimeError) as err:
            sec.notes.append(f"torchx rows skipped: could not install or run torchx ({err}).")

    def row(key: str, label: str, base_label: str) -> Row:
        base = theirs.get(key)
        ratio = base / ours[key] if base else None
        met = ours[key] <= TARGET_S and (ratio is None or ratio >= TARGET_RATIO)
        return Row(NAME, label, ours[key], "s", base, base_label if base else "", ratio,
                   f"≤ {TARGET_S} s, ≥ {TARGET_RATIO:.0f}× faster", met)

    sec.rows.append(row("help", "`ddpk --help`", "`torchx --help`"))
    sec.rows.append(row("dryrun", "`ddpk submit -s kubernetes --dry-run --replicas 2`",
                        "`torchx run --dryrun -s kubernetes dist.ddp -j 2x1`"))
    render_met = ours["render"] <= TARGET_S and ours["render"] < RENDER_TARGET_S
    sec.rows.append(Row(NAME, "`ddpk render --replicas 256`", ours["render"], "s", target="< 0.5 s (issue 4), ≤ 0.3 s",
                        met=render_met))
    sec.notes.append(f"CLI wall times: median of {repeats} runs after one warm-up run, each a fresh process.")
    return sec
