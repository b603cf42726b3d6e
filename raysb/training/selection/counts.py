"""What a rank counts of its selection and training, and the metrics row made of it.

`Counters` are the run's cumulative counts (checkpointed); `EpochCounts` adds the running epoch's,
all additive so ranks can sum them (`progress_counts`), and `metrics_row` turns one rank's or every
rank's sum into the training columns of a metrics row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    """Cumulative example and step counts of a run (this rank's)."""

    selection_forward_examples: int = 0
    train_forward_examples: int = 0
    backprop_examples: int = 0
    optimizer_steps: int = 0
    examples_considered: int = 0
    examples_kept: int = 0
    # Work a strategy spends outside its rounds, on the run's held-out split (raysb.training.irreducible_loss,
    # the over-fitting guard): examples a side model trained on, and forwards scored like selection's.
    side_trained_examples: int = 0
    side_forward_examples: int = 0


COUNTER_NAMES = tuple(Counters.__dataclass_fields__)
# What a streamed run's reads fetched so far, summed over ranks (raysb.data.shards.StreamShard.read_counts):
# rows decoded, and bytes of Parquet column chunks read (raysb.data.row_groups.ReadBytes).
READ_COUNT_NAMES = ("stream_rows_decoded", "stream_bytes_read")


def counter_values(totals: dict[str, float]) -> dict[str, int]:
    """The run's counters in `totals` (every rank's, summed), a streamed run's reads among them."""
    return {name: int(totals[name]) for name in COUNTER_NAMES + READ_COUNT_NAMES if name in totals}


class EpochCounts:
    """The run's `Counters` and the running epoch's: examples considered and kept, steps taken."""

    def __init__(self):
        self.run = Counters()
        self.new_epoch()

    def new_epoch(self) -> None:
        self.considered = self.kept = self.steps = 0

    def step(self, examples: int) -> None:
        """A training step on `examples` examples."""
        run = self.run
        run.train_forward_examples += examples
        run.backprop_examples += examples
        run.optimizer_steps += 1
        self.steps += 1

    def close_epoch(self) -> None:
        self.run.examples_considered += self.considered
        self.run.examples_kept += self.kept

    def progress_counts(self, reached_share: float, loss_sum: float) -> dict[str, float]:
        """Cumulative counters plus this epoch's, all additive so ranks can sum them: `reached_share`, the
        share of its considered examples its steps have reached; `loss_sum`, its training losses' sum."""
        return {
            **asdict(self.run),
            "epoch_kept": self.kept,
            "epoch_considered": self.considered,
            # How far the epoch is, in examples considered: a whole epoch decided as it starts considered
            # every one at once, and its steps say how far it is.
            "epoch_reached": self.considered * reached_share,
            "epoch_steps": self.steps,
            "epoch_loss_sum": loss_sum,
        }


def kept_fraction(kept: float, considered: float) -> float:
    return kept / considered if considered else 0.0


def metrics_row(totals: dict[str, float], split: dict[str, float], lr: float | None = None) -> dict:
    """The training columns of one metrics row, from `SelectionRounds.progress_counts` (one rank's,
    or summed over ranks) and a `PhaseTimer.breakdown`: this epoch's loss, kept fraction and
    steps, the run's cumulative counts, the learning rate where one is known, seconds per phase."""
    steps = totals["epoch_steps"]
    row = {
        "train_loss": totals["epoch_loss_sum"] / steps if steps else float("nan"),
        **counter_values(totals),
        "kept_fraction": kept_fraction(totals["epoch_kept"], totals["epoch_considered"]),
        "epoch_steps": int(steps),
    }
    if lr is not None:
        row["lr"] = lr
    row.update({f"time_{phase}_s": seconds for phase, seconds in split.items()})
    return row
