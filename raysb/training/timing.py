"""Wall-clock accounting split by training phase."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# bookkeeping: selection math and batch forming (and, across ranks, the lockstep exchange).
# train_step: a step captured as one CUDA graph, its forward, backward and update together.
# evaluation, probes (raysb report's analysis, raysb.training.trace) and checkpointing are timed but
# are not training: a run is judged by the rest.
PHASES = ("selection", "train_forward", "backward", "train_step", "data", "bookkeeping", "evaluation", "probes",
          "checkpointing")
NOT_TRAINING = ("evaluation", "probes", "checkpointing")
# On a GPU, closed phases whose events are read together (one sync per this many).
SETTLE_EVERY = 4096


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for the kernels queued on `device`, so a clock read after it
    counts them (GPU kernels run asynchronously; on a CPU there is nothing to wait for)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@dataclass
class _Phase:
    """One timed interval: host clock readings on a CPU, CUDA events on a GPU (read later, `_settle`)."""

    name: str
    start: float | torch.cuda.Event
    end: float | torch.cuda.Event | None = None  # None while it is open
    nested: list[_Phase] = field(default_factory=list)  # closed phases inside it (on a GPU)
    nested_seconds: float = 0.0  # the seconds of the closed phases inside it (on a CPU)


class PhaseTimer:
    """Accumulates seconds per phase.

    Phases nest, and each is charged its exclusive time: a "data" phase inside
    "bookkeeping" counts as data, not twice. On a CPU phases are host clock
    intervals. On a GPU kernels run asynchronously, and waiting for them at every
    phase boundary would stop the host from queueing the next kernels while the
    device works (the gap that made a step slower than a plain loop's): a phase is
    instead the device's time between two CUDA events recorded in the stream, read
    only when a total is asked for (at an epoch's end), the one sync.
    """

    def __init__(self, device: torch.device):
        self._sync = device_synchronizer(device)
        self._events = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self._started = time.perf_counter()
        # Seconds before the clock started (loading data, building the model, Ray's start), over every
        # start of the run: with the phases and training they make up its wall time (`wall_split`).
        self.startup_seconds = 0.0
        self._carried = 0.0  # a restored clock's seconds from the runs before this one
        self._open: list[_Phase] = []
        self._closed: list[_Phase] = []  # outermost closed phases whose events are not read yet

    @contextmanager
    def phase(self, name: str):
        # Flat on purpose: every step opens a few phases, and on a CPU each is charged as it closes.
        opened = _Phase(name, self._event() if self._events else time.perf_counter())
        self._open.append(opened)
        try:
            yield
        finally:
            closed = self._open.pop()
            if not self._events:
                spent = time.perf_counter() - closed.start
                self.seconds[name] += spent - closed.nested_seconds
                if self._open:
                    self._open[-1].nested_seconds += spent
            else:
                closed.end = self._event()
                (self._open[-1].nested if self._open else self._closed).append(closed)
                # Evaluation and checkpoints end in host reads anyway; settling them at once keeps
                # `host_training_seconds` right. Otherwise events are read in bulk, now and then.
                if not self._open and (name in NOT_TRAINING or len(self._closed) >= SETTLE_EVERY):
                    self._settle()

    def clear(self) -> None:
        """Forget every phase timed so far and the clock's earlier runs (what a run's setup timed)."""
        self.seconds.clear()
        self.startup_seconds = self._carried = 0.0
        self._open.clear()
        self._closed.clear()

    def start(self, startup_seconds: float) -> None:
        """The clock runs from now (a restored one on from where it stopped); the `startup_seconds`
        before it were start-up."""
        self._sync()
        self._started = time.perf_counter() - self._carried
        self.startup_seconds += startup_seconds

    def elapsed(self) -> float:
        """Seconds on the clock: since it started, a restored clock's earlier seconds included."""
        self._sync()
        return time.perf_counter() - self._started

    def training_seconds(self) -> float:
        """Elapsed time minus evaluation and checkpointing: the wall-clock a run is judged by."""
        elapsed = self.elapsed()
        self._settle()
        return elapsed - sum(self.seconds[name] for name in NOT_TRAINING)

    def host_training_seconds(self) -> float:
        """`training_seconds` by the host's clock alone: no wait for queued device work, so at most
        that work's time early (a per-round time-budget check can afford that)."""
        return time.perf_counter() - self._started - sum(self.seconds[name] for name in NOT_TRAINING)

    def total(self, name: str) -> float:
        """Seconds charged to phase `name` so far."""
        self._settle()
        return self.seconds[name]

    def wall_split(self) -> dict[str, float]:
        """The run's wall time so far in parts that add up to it: start-up, training, and each timed
        phase that is not training."""
        training = self.training_seconds()
        not_training = {name: self.seconds[name] for name in NOT_TRAINING}
        return {"startup": self.startup_seconds, "training": training, **not_training}

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase plus `other` (training time in no phase), the phases that are not training excluded."""
        training = self.training_seconds()
        split = {name: self.seconds[name] for name in PHASES if name not in NOT_TRAINING}
        split["other"] = max(0.0, training - sum(split.values()))
        return split

    def state_dict(self) -> dict:
        elapsed = self.elapsed()
        self._settle()
        return {"seconds": dict(self.seconds), "elapsed": elapsed, "startup": self.startup_seconds}

    def load_state_dict(self, state: dict) -> None:
        """Continue the clock of a resumed run where it stopped."""
        self.seconds = defaultdict(float, state["seconds"])
        self._carried = state["elapsed"]
        self._started = time.perf_counter() - self._carried
        self.startup_seconds = state.get("startup", 0.0)  # absent from checkpoints made before it was counted

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _settle(self) -> None:
        """Charge every closed outermost phase its exclusive seconds, once its events ran (a GPU's: a CPU's
        phases are charged as they close)."""
        if self._closed:
            self._sync()
        for closed in self._closed:
            self._charge(closed)
        self._closed.clear()

    def _charge(self, phase: _Phase) -> float:
        spent = phase.start.elapsed_time(phase.end) / 1000
        self.seconds[phase.name] += spent - sum(self._charge(inner) for inner in phase.nested)
        return spent
