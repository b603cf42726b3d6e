"""What a run prints: progress inside an epoch, one line per evaluated epoch, one closing line."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable


def print_line(line: str) -> None:
    """A run's line on this process's stdout: the default `log` of a run and of a sweep."""
    # Written to the stream directly: Ray Train workers patch `print` into a
    # logger that also tees to stdout, which would show every line twice.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# The files the closing line names, where the run wrote them (traces for `raysb report` aside).
# (A Ray Train run's checkpoints are in its storage path, which last_checkpoint.json names.)
MAIN_FILES = ("metrics.parquet", "summary.json", "model.pt", "best_model.pt", "checkpoint.pt", "last_checkpoint.json")
# The parts of a run's wall time, as the closing line names them, and their summary.json keys.
WALL_PARTS = (("training", "training_wall_s"), ("evaluation", "evaluation_s"), ("probes", "probes_s"),
              ("checkpoints", "checkpointing_s"), ("start-up", "startup_s"))
# How often a terminal's bar is redrawn: often enough to move smoothly, seldom enough that rank 0
# of a --workers run sends the driver two small messages a second at most.
BAR_REFRESH_S = 0.5


@dataclass(frozen=True)
class EpochStatus:
    """How far an epoch is, by rank 0's counts: what a progress line says and a terminal's bar draws."""

    epoch: int  # counted from 1
    epochs: int | None
    seen: float  # examples considered so far in the epoch, every rank's together
    examples: int  # examples in an epoch
    rate: float  # examples a second
    left_s: float
    steps: int
    loss: float | None  # the epoch's mean training loss so far; None before its first step

    @property
    def done(self) -> float:
        return min(self.seen / self.examples, 1.0) if self.examples else 0.0

    @property
    def label(self) -> str:
        return f"epoch {_epoch_of(self.epoch, self.epochs)}"

    def line(self) -> str:
        loss = f"  train_loss {self.loss:.3f}" if self.loss is not None else ""
        return (
            f"  {self.label}  {self.done:4.0%} of its examples  {self.rate:,.0f} examples/s  "
            f"~{self.left_s:.0f}s left in the epoch  {self.steps} steps{loss}"
        )


@runtime_checkable
class ProgressConsole(Protocol):
    """A `log` that draws each epoch's progress itself (a terminal's bar) instead of taking it as lines."""

    def __call__(self, line: str) -> None: ...

    def progress(self, status: EpochStatus) -> None: ...


class EpochProgress:
    """Inside an epoch, how far it is, examples/s and time left: a line every `every_s` seconds,
    or, where `log` is a ProgressConsole, its bar redrawn every BAR_REFRESH_S.

    Fed from the loop's check before each round with host-side counts only (no device
    sync): an epoch of a real data set on a GPU cluster takes minutes, and a silent
    console reads as a hang. `every_s` 0 turns it off, bar and lines alike.
    """

    def __init__(
        self,
        log: Callable[[str], None],
        epochs: int | None,
        examples_per_epoch: int,
        world_size: int,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.epochs, self.every_s, self.clock = log, epochs, every_s, clock
        self.examples_per_epoch = examples_per_epoch
        # This rank sees its shard; the run's rate is every rank's together.
        self.world_size = world_size
        self.bar = log if isinstance(log, ProgressConsole) else None
        self.interval = BAR_REFRESH_S if self.bar is not None else every_s
        self.epoch = -1
        self.started = self.last_shown = 0.0

    def update(self, epoch: int, counts: Callable[[], dict[str, float]]) -> None:
        """Called before every round; `counts` (this rank's `SelectionRounds.progress_counts`)
        is read only when a line or a redraw is due."""
        if self.every_s <= 0:
            return
        now = self.clock()
        if epoch != self.epoch:
            self.epoch, self.started, self.last_shown = epoch, now, now
            return
        if now - self.last_shown < self.interval:
            return
        self.last_shown = now
        status = self.status(epoch, counts(), now - self.started)
        if self.bar is not None:
            self.bar.progress(status)
        else:
            self.log(status.line())

    def status(self, epoch: int, counts: dict[str, float], elapsed: float) -> EpochStatus:
        seen = counts["epoch_reached"] * self.world_size
        rate = seen / elapsed if elapsed > 0 else 0.0
        left = (self.examples_per_epoch - seen) / rate if rate > 0 else float("nan")
        steps = int(counts["epoch_steps"])
        loss = counts["epoch_loss_sum"] / steps if steps else None
        return EpochStatus(epoch + 1, self.epochs, seen, self.examples_per_epoch, rate, left, steps, loss)


def _epoch_of(epoch: int, epochs: int | None) -> str:
    """"  3/10", or where a budget alone ends the run (no `epochs`), "  3"."""
    return f"{epoch:>3}" if epochs is None else f"{epoch:>3}/{epochs}"


def epoch_line(row: dict, epochs: int | None) -> str:
    """One evaluated epoch: its own error, loss, kept fraction and steps, then the run's totals so far.
    An epoch that took no step (its kept examples still queued for a whole batch) has no training
    loss: its NaN is shown as a dash, which does not read as a failure."""
    loss = f"{row['train_loss']:.3f}" if row["epoch_steps"] else "– (no step)"
    # A captured step runs its forward and backward in one graph: one figure for both.
    passes = (f"step {row['time_train_step_s']:.1f}" if row.get("time_train_step_s") else
              f"fwd {row['time_train_forward_s']:.1f} bwd {row['time_backward_s']:.1f}")
    # The estimated share of wrong labels, where the strategy keeps the margins that estimate it, and the
    # doubt rule the epoch applied (a sharded table's run has the rule alone: no rank holds every margin).
    labels = []
    if "suspected_label_share" in row:
        share = row["suspected_label_share"]
        labels.append(f"wrong labels {'–' if share is None else format(share, '.1%')}")
    if "label_doubt_rule" in row:
        labels.append(f"(doubt {row['label_doubt_rule']})" if labels else f"doubt {row['label_doubt_rule']}")
    doubted = " ".join(labels) + "  " if labels else ""
    return (
        f"epoch {_epoch_of(row['epoch'], epochs)}  test_err {row['test_error']:.2%}  "
        f"train_loss {loss}  kept {row['kept_fraction']:.1%}  {doubted}"
        f"steps {row['epoch_steps']}  lr {row['lr']:.4g}  | run so far: {row['optimizer_steps']} steps, "
        f"{row['wall_s']:.1f}s training (sel {row['time_selection_s']:.1f} {passes} data {row['time_data_s']:.1f} "
        f"bookkeeping {row['time_bookkeeping_s']:.1f} other {row['time_other_s']:.1f})"
    )


def closing_line(summary: dict, out: Path) -> str:
    """The run in one line: how it ended, its errors, its cost, and what it left where."""
    best = summary.get("best_test_error")
    errors = (
        f"final test error {summary['final_test_error']:.2%}, best {best:.2%}"
        if summary.get("final_test_error") is not None
        else "no epoch evaluated"
    )
    files = ", ".join(name for name in MAIN_FILES if (out / name).is_file())
    share = summary.get("suspected_label_share")
    labels = ("" if share is None else
              f"; wrong labels estimated at {share:.1%} ({summary['suspected_labels']:,} doubted, ranked in "
              f"{summary['label_suspects_file']})")
    return (
        f"raysb: {summary['status'].replace('_', ' ')} after {summary['epochs_completed']} epoch(s), "
        f"{summary['training_wall_s']:.1f}s of training: {errors}; kept {summary['kept_fraction']:.1%} of "
        f"{summary['examples_considered']:,} examples considered, {summary['optimizer_steps']:,} optimizer steps"
        f"{labels}; {wall_split(summary)}. {out}: {files}"
    )


def wall_split(summary: dict) -> str:
    """The run's wall time and the parts it adds up from, as summary.json gives them."""
    parts = ", ".join(f"{name} {summary[key]:.1f}" for name, key in WALL_PARTS)
    return f"{summary['wall_s']:.1f}s wall: {parts}"
