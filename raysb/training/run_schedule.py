"""Where a run is on its schedule: the learning rate of each step, how much of the run is done, and
what that makes of selection (whether an epoch selects, the kept fraction and the keep rule's strength).

The arithmetic is raysb.core.schedules' and raysb.core.selectivity's (pure functions); `RunSchedule`
feeds them the run's position, read from the selection rounds' counts and progress, the same on
every lockstep rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from raysb.core.schedules import learning_rate, schedule_progress, warmup_factor
from raysb.core.selectivity import scheduled_selectivity, scheduled_strength, selects
from raysb.training.selection.rounds import SelectionRounds


@dataclass
class Schedule:
    name: str
    base_lr: float
    # Its length in epochs, the unit of its milestones (OptimizationSettings.schedule_epochs).
    total_epochs: int
    milestones: list
    factor: float
    key: str
    warmup_epochs: float = 0.0
    # The budget a time- or work-keyed schedule ends at.
    time_budget: float | None = None
    work_budget: float | None = None
    # The epochs that end the run (None: a budget alone ends it); given beside a budget, a budget-keyed
    # schedule ends at whichever ends first.
    epochs: int | None = None


@dataclass(frozen=True)
class SelectionSchedules:
    """How selection moves over the run (raysb.core.selectivity): the epochs or share of the run that
    anneal to the full data at its end, and the schedules of the kept fraction and of how strongly
    the keep rule prefers high scores."""

    anneal_epochs: int = 0
    anneal_share: float = 0.0
    kept_fraction: str = "constant"
    strength: str = "constant"


class RunSchedule:
    def __init__(self, lr: Schedule, selection: SelectionSchedules, rounds: SelectionRounds, train_size: int):
        """`train_size`: the training set's examples, every rank's (what an epoch is)."""
        self.lr_schedule, self.selection, self.rounds, self.train_size = lr, selection, rounds, train_size
        self.epoch = 0  # the running epoch

    def start_epoch(self, epoch: int) -> bool:
        """`epoch` starts: the kept fraction and the keep rule's strength its schedules set, and whether
        it selects at all (raysb.core.selectivity.selects)."""
        self.epoch = epoch
        selection, strategy = self.selection, self.rounds.strategy
        if selection.kept_fraction != "constant" or selection.strength != "constant":
            lr_share = self.lr_share()
            if selection.kept_fraction != "constant":
                strategy.set_selectivity(
                    epoch, scheduled_selectivity(selection.kept_fraction, self.rounds.spec.selectivity, lr_share))
            if selection.strength != "constant":
                strategy.set_selection_strength(epoch, scheduled_strength(selection.strength, lr_share))
        return self.selects(epoch)

    def selects(self, epoch: int) -> bool:
        """Whether `epoch` selects at all: not while priming, not while annealing to the full data, not
        where the strategy anneals by its own rule."""
        progress, selection = self.progress(), self.selection
        return selects(epoch, progress, first_epoch=self.rounds.spec.first_epoch,
                       total_epochs=self.lr_schedule.epochs, anneal_epochs=selection.anneal_epochs,
                       anneal_share=selection.anneal_share,
                       strategy_anneals=self.rounds.strategy.anneals(epoch, progress))

    def lr(self) -> float:
        """The next step's learning rate, warmup included."""
        s, rounds = self.lr_schedule, self.rounds
        progress, backprop = self._position()
        warmup = warmup_factor(backprop, rounds.collective.world_size * rounds.batch_size, self.train_size,
                               s.warmup_epochs)
        return warmup * learning_rate(s.name, s.base_lr, progress, s.total_epochs, s.milestones, s.factor)

    def lr_share(self) -> float:
        """The lr's share of its peak now (warmup aside): what the selection schedules follow."""
        s = self.lr_schedule
        return learning_rate(s.name, 1.0, self._position()[0], s.total_epochs, s.milestones, s.factor)

    def progress(self) -> float:
        """How much of the run is done, in [0, 1], as the schedule counts it."""
        return min(1.0, self._position()[0] / self.lr_schedule.total_epochs)

    def _position(self) -> tuple[float, int]:
        """The schedule's progress, in its epochs, and every rank's backpropagated examples so far."""
        s, rounds = self.lr_schedule, self.rounds
        # Every rank's: lockstep ranks take the same steps of b. (Counted from this rank's alone against
        # the whole training set, N workers warmed up N times slower.)
        backprop = rounds.collective.world_size * rounds.counters.backprop_examples
        # Rank 0's clock (seconds, or work) at the last exchange, the same on every rank.
        leader_clock = rounds.exchange.leader_clock_s
        progress = schedule_progress(
            s.key,
            # The running epoch in part: an epoch-keyed lr moves every step, not once an epoch.
            self.epoch + rounds.epoch_share(self.train_size, self.epoch),
            backprop,
            self.train_size,
            training_seconds=leader_clock,
            time_budget=s.time_budget,
            total_epochs=s.total_epochs,
            work_done=leader_clock,
            work_budget=s.work_budget,
            epochs_end_run=s.epochs is not None,
        )
        return progress, backprop
