"""Time-to-target tables for `python -m raysb.bench`: seconds to m x Traditional's error, and speedups."""

from __future__ import annotations

import statistics
from pathlib import Path

from raysb.analysis.cost_model import modelled_seconds
from raysb.analysis.frontier import baseline_error, speedup_table, target_label
from raysb.analysis.results import load_trials

TARGETS = (1.0, 1.1, 1.2, 1.4)


def time_to_target_lines(run_dirs: list[Path], targets=TARGETS) -> list[str]:
    """Seconds to m x Traditional's final error per strategy, and the speedup over Traditional."""
    trials = load_trials(run_dirs)
    table = _speedups(trials, targets)
    error = baseline_error(trials)[0]
    labels = [target_label(m) for m in targets]
    lines = [
        f"Time to m x E, E = Traditional's final error {error:.2%} (speedup over Traditional in brackets):",
        "",
        "| strategy | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for row in table.to_dict("records"):
        cells = []
        for label in labels:
            seconds, speedup = row[f"time_to_{label}_s"], row[f"speedup_{label}"]
            cells.append("–" if seconds != seconds else f"{seconds:.1f} s ({speedup:.2f}x)")
        lines.append(f"| {row['strategy']} | " + " | ".join(cells) + " |")
    return lines


def median_speedup_lines(seed_run_dirs: dict[int, list[Path]], costs: dict[str, float] | None = None,
                         targets=TARGETS) -> list[str]:
    """Per strategy and target: the median over seeds of each seed's speedup, with its range.

    Each seed is compared with its own Traditional run; a seed where the strategy
    never reached a target counts as a speedup of 0 (so one miss in three still
    gives a median, two do not). With `costs`, time is modelled (see `modelled_seconds`)
    instead of measured, which takes this shared machine's timing noise out.
    """
    labels = [target_label(m) for m in targets]
    per_seed = {
        seed: _speedups(load_trials(dirs), targets, costs).set_index("strategy") for seed, dirs in seed_run_dirs.items()
    }
    strategies = list(next(iter(per_seed.values())).index)
    clock = "modelled time (F, B, F_sel x examples)" if costs else "measured wall-clock"
    lines = [
        f"Median over seeds {', '.join(map(str, seed_run_dirs))} of each seed's speedup in {clock} over its own "
        "Traditional run (min-max in brackets; 0 = target not reached in that seed):",
        "",
        "| strategy | final error (median) | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for strategy in strategies:
        finals = [table.loc[strategy, "final_error"] for table in per_seed.values()]
        cells = []
        for label in labels:
            values = [table.loc[strategy, f"speedup_{label}"] for table in per_seed.values()]
            values = [0.0 if v != v else float(v) for v in values]
            cells.append(f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {strategy} | {statistics.median(finals):.2%} | " + " | ".join(cells) + " |")
    return lines


def _speedups(trials, targets, costs: dict[str, float] | None = None):
    if costs is not None:
        trials = trials.assign(wall_s=modelled_seconds(trials, costs))
    return speedup_table(trials, targets)
