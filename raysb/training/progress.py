"""What a run prints: progress inside an epoch, one line per evaluated epoch, one closing line."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable


def print_line(line: str) -> None:
    """A run's line on this process's stdout: the default `log` of a run and of a sweep."""
    # Written to the stream directly: Ray Train workers patch `print` into a
    # logger that also tees to stdout, which would show every line twice.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# The files the closing line names, where the run wrote them (traces for `raysb report` aside).
MAIN_FILES = ("metrics.parquet", "summary.json", "model.pt", "best_model.pt", "checkpoint.pt")

class EpochProgress:
    """A line every `every_s` seconds inside an epoch: how far it is, examples/s, time left.

    Fed from the loop's check before each round with host-side counts only (no device
    sync): an epoch of a real data set on a GPU cluster takes minutes, and a silent
    console reads as a hang. `every_s` 0 turns it off.
    """

    def __init__(
        self,
        log: Callable[[str], None],
        epochs: int,
        examples_per_epoch: int,
        world_size: int,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.epochs, self.every_s, self.clock = log, epochs, every_s, clock
        self.examples_per_epoch = examples_per_epoch
        # This rank sees its shard; the run's rate is every rank's together.
        self.world_size = world_size
        self.epoch = -1
        self.started = self.last_line = 0.0

    def update(self, epoch: int, counts: Callable[[], dict[str, float]]) -> None:
        """Called before every round; `counts` (this rank's `SelectionRounds.progress_counts`)
        is read only when a line is due."""
        if self.every_s <= 0:
            return
        now = self.clock()
        if epoch != self.epoch:
            self.epoch, self.started, self.last_line = epoch, now, now
            return
        if now - self.last_line < self.every_s:
            return
        self.last_line = now
        self.log(self.line(epoch, counts(), now - self.started))

    def line(self, epoch: int, counts: dict[str, float], elapsed: float) -> str:
        seen = counts["epoch_considered"] * self.world_size
        done = min(seen / self.examples_per_epoch, 1.0) if self.examples_per_epoch else 0.0
        rate = seen / elapsed if elapsed > 0 else 0.0
        left = (self.examples_per_epoch - seen) / rate if rate > 0 else float("nan")
        steps = counts["epoch_steps"]
        loss = f"  train_loss {counts['epoch_loss_sum'] / steps:.3f}" if steps else ""
        return (
            f"  epoch {epoch + 1:>3}/{self.epochs}  {done:4.0%} of its examples  {rate:,.0f} examples/s  "
            f"~{left:.0f}s left in the epoch  {int(steps)} steps{loss}"
        )


def epoch_line(row: dict, epochs: int) -> str:
    """One evaluated epoch: its own error, loss, kept fraction and steps, then the run's totals so far.
    An epoch that took no step (its kept examples still queued for a whole batch) has no training
    loss: its NaN is shown as a dash, which does not read as a failure."""
    loss = f"{row['train_loss']:.3f}" if row["epoch_steps"] else "– (no step)"
    # A captured step runs its forward and backward in one graph: one figure for both.
    passes = (f"step {row['time_train_step_s']:.1f}" if row.get("time_train_step_s") else
              f"fwd {row['time_train_forward_s']:.1f} bwd {row['time_backward_s']:.1f}")
    return (
        f"epoch {row['epoch']:>3}/{epochs}  test_err {row['test_error']:.2%}  "
        f"train_loss {loss}  kept {row['kept_fraction']:.1%}  "
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
    return (
        f"raysb: {summary['status'].replace('_', ' ')} after {summary['epochs_completed']} epoch(s), "
        f"{summary['training_wall_s']:.1f}s of training: {errors}; kept {summary['kept_fraction']:.1%} of "
        f"{summary['examples_considered']:,} examples considered, {summary['optimizer_steps']:,} optimizer steps. "
        f"{out}: {files}"
    )
