"""The math of `raysb pareto`: Pareto frontier, time to a target error, speedups.

Pure functions over arrays and DataFrames of trial rows (trial_id, strategy,
epoch, wall_s, test_error, ...); no files, no plots.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pandas as pd

from raysb.analysis import AnalysisError
from raysb.core.strategy_table import STRATEGIES

# The baseline a selective method must beat to be worth its scoring forward.
RANDOM_SUBSET = next(name for name, card in STRATEGIES.items() if card.random_subset)
DEFAULT_TARGETS = (1.1, 1.2, 1.4)
POINT_COLUMNS = ("trial_id", "strategy", "epoch", "wall_s", "test_error")

# m * E is rounded in floating point; an error exactly at m * E must still count as reached.
TARGET_SLACK = 1e-9


@dataclass(frozen=True)
class Clock:
    """What time to a target is counted in: a cumulative column of the trial rows, and the names of
    a speedup table's columns for it (each a format string taking the target's label)."""

    column: str
    name: str
    time_to: str
    speedup: str
    trial: str


WALL_CLOCK = Clock("wall_s", "wall-clock time", "time_to_{}_s", "speedup_{}", "trial_{}")
# Work as `--work-budget` counts it (raysb.analysis.work adds the column): the same whatever the load.
WORK_CLOCK = Clock("work_epochs", "work", "work_to_{}_epochs", "work_speedup_{}", "work_trial_{}")


def order_strategies(strategies: Iterable[str]) -> list[str]:
    """The built-in strategies in their table's order (the paper's, the uniform baseline second), then
    any others alphabetically."""
    present = set(strategies)
    return [s for s in STRATEGIES if s in present] + sorted(present - set(STRATEGIES))


def target_label(multiple: float) -> str:
    """1.1 -> "1.1E": the name of the target "m times the best baseline error"."""
    return f"{multiple:g}E"


def pareto_mask(times: npt.ArrayLike, errors: npt.ArrayLike) -> np.ndarray:
    """True for each point that no other point dominates (time <= and error <=, one of them <).

    Exact duplicates do not dominate each other, so all copies of a frontier point
    are on it. Points with a NaN coordinate are never on it.
    """
    times = np.asarray(times, dtype=float)
    errors = np.asarray(errors, dtype=float)
    if times.shape != errors.shape or times.ndim != 1:
        raise ValueError(f"times and errors must be 1-D and equally long, got {times.shape} and {errors.shape}")
    mask = np.zeros(times.shape, dtype=bool)
    valid = np.flatnonzero(~(np.isnan(times) | np.isnan(errors)))
    if valid.size == 0:
        return mask
    order = valid[np.lexsort((errors[valid], times[valid]))]
    sorted_times, sorted_errors = times[order], errors[order]
    # A point survives iff it has the lowest error among points of its own time
    # and a strictly lower error than every point of an earlier time.
    group_starts = np.flatnonzero(np.r_[True, sorted_times[1:] != sorted_times[:-1]])
    group_best = sorted_errors[group_starts]  # errors are ascending within a time group
    best_earlier = np.r_[np.inf, np.minimum.accumulate(group_best)[:-1]]
    group_of_point = np.repeat(np.arange(group_starts.size), np.diff(np.r_[group_starts, order.size]))
    mask[order] = (sorted_errors == group_best[group_of_point]) & (group_best < best_earlier)[group_of_point]
    return mask


def time_to_target(times: npt.ArrayLike, errors: npt.ArrayLike, target: float) -> float:
    """First time (wall-clock, or work) at which one trial's curve (in epoch order) has error <= target.

    Curves need not be monotone: the first crossing counts even if the error rises
    again later. `math.inf` if the curve never gets there; NaN where it gets there at
    an unknown time.
    """
    times = np.asarray(times, dtype=float)
    reached = np.flatnonzero(np.asarray(errors, dtype=float) <= target)
    return float(times[reached[0]]) if reached.size else math.inf


def lower_envelope(times: npt.ArrayLike, errors: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(times ascending, best error reached by each time) over any number of trials' points."""
    times = np.asarray(times, dtype=float)
    errors = np.asarray(errors, dtype=float)
    keep = ~(np.isnan(times) | np.isnan(errors))
    order = np.argsort(times[keep], kind="stable")
    return times[keep][order], np.minimum.accumulate(errors[keep][order])


def pareto_points(points: pd.DataFrame) -> pd.DataFrame:
    """The rows of `points` on the (wall_s, test_error) frontier, fastest first."""
    _require_columns(points, ("wall_s", "test_error"))
    on_frontier = pareto_mask(points["wall_s"], points["test_error"])
    return points.loc[on_frontier].sort_values(["wall_s", "test_error"], kind="stable")


