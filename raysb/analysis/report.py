"""The files `raysb pareto` writes: frontier and speedup tables (CSV, markdown) and two figures.

Speedups are counted in wall-clock time and, beside it, in work (raysb.analysis.work), which
does not move with the machine's load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from raysb.analysis import AnalysisError
from raysb.analysis.frontier import (
    DEFAULT_TARGETS,
    POINT_COLUMNS,
    RANDOM_SUBSET,
    WORK_CLOCK,
    Clock,
    baseline_error,
    pareto_points,
    pareto_share,
    target_label,
)
from raysb.analysis.plots import plot_curves, plot_pareto
from raysb.analysis.results import config_columns
from raysb.analysis.work import clocks, data_warning, speed_warning, speedups, trial_work, with_work, work_notes

BASELINE = "traditional"
NEVER_REACHED = "–"
# A target the strategy reached and the one it is compared with never did.
UNMATCHED = "∞"


def write_pareto_report(
    trials: pd.DataFrame, out_dir: str | Path, targets: Sequence[float] = DEFAULT_TARGETS
) -> dict[str, Path]:
    """Write pareto.csv/png, pareto_share.csv, speedups.csv/md and curves.png; return {name: path}.

    Without a traditional trial there is nothing to measure speedups against:
    speedups.csv is skipped and speedups.md says why, the rest is written as usual.
    """
    work = trial_work(trials)
    trials = with_work(trials, work)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}

    def place(name: str) -> Path:
        written[name] = out / name
        return written[name]

    frontier_columns = list(dict.fromkeys([*POINT_COLUMNS, *config_columns(trials)]))
    pareto_points(trials)[frontier_columns].to_csv(place("pareto.csv"), index=False)
    share = pareto_share(trials)
    share.to_csv(place("pareto_share.csv"), index=False)
    plot_pareto(trials, place("pareto.png"))

    try:
        best_error, best_trial = baseline_error(trials, BASELINE)
    except AnalysisError as missing:
        markdown = missing_baseline_markdown(str(missing), share, work)
        target_errors = None
    else:
        table = speedups(trials, targets, BASELINE)
        table.to_csv(place("speedups.csv"), index=False)
        markdown = speedups_markdown(table, targets, best_error, best_trial, share, work)
        target_errors = {target_label(m): m * best_error for m in targets}
    different_data = data_warning(trials)
    place("speedups.md").write_text(markdown if different_data is None else f"{different_data}\n\n{markdown}")
    plot_curves(trials, place("curves.png"), target_errors, clocks(work))
    return written


def speedups_markdown(
    table: pd.DataFrame, targets: Sequence[float], best_error: float, best_trial: str, share: pd.DataFrame,
    work: pd.DataFrame,
) -> str:
    """Table 1 of the paper: best final error and time-to-target speedup per strategy, in wall-clock time
    and in work (`work`: raysb.analysis.work.trial_work of the trials)."""
    labels = [target_label(m) for m in targets]
    counted = clocks(work)
    uniform = table.loc[table["strategy"] == RANDOM_SUBSET]
    against_uniform = [f"{label} vs {RANDOM_SUBSET}" for label in labels] if len(uniform) else []
    lines = [
        _markdown_row(["strategy", "final error", *labels, *against_uniform]),
        _markdown_row(["---"] * (2 + len(labels) + len(against_uniform))),
    ]
    for row in table.to_dict("records"):
        cells = [speedup_cell([row[clock.speedup.format(label)] for clock in counted]) for label in labels]
        if len(uniform):
            cells += [speedup_cell([_over_uniform(uniform, row, label, clock) for clock in counted])
                      for label in labels]
        lines.append(_markdown_row([row["strategy"], percent(row["final_error"]), *cells]))
    lines += [
        "",
        f"E = {percent(best_error)}, the lowest final test error of any {BASELINE} trial "
        f"(`{best_trial}`). Column mE: how many times sooner than {BASELINE} a strategy first "
        f"reaches test error m × E in wall-clock time{_in_work(counted)} ({NEVER_REACHED}: that row's strategy "
        "never reached it).",
    ]
    if len(uniform):
        lines += [
            f"Column mE vs {RANDOM_SUBSET}: the same, against a fresh uniform random subset of the same size "
            f"each epoch (no scoring forward); {UNMATCHED}: that row's strategy reached it and {RANDOM_SUBSET} "
            "never did.",
            "",
            *[line for clock in counted for line in _not_beating_uniform(table, uniform, labels, clock)],
        ]
    return "\n".join([*lines, *_work_lines(work)]) + "\n\n" + share_markdown(share)


def speedup_cell(speedups: Sequence[float]) -> str:
    """A strategy's speedups at one target: in wall-clock time, then (where counted) in work."""
    wall, *work = speedups
    if math.isnan(wall):
        return NEVER_REACHED
    return _format_speedup(wall) + "".join(f" (work {_format_speedup(speedup)})" for speedup in work)


