"""Wall-clock accounting split by training phase."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch

# bookkeeping: selection math and batch forming (and, across ranks, the lockstep exchange).
PHASES = ("selection", "train_forward", "backward", "data", "bookkeeping", "evaluation")


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for the kernels queued on `device`, so a clock read after it
    counts them (GPU kernels run asynchronously; on a CPU there is nothing to wait for)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class PhaseTimer:
    """Accumulates seconds per phase.

    Phases nest, and each is charged its exclusive time: a "data" phase inside
    "bookkeeping" counts as data, not twice. On a GPU, kernels run
    asynchronously: the device is synchronized at every phase boundary so each
    phase is charged for its own kernels, not for the ones still queued from
    the phase before.
    """

    def __init__(self, device: torch.device):
        self._sync = device_synchronizer(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self._started = time.perf_counter()
        self._nested_seconds: list[float] = []  # per open phase: time spent in phases inside it

    @contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        self._nested_seconds.append(0.0)
        try:
            yield
        finally:
            self._sync()
            spent = time.perf_counter() - start
            self.seconds[name] += spent - self._nested_seconds.pop()
            if self._nested_seconds:
                self._nested_seconds[-1] += spent

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
