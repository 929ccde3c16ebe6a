"""`python -m bench`: every CPU measurement, one markdown table, written to bench/RESULTS.md.

    python -m bench                      # the full run (make bench), writes bench/RESULTS.md
    python -m bench --quick              # a smoke run: tiny sizes, prints only
    python -m bench --only cli,memory    # some sections (throughput, scaling, cli, first-step, memory)

A section that fails is reported in the notes and the run goes on; the exit status is 1
when any section failed, whatever the figures are (targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from . import cli_latency, first_step, memory, scaling, throughput
from .common import REPO, Row, machine, table
from .training import Workspace

SECTIONS = ("throughput", "scaling", "cli", "first-step", "memory")


def _sections(raw: str) -> list[str]:
    chosen = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description="ddpk benchmarks against baselines")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few repeats, writes nothing")
    p.add_argument("--only", type=_sections, default=list(SECTIONS), metavar="S[,S]",
                   help=f"sections to run, from {', '.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file to write (default: bench/RESULTS.md, none with --quick)")
    args = p.parse_args(argv)
    out = args.out or (None if args.quick else REPO / "bench" / "RESULTS.md")

    facts = machine()
    started = time.perf_counter()
    rows: list[Row] = []
    notes: list[str] = []
    failed: list[str] = []
    ws = Workspace()
    runners = {
        "cli": lambda: cli_latency.run(args.quick),
        "throughput": lambda: throughput.run(ws, args.quick),
        "scaling": lambda: scaling.run(ws, args.quick),
        "first-step": lambda: first_step.run(args.quick),
        "memory": lambda: memory.run(ws, args.quick),
    }
    try:
        # CLI first: its start-up times suffer most from a page cache churned by the training runs.
        for name in ("cli", "throughput", "scaling", "first-step", "memory"):
            if name not in args.only:
                continue
            t = time.perf_counter()
            print(f"bench: {name} …", file=sys.stderr, flush=True)
            try:
                sec = runners[name]()
            except Exception as err:  # noqa: BLE001 - one broken section must not hide the others
                failed.append(name)
                notes.append(f"{name}: FAILED: {err}")
                traceback.print_exc(file=sys.stderr)
                continue
            rows.extend(sec.rows)
            notes.extend(sec.notes)
            print(f"bench: {name} done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        ws.close()

    facts["bench wall time"] = f"{time.perf_counter() - started:.0f} s" + (" (--quick)" if args.quick else "")
    text = "\n".join([
        "# ddpk benchmarks",
        "",
        "Written by `make bench` (`python -m bench`); medians, with ratios against baselines measured in "
        "the same run. Figures are wall-clock on a shared machine: read the load average.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in facts.items()],
        "",
        "## Results",
        "",
        table(rows),
        "",
        "## Method and notes",
        "",
        *[f"- {n}" for n in notes],
        "- bench/gpu.sh (ResNet-50 on one GPU) is not part of this run; see its header.",
        "",
    ])
    print(text)
    if out is not None:
        out.write_text(text)
        print(f"bench: wrote {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