def pareto_share(points: pd.DataFrame) -> pd.DataFrame:
    """Per strategy: its points, how many are on the frontier, and its fraction of the frontier."""
    _require_columns(points, ("strategy", "wall_s", "test_error"))
    strategies = order_strategies(points["strategy"])
    on_frontier = pareto_mask(points["wall_s"], points["test_error"])
    all_points = points["strategy"].value_counts().reindex(strategies, fill_value=0)
    frontier = points.loc[on_frontier, "strategy"].value_counts().reindex(strategies, fill_value=0)
    total = int(frontier.sum())
    return pd.DataFrame(
        {
            "strategy": strategies,
            "points": all_points.to_numpy(),
            "pareto_points": frontier.to_numpy(),
            "pareto_share": frontier.to_numpy() / total if total else 0.0,
        }
    )


def final_errors(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per trial: trial_id, strategy, final_error (error at its last evaluated epoch)."""
    last_rows = _epoch_ordered(trials).groupby("trial_id", sort=False).tail(1)
    return last_rows[["trial_id", "strategy", "test_error"]].rename(columns={"test_error": "final_error"})


def baseline_error(trials: pd.DataFrame, baseline: str = "traditional") -> tuple[float, str]:
    """E, the lowest final error among `baseline` trials, and the trial that reached it."""
    finals = final_errors(trials)
    candidates = finals.loc[finals["strategy"] == baseline].dropna(subset=["final_error"])
    if candidates.empty:
        found = ", ".join(order_strategies(finals["strategy"])) or "none"
        raise AnalysisError(
            f"speedups need a {baseline!r} trial with a final test error to compare against; "
            f"strategies found: {found}"
        )
    best = candidates.loc[candidates["final_error"].idxmin()]
    return float(best["final_error"]), str(best["trial_id"])


def speedup_table(
    trials: pd.DataFrame,
    targets: Sequence[float] = DEFAULT_TARGETS,
    baseline: str = "traditional",
    clock: Clock = WALL_CLOCK,
) -> pd.DataFrame:
    """The paper's Table 1: how much sooner each strategy first reaches m * E than `baseline`.

    One row per strategy (in `order_strategies` order) with columns `strategy`,
    `trials`, `final_error` (its best final error), then per target m, labelled
    L = `target_label(m)`, in `clock` (column names for WALL_CLOCK): `time_to_L_s`
    (fastest trial's first time at error <= m * E), `speedup_L` (baseline time / that
    time) and `trial_L` (the fastest trial). Never reached, or a trial whose clock is
    unknown (NaN): NaN time, speedup and trial.
    """
    trials = _epoch_ordered(trials)
    _require_columns(trials, (clock.column,))
    best_error, _ = baseline_error(trials, baseline)
    finals = final_errors(trials)
    curves = {
        trial_id: (rows[clock.column].to_numpy(), rows["test_error"].to_numpy())
        for trial_id, rows in trials.groupby("trial_id", sort=False)
    }
    strategies = order_strategies(finals["strategy"])
    fastest = {
        (strategy, multiple): _fastest_trial(
            curves, finals.loc[finals["strategy"] == strategy, "trial_id"], multiple * best_error
        )
        for strategy in strategies
        for multiple in targets
    }
    rows = []
    for strategy in strategies:
        own = finals.loc[finals["strategy"] == strategy]
        row: dict[str, object] = {
            "strategy": strategy,
            "trials": len(own),
            "final_error": own["final_error"].min(),
        }
        for multiple in targets:
            label = target_label(multiple)
            seconds, trial_id = fastest[strategy, multiple]
            baseline_seconds, _ = fastest[baseline, multiple]
            reached = math.isfinite(seconds)
            row[clock.time_to.format(label)] = seconds if reached else math.nan
            # A run evaluated before its first step reaches a target at no work at all: no ratio to that.
            row[clock.speedup.format(label)] = (
                baseline_seconds / seconds if reached and seconds > 0 and math.isfinite(baseline_seconds) else math.nan
            )
            row[clock.trial.format(label)] = trial_id
        rows.append(row)
    return pd.DataFrame(rows)


def _fastest_trial(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], trial_ids: Iterable[str], target: float
) -> tuple[float, str | None]:
    best: tuple[float, str | None] = (math.inf, None)
    for trial_id in trial_ids:
        seconds = time_to_target(*curves[trial_id], target * (1 + TARGET_SLACK))
        if seconds < best[0]:
            best = (seconds, trial_id)
    return best


def _epoch_ordered(trials: pd.DataFrame) -> pd.DataFrame:
    _require_columns(trials, POINT_COLUMNS)
    return trials.sort_values(["trial_id", "epoch"], kind="stable")


def _require_columns(frame: pd.DataFrame, columns: Iterable[str]) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise AnalysisError(f"trial rows lack column(s) {', '.join(missing)}")
