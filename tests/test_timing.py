"""PhaseTimer: nested phases are charged exclusive time, so the split adds up."""

import pytest
import torch

from raysb.training import timing
from raysb.training.timing import PhaseTimer


@pytest.fixture
def clock(monkeypatch):
    """The host clock the timer reads, moved by hand: the tests check its arithmetic, not how long
    a sleep takes on a loaded machine."""

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

        def advance(self, seconds: float) -> None:
            self.now += seconds

    fake = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_nested_phases_are_charged_exclusive_time(clock):
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("bookkeeping"):
        clock.advance(0.05)
        with timer.phase("data"):
            clock.advance(0.1)
        with timer.phase("selection"):
            with timer.phase("data"):
                clock.advance(0.05)
    assert timer.seconds["bookkeeping"] == pytest.approx(0.05)
    assert timer.seconds["data"] == pytest.approx(0.15)
    assert timer.seconds["selection"] == pytest.approx(0.0, abs=1e-12)
    split = timer.breakdown()
    assert sum(split.values()) == pytest.approx(timer.training_seconds())


def test_evaluation_and_checkpointing_are_timed_but_are_not_training(clock):
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("backward"):
        clock.advance(0.05)
    with timer.phase("evaluation"):
        clock.advance(0.1)
    with timer.phase("checkpointing"):
        clock.advance(0.1)
    training = timer.training_seconds()
    assert training == pytest.approx(0.05)
    assert timer.total("evaluation") == pytest.approx(0.1) and timer.total("checkpointing") == pytest.approx(0.1)
    assert set(timer.breakdown()) == {"selection", "train_forward", "backward", "train_step", "data", "bookkeeping",
                                      "other"}
    # The per-round budget check reads the host clock alone, with the same phases left out.
    assert timer.host_training_seconds() == pytest.approx(timer.training_seconds())
