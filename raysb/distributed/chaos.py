"""Chaos (config `chaos`, grammar in raysb.chaos_spec): faults injected at chosen points,
to prove that recovery is exact.

Each event fires once per run: a marker file in the output folder remembers it
across the restarts it causes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from raysb.chaos_spec import ChaosEvent, parse_chaos

# Written by the driver side (raysb.distributed.launch) each time Ray Train commits a checkpoint.
COMMITTED_FILE = "last_checkpoint.json"


class ChaosRunner:
    """Fires a run's chaos events on the rank and at the point each names."""

    def __init__(self, spec: str | None, out: str, rank: int, world: int, checkpoint_every: int, log):
        self.events = parse_chaos(spec) if spec else []
        self.out, self.rank, self.world = out, rank, world
        self.checkpoint_every = checkpoint_every
        self.log = log

    def _due(self, kinds: tuple[str, ...], epoch: int):
        for event in self.events:
            if event.kind in kinds and event.epoch == epoch and event.acting_rank(self.world) == self.rank:
                if not event.marker(self.out).exists():
                    yield event

    def before_epoch(self, epoch: int, poison) -> None:
        """`poison()` turns this rank's weights NaN."""
        for event in self._due(("nan",), epoch):
            self._fire(event, f"rank {self.rank}'s weights turn NaN before epoch {epoch}")
            poison()

    def before_round(self, epoch: int, round_index: int, rounds_per_epoch: int) -> None:
        for event in self._due(("kill-worker",), epoch):
            if event.at_checkpoint:
                continue
            if round_index != (rounds_per_epoch // 2 if event.round is None else event.round):
                continue
            self._wait_for_commit(event)
            self._fire(event, f"killing rank {self.rank} before round {round_index} of epoch {epoch}")
            os._exit(1)

    def while_checkpointing(self, epoch: int) -> None:
        for event in self._due(("kill-worker",), epoch):
            if event.at_checkpoint:
                self._wait_for_commit(event)
                self._fire(event, f"killing rank {self.rank} while epoch {epoch}'s checkpoint is written")
                os._exit(1)

    def _fire(self, event: ChaosEvent, what: str) -> None:
        marker = event.marker(self.out)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        self.log(f"raysb: chaos event {event.index}: {what}")

    def _wait_for_commit(self, event: ChaosEvent, timeout_s: float = 120.0) -> None:
        """Until Ray Train has committed the last checkpoint written before `event.epoch`."""
        if not event.after_commit:
            return
        expected = (event.epoch - 1) // self.checkpoint_every * self.checkpoint_every
        deadline = time.monotonic() + timeout_s
        while expected > 0 and committed_epoch(self.out) < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"chaos event {event.index}: the checkpoint of epoch {expected} was never committed")
            time.sleep(0.05)


def committed_epoch(out: str | Path) -> int:
    """The epoch of the newest checkpoint Ray Train has committed for the run in `out` (0: none)."""
    path = Path(out) / COMMITTED_FILE
    if not path.exists():
        return 0
    return int(json.loads(path.read_text())["epoch"])
