"""Section 3: wall time of the everyday CLI commands, against TorchX in the same run.

TorchX comes from PyPI into its own venv, bench/.torchx-venv (git-ignored), created on
first use with `pip install "torchx[kubernetes]"`: torchx itself does not depend on
torch, and its kubernetes scheduler needs the kubernetes client to render a dry run.
Every command runs once to warm the page cache, then `repeats` times, taking turns with
the command it is compared with; the figure is the median wall time of the whole
process, start to exit, with its CPU time beside it.
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


def wall(cmds: list[list[str]], cwd: Path, env: dict, repeats: int) -> list[tuple[float, float]]:
    """Median wall and CPU seconds of each command. The commands take turns, run after run, so
    that a burst of other load on the machine falls on all of them alike."""
    for cmd in cmds:
        timed_run(cmd, cwd=cwd, env=env)
    runs: list[list[tuple[float, float]]] = [[] for _ in cmds]
    for _ in range(repeats):
        for i, cmd in enumerate(cmds):
            runs[i].append(timed_run(cmd, cwd=cwd, env=env))
    return [(median([w for w, _ in r]), median([c for _, c in r])) for r in runs]


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
        help_cmd = [ddpk, "--help"]
        dryrun_cmd = [ddpk, "submit", "-s", "kubernetes", "--dry-run", "--name", "bench", "--replicas", "2"]
        ours: dict[str, tuple[float, float]] = {}
        theirs: dict[str, tuple[float, float]] = {}
        ours["render"], ours["local"] = wall(
            [[ddpk, "render", "--name", "bench", "--replicas", "256"],
             [ddpk, "submit", "--dry-run", "--name", "bench", "--replicas", "2"]], cwd, env, repeats)
        try:
            tx = str(torchx())
            # --workspace "" stops torchx from building an image of the working tree, which a dry
            # run would otherwise do; queue is the one option its kubernetes scheduler requires.
            tx_dryrun = [tx, "run", "--dryrun", "--workspace", "", "-s", "kubernetes",
                         "-cfg", "queue=default", "dist.ddp", "-j", "2x1", "--script", "x.py"]
            ours["help"], theirs["help"] = wall([help_cmd, [tx, "--help"]], cwd, env, repeats)
            ours["dryrun"], theirs["dryrun"] = wall([dryrun_cmd, tx_dryrun], cwd, env, repeats)
            sec.notes.append(f"torchx {_torchx_version()} in bench/.torchx-venv (pip install "
                             "\"torchx[kubernetes]\"; it pulls no torch); dry run: `torchx run --dryrun "
                             "--workspace '' -s kubernetes -cfg queue=default dist.ddp -j 2x1 --script x.py`.")
        except (subprocess.SubprocessError, OSError, RuntimeError) as err:
            sec.notes.append(f"torchx rows skipped: could not install or run torchx ({err}).")
            ours["help"], ours["dryrun"] = wall([help_cmd, dryrun_cmd], cwd, env, repeats)

    def row(key: str, label: str, base_label: str) -> Row:
        wall_s, cpu_s = ours[key]
        base = theirs.get(key)
        ratio = base[0] / wall_s if base else None
        met = wall_s <= TARGET_S and (ratio is None or ratio >= TARGET_RATIO)
        note = f"CPU {cpu_s:.3f} s" + (f" vs {base[1]:.3f} s, {base[1] / cpu_s:.2f}×" if base else "")
        return Row(NAME, label, wall_s, "s", base[0] if base else None, base_label if base else "", ratio,
                   f"≤ {TARGET_S} s, ≥ {TARGET_RATIO:.0f}× faster", met, note=note)

    sec.rows.append(row("help", "`ddpk --help`", "`torchx --help`"))
    sec.rows.append(row("dryrun", "`ddpk submit -s kubernetes --dry-run --replicas 2`",
                        "`torchx run --dryrun -s kubernetes dist.ddp -j 2x1`"))
    local_s, local_cpu = ours["local"]
    sec.rows.append(Row(NAME, "`ddpk submit --dry-run --replicas 2` (default scheduler, local)", local_s, "s",
                        target=f"≤ {TARGET_S} s", met=local_s <= TARGET_S, note=f"CPU {local_cpu:.3f} s"))
    render_s, render_cpu = ours["render"]
    sec.rows.append(Row(NAME, "`ddpk render --replicas 256`", render_s, "s",
                        target="< 0.5 s (issue 4), ≤ 0.3 s", met=render_s <= TARGET_S,
                        note=f"CPU {render_cpu:.3f} s"))
    sec.notes.append(f"CLI: median wall time of {repeats} runs after one warm-up run, each a fresh process; "
                     "the CPU time (user + system) beside it is the figure that other load barely moves.")
    return sec
