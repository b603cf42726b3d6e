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


def test_the_wall_split_adds_up_and_a_restored_clock_carries_its_start_up_and_seconds_on(clock):
    timer = PhaseTimer(torch.device("cpu"))
    timer.start(startup_seconds=2.0)
    with timer.phase("backward"):
        clock.advance(1.0)
    for phase in ("evaluation", "probes", "checkpointing"):
        with timer.phase(phase):
            clock.advance(0.5)
    assert timer.wall_split() == pytest.approx(
        {"startup": 2.0, "training": 1.0, "evaluation": 0.5, "probes": 0.5, "checkpointing": 0.5})
    state = timer.state_dict()

    clock.advance(60.0)  # the run was stopped; another process starts it again later
    restored = PhaseTimer(torch.device("cpu"))
    restored.load_state_dict(state)
    clock.advance(3.0)  # reading the data again, rebuilding the model
    restored.start(startup_seconds=3.0)
    with restored.phase("backward"):
        clock.advance(1.0)
    split = restored.wall_split()
    assert split == pytest.approx(
        {"startup": 5.0, "training": 2.0, "evaluation": 0.5, "probes": 0.5, "checkpointing": 0.5})
