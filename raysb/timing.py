"""Wall-clock accounting split by training phase."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("selection", "train_forward", "backward", "data", "evaluation")


class PhaseTimer:
    """Accumulates seconds per phase.

    On a GPU, kernels run asynchronously: the device is synchronized at every
    phase boundary so each phase is charged for its own kernels, not for the
    ones still queued from the phase before.
    """

    def __init__(self, device: torch.device):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)
        self._started = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def elapsed(self) -> float:
        """Seconds since construction."""
        self._sync()
        return time.perf_counter() - self._started

    def training_seconds(self) -> float:
        """Elapsed time minus evaluation: the wall-clock a run is judged by."""
        return self.elapsed() - self.seconds["evaluation"]

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase plus `other` (training time in no phase), evaluation excluded."""
        split = {name: self.seconds[name] for name in PHASES if name != "evaluation"}
        split["other"] = max(0.0, self.training_seconds() - sum(split.values()))
        return split

    def state_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "elapsed": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the clock of a resumed run where it stopped."""
        self.seconds = defaultdict(float, state["seconds"])
        self._started = time.perf_counter() - state["elapsed"]
