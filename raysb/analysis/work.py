"""Work as `--work-budget` counts it, beside wall-clock time, for `raysb pareto` and `raysb report`.

A wall-clock speedup measures how fast the machine ran each run as much as its strategy: a
Traditional and a free-sb run that both trained 40,064 examples, one at 95 examples a second
and the other at 231 once the machine's load had changed, read as free-sb reaching its targets
7.96x sooner. Work (raysb.core.work_units) counts what a run did instead: each trained example 1,
each scored one the run's scoring cost, over its training set's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from raysb.analysis.frontier import WALL_CLOCK, WORK_CLOCK, Clock, speedup_table
from raysb.core.work_units import work_epochs

TRAINED, SCORED = "backprop_examples", "selection_forward_examples"
# A training step's phases: forward and backward, or both in one captured step.
TRAINING_PHASES = ("time_train_forward_s", "time_backward_s", "time_train_step_s")
# Runs' examples a second differing by more than this ratio: their wall-clock times measure the
# machine as much as the strategies (the budget bench's threshold too, raysb.bench.budgets).
SPEED_SPREAD = 1.2


def trial_work(trials: pd.DataFrame) -> pd.DataFrame:
    """Per trial (indexed by trial_id): `scoring_cost`, what a scored example weighs; `cost_estimated`,
    whether the run recorded none and its own phase times gave it; `train_examples`; and
    `examples_per_s`, the examples it trained plus those it scored weighted by the cost, per training
    second over the whole run. NaN where a run does not say enough to count its work."""
    last = trials.sort_values(["trial_id", "epoch"], kind="stable").groupby("trial_id", sort=False).tail(1)
    last = last.set_index("trial_id").reindex(columns=[TRAINED, SCORED, "wall_s", "scoring_cost", "train_examples",
                                                       "time_selection_s", *TRAINING_PHASES])
    cost = last["scoring_cost"].astype(float)
    cost[cost.isna() & (last[SCORED] == 0)] = 0.0
    estimated = cost.isna()
    cost[estimated] = _phase_time_cost(last.loc[estimated])
    work_examples = last[TRAINED] + cost * last[SCORED]
    return pd.DataFrame({
        "scoring_cost": cost,
        "cost_estimated": estimated & cost.notna(),
        "train_examples": last["train_examples"].astype(float),
        "examples_per_s": work_examples / last["wall_s"].where(last["wall_s"] > 0),
    })


def _phase_time_cost(last: pd.DataFrame) -> pd.Series:
    """A scored example's cost relative to a trained one from the run's own phase times: seconds in
    selection forwards per scored example over seconds in training steps per trained example. The two
    interleave through the run, so a change in the machine's load moves both alike."""
    training_s = last[list(TRAINING_PHASES)].fillna(0.0).sum(axis=1)
    per_scored = last["time_selection_s"] / last[SCORED]
    per_trained = training_s / last[TRAINED]
    return (per_scored / per_trained.where(per_trained > 0)).where(lambda cost: cost > 0)


def with_work(trials: pd.DataFrame, work: pd.DataFrame) -> pd.DataFrame:
    """`trials` with WORK_CLOCK's column: each evaluated epoch's work so far, in epochs of training.

    The counts in a run's metrics are totals over its ranks, so they count as one rank's would.
    """
    per_row = work.reindex(trials["trial_id"])
    trained, scored = trials.reindex(columns=[TRAINED, SCORED]).to_numpy(dtype=float).T
    done = work_epochs(trained, scored, per_row["scoring_cost"].to_numpy(), 1, per_row["train_examples"].to_numpy())
    return trials.assign(**{WORK_CLOCK.column: done})


def speedups(trials: pd.DataFrame, targets: Sequence[float], baseline: str) -> pd.DataFrame:
    """speedup_table in wall-clock time, its work columns beside (trials need WORK_CLOCK's column)."""
    wall = speedup_table(trials, targets, baseline, WALL_CLOCK)
    work = speedup_table(trials, targets, baseline, WORK_CLOCK)
    return wall.merge(work.drop(columns=["trials", "final_error"]), on="strategy", sort=False)


def speed_warning(work: pd.DataFrame) -> str | None:
    """One line naming the slowest and the fastest run where the runs' examples a second differ by more
    than SPEED_SPREAD; None where they do not."""
    rates = work["examples_per_s"].dropna()
    if len(rates) < 2 or rates.max() <= SPEED_SPREAD * rates.min():
        return None
    slow, fast = rates.idxmin(), rates.idxmax()
    return (
        "**Warning: the compared runs' examples a second (trained, plus scored at their scoring cost, per "
        f"second of training) differ by more than {SPEED_SPREAD - 1:.0%}: "
        f"{rates[slow]:,.0f} (`{slow}`) to {rates[fast]:,.0f} (`{fast}`), {rates[fast] / rates[slow]:.2f}x, "
        f"over {len(rates)} runs; wall-clock speedups then measure how fast each run went (the machine's load, "
        "a strategy's overheads) as much as what it did, work speedups do not.**"
    )


# The config keys that say what a run trained and was tested on: runs that differ in one compare their
# data as much as their strategies.
DATA_KEYS = ("dataset", "data_dir", "subset", "test_subset", "label_noise", "image_size", "exclude_samples")


def data_warning(trials: pd.DataFrame) -> str | None:
    """One line naming the data settings the compared trials differ in, a trial of each value; None
    where they trained and were tested alike."""
    first = trials.groupby("trial_id", sort=True).first()
    differing = []
    for key in DATA_KEYS:
        if key not in first.columns:
            continue
        values = first[key].map(lambda value: "none" if value is None or value != value else str(value))
        if values.nunique() > 1:
            example = {value: trial for trial, value in values.items()}  # the last trial of each value
            differing.append(f"{key} " + ", ".join(f"{value} (`{trial}`)" for value, trial in sorted(example.items())))
    if not differing:
        return None
    return ("**Warning: the compared runs trained or were tested on different data: " + "; ".join(differing)
            + ". Their errors and speedups compare the data as much as the strategies.**")


def work_notes(work: pd.DataFrame) -> list[str]:
    """Where a run's work was estimated, or could not be counted, and why."""
    notes = []
    estimated = work.loc[work["cost_estimated"]]
    if len(estimated):
        notes.append(
            "Scoring cost estimated from the run's own phase times (seconds a scored example over seconds "
            "a trained one), as its summary.json records none (`--work-budget` or `--set scoring_cost=C` "
            "records one): " + "; ".join(f"`{trial}` {cost:.2f}" for trial, cost in estimated["scoring_cost"].items())
        )
    unknown = work.index[work["scoring_cost"].isna() | work["train_examples"].isna()]
    if len(unknown):
        notes.append(
            "Work not counted, so left out of the work columns: " + ", ".join(f"`{trial}`" for trial in unknown)
            + " (no train_examples in summary.json, or scored examples with no scoring cost recorded or "
            "phase times to estimate one)"
        )
    return notes


def clocks(work: pd.DataFrame) -> tuple[Clock, ...]:
    """Wall-clock time, and work where any run's work could be counted (older results may have no
    summary.json to count it from)."""
    counted = (work["scoring_cost"].notna() & work["train_examples"].notna()).any()
    return (WALL_CLOCK, WORK_CLOCK) if counted else (WALL_CLOCK,)
