"""Learning-rate schedules as pure functions of training progress.

Progress is measured in epochs. Keyed by "epoch" it is the epochs trained so
far, the running one in part (its share of examples taken up), so the lr moves
every step and the last step of a run is at the schedule's end; keyed by "backprop" it is backpropagated examples divided by the
training-set size, as in the authors' code, so Selective-Backprop is not
handed extra decay for epochs in which it backpropagated only a third of the
data; keyed by "time" it is the training time spent over the time budget, in
units of the run's epochs, so a schedule ends exactly when the budget does; keyed by
"work" it is the work done over the work budget the same way (raysb.core.work_units). Where
epochs are given beside a budget, whichever ends first ends the run, and a budget-keyed
schedule follows the larger of the two shares, so it ends with the run either way. A
frontier of runs stopped by a budget whose lr never finished decaying measures
the schedule, not the method (Kaddour et al., "No Train No Gain", 2023).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SCHEDULE_NAMES = ("static", "step", "accelerated", "cosine", "linear")
SCHEDULE_KEYS = ("epoch", "backprop", "time", "work")

# The paper's accelerated schedules decay at 0.8x the usual epochs (60,120,160 -> 48,96,128).
ACCELERATION = 0.8


def learning_rate(
    schedule: str,
    base_lr: float,
    progress: float,
    total_epochs: float,
    milestones: Sequence[float] = (),
    factor: float = 0.2,
) -> float:
    if schedule == "static":
        return base_lr
    if schedule in ("step", "accelerated"):
        scale = ACCELERATION if schedule == "accelerated" else 1.0
        passed = sum(progress >= m * scale for m in milestones)
        return base_lr * factor**passed
    fraction = min(max(progress / total_epochs, 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * base_lr * (1.0 + math.cos(math.pi * fraction))
    if schedule == "linear":
        return base_lr * (1.0 - fraction)
    raise ValueError(f"unknown lr_schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def warmup_factor(backprop_examples: int, batch_size: int, train_size: int, warmup_epochs: float) -> float:
    """Linear warmup over `warmup_epochs` datasets' worth of backpropagated examples.

    Counted in backpropagated examples, not epochs, so every strategy warms up over
    the same number of optimizer steps, whatever fraction of an epoch it keeps.
    The step about to be taken counts, so the first step is not taken at lr 0.
    """
    if warmup_epochs <= 0:
        return 1.0
    return min(1.0, (backprop_examples + batch_size) / (warmup_epochs * train_size))


def schedule_progress(
    key: str,
    epoch: float,
    backprop_examples: int,
    train_size: int,
    training_seconds: float = 0.0,
    time_budget: float | None = None,
    total_epochs: float = 1.0,
    work_done: float = 0.0,
    work_budget: float | None = None,
    epochs_end_run: bool = False,
) -> float:
    """`epoch`: epochs done, the running one's share included (e.g. 2.5 halfway through the third).
    `work_done` and `work_budget`: in epochs of training work (raysb.core.work_units).
    `epochs_end_run`: `total_epochs` are the run's epochs, given beside its budget, and end it if
    they come first: a budget-keyed schedule then goes by the larger of the two shares."""
    if key == "epoch":
        return float(epoch)
    if key == "backprop":
        return backprop_examples / train_size
    if key == "time":
        if not time_budget:
            raise ValueError("lr_schedule_key time needs a time_budget")
        by_budget = total_epochs * training_seconds / time_budget
    elif key == "work":
        if not work_budget:
            raise ValueError("lr_schedule_key work needs a work_budget")
        by_budget = total_epochs * work_done / work_budget
    else:
        raise ValueError(f"unknown lr_schedule_key {key!r}; choose one of {', '.join(SCHEDULE_KEYS)}")
    return max(by_budget, float(epoch)) if epochs_end_run else by_budget
