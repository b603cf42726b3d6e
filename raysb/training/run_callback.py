"""A rank's part in the epoch loop: named events, as Ray Train V2's callbacks are."""

from __future__ import annotations

from typing import Any


class RunCallback:
    """What `run_epochs` tells a rank and asks of it. Here every event does nothing: as it stands,
    this is a single process that writes the outputs and starts from epoch 0.

    The loop calls every method on every rank at the same points, never behind `writes_outputs`,
    so a rank's methods may synchronize its ranks (Ray Train's report does) as long as every
    rank's do. The collectives the loop's own results need, its totals over ranks and the
    writer's stop verdict, are not events: the loop runs them on every rank, whatever these do.
    """

    # This rank evaluates, logs and writes the run's files (rank 0 of a worker group).
    writes_outputs: bool = True
    # The first epoch to train: 0, or the one after a restored checkpoint.
    start_epoch: int = 0
    # When this start of the run began (time.time(): train()'s call), so that the loop counts the
    # start-up before its training clock; None: it began as the loop did.
    started_at: float | None = None

    def before_round(self, epoch: int, round_index: int) -> None:
        """Before each selection round's exchange (0-based epoch and round within it)."""

    def after_epoch(self, epoch: int, row: dict | None, stopped: bool) -> None:
        """After each epoch (0-based): `row` is its metrics row where this rank evaluated it, else
        None; `stopped` says the run ends after it (a budget reached, a collapse)."""

    def summary_extras(self) -> dict[str, Any]:
        """Fields this rank adds to its summary once training ends."""
        return {}