def _in_work(counted: Sequence[Clock]) -> str:
    if WORK_CLOCK not in counted:
        return ""
    return (", and in brackets in work: the examples it trained plus those it scored weighted by its "
            "scoring_cost, as `--work-budget` counts them, which the machine's load does not move")


def _work_lines(work: pd.DataFrame) -> list[str]:
    """The speed warning and the notes on how work was counted, each a paragraph of its own."""
    warning = speed_warning(work)
    return [line for note in [*([warning] if warning else []), *work_notes(work)] for line in ("", note)]


def _over_uniform(uniform: pd.DataFrame, row: dict, label: str, clock: Clock) -> float:
    """How many times sooner than the uniform baseline `row`'s strategy reaches target `label` in `clock`:
    NaN when it never does, infinite when only the baseline never does (it beats the baseline there)."""
    theirs, mine = float(uniform.iloc[0][clock.time_to.format(label)]), row[clock.time_to.format(label)]
    if not math.isfinite(mine):
        return math.nan
    return theirs / mine if math.isfinite(theirs) else math.inf


def _not_beating_uniform(
    table: pd.DataFrame, uniform: pd.DataFrame, labels: Sequence[str], clock: Clock
) -> list[str]:
    """A line per selective method and target it does not reach sooner than the uniform baseline."""
    lines = []
    for row in table.to_dict("records"):
        if row["strategy"] in (BASELINE, RANDOM_SUBSET):
            continue
        behind = [label for label in labels if not _over_uniform(uniform, row, label, clock) > 1.0]
        if behind:
            lines.append(f"**{row['strategy']} does not beat {RANDOM_SUBSET} at {', '.join(behind)} in {clock.name}.**")
    return lines or [f"Every selective strategy beats {RANDOM_SUBSET} at every target in {clock.name}."]


def missing_baseline_markdown(reason: str, share: pd.DataFrame, work: pd.DataFrame) -> str:
    return "\n".join([f"{reason[:1].upper()}{reason[1:]}.", *_work_lines(work)]) + "\n\n" + share_markdown(share)


def share_markdown(share: pd.DataFrame) -> str:
    """Each strategy's share of the Pareto frontier's points."""
    lines = [_markdown_row(["strategy", "Pareto points", "share"]), _markdown_row(["---"] * 3)]
    for row in share.to_dict("records"):
        lines.append(_markdown_row([row["strategy"], str(row["pareto_points"]), percent(row["pareto_share"], 1)]))
    return "\n".join(lines) + "\n"


def _markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _format_speedup(speedup: float) -> str:
    if math.isnan(speedup):
        return NEVER_REACHED
    return UNMATCHED if math.isinf(speedup) else f"{speedup:.2f}x"


def percent(fraction: float, digits: int = 2) -> str:
    return NEVER_REACHED if math.isnan(fraction) else f"{100 * fraction:.{digits}f}%"
