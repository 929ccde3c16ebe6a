"""Section 1: trainer samples/s against the tutorial-style DDP loop, 2 ranks × 1 thread."""

from __future__ import annotations

from .common import Row, Section
from .training import ROUNDS, Rounds, Workspace, alternate, plans, run_baseline, run_trainer, steady_rate

NAME = "throughput"
RANKS = 2
TARGETS = {"convnet": 2.0, "resnet18": 1.0}


def rounds(ws: Workspace, plan, workers: int, quick: bool) -> Rounds:
    """The tutorial loop and the trainer at 2 ranks, plus the trainer at 1 rank that the scaling
    section compares with, all in the same alternating rounds."""
    return alternate({
        "baseline": lambda r: run_baseline(ws, plan, RANKS, workers, repeat=r),
        "trainer": lambda r: run_trainer(ws, plan, RANKS, repeat=r),
        "trainer-1": lambda r: run_trainer(ws, plan, 1, repeat=r),
    }, 1 if quick else ROUNDS)


def best_workers(ws: Workspace, plan, candidates: tuple[int, ...]) -> tuple[int, dict[int, float]]:
    """The baseline's strongest DataLoader setting on this machine, and every rate tried."""
    rates = {w: steady_rate(run_baseline(ws, plan, RANKS, w)) for w in candidates}
    return max(rates, key=rates.get), rates


def run(ws: Workspace, quick: bool) -> Section:
    sec = Section()
    p = plans(quick)
    # With two ranks on two cores every worker competes with a rank for a core, so the best
    # setting is not obvious: the sweep measures it and the baseline gets the fastest.
    candidates = (0, 1) if quick else (0, 1, 2)
    workers, tried = best_workers(ws, p["convnet"], candidates)
    sec.notes.append(
        "baseline DataLoader: num_workers per rank tried on convnet → samples/s: "
        + ", ".join(f"{w} → {r:.0f}" for w, r in tried.items())
        + f"; the baseline uses the best, num_workers={workers}, persistent_workers when > 0, for both models.")
    for model in ("convnet", "resnet18"):
        plan = p[model]
        got = rounds(ws, plan, workers, quick)
        ratio, _, _ = got.ratio("trainer", "baseline")
        sec.rows.append(Row(NAME, f"{model} trainer, {RANKS} ranks × 1 thread, batch {plan.batch}/rank",
                            got.median("trainer"), "samples/s", got.median("baseline"), "tutorial loop", ratio,
                            f"≥ {TARGETS[model]:.1f}×", ratio >= TARGETS[model],
                            note=got.spread("trainer", "baseline")))
    plan = p["resnet18"]
    base_cl = steady_rate(run_baseline(ws, plan, RANKS, workers, channels_last=True))
    ours_cl = steady_rate(run_trainer(ws, plan, RANKS, extra=("--channels-last",)))
    sec.rows.append(Row(NAME, f"resnet18 trainer --channels-last, batch {plan.batch}/rank", ours_cl,
                        "samples/s", base_cl, "tutorial loop, channels_last", ours_cl / base_cl,
                        "report"))
    ours = rounds(ws, plan, workers, quick).median("trainer")
    sec.rows.append(Row(NAME, "resnet18 trainer --channels-last vs contiguous", ours_cl, "samples/s",
                        ours, "trainer, contiguous", ours_cl / ours, "report"))
    sec.notes.append(
        f"steps per epoch at 2 ranks: convnet {p['convnet'].steps}, resnet18 {p['resnet18'].steps}; "
        f"epochs: {p['convnet'].epochs} / {p['resnet18'].epochs}; the first epoch is discarded on both "
        "sides and a run's figure is the median of the remaining epochs' global samples/s. "
        f"The two sides ran in {1 if quick else ROUNDS} round(s), one run each per round, alternating which went first; "
        "a ratio is the median of the rounds' ratios (their range beside it), so drift of the shared "
        "host's speed does not land on one side. The channels-last rows are one run each.")
    return sec
