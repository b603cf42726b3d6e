"""PhaseTimer: nested phases are charged exclusive time, so the split adds up."""

import time

import torch

from raysb.training.timing import PhaseTimer


def test_nested_phases_are_charged_exclusive_time():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("bookkeeping"):
        time.sleep(0.05)
        with timer.phase("data"):
            time.sleep(0.1)
        with timer.phase("selection"):
            with timer.phase("data"):
                time.sleep(0.05)
    assert 0.05 <= timer.seconds["bookkeeping"] < 0.09
    assert 0.15 <= timer.seconds["data"] < 0.2
    assert timer.seconds["selection"] < 0.02
    split = timer.breakdown()
    assert abs(sum(split.values()) - timer.training_seconds()) < 1e-3  # the clock moved between calls
