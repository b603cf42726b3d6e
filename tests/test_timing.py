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


def test_evaluation_and_checkpointing_are_timed_but_are_not_training():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("backward"):
        time.sleep(0.05)
    with timer.phase("evaluation"):
        time.sleep(0.1)
    with timer.phase("checkpointing"):
        time.sleep(0.1)
    training = timer.training_seconds()
    assert 0.05 <= training < 0.09
    assert timer.total("evaluation") >= 0.1 and timer.total("checkpointing") >= 0.1
    assert set(timer.breakdown()) == {"selection", "train_forward", "backward", "train_step", "data", "bookkeeping",
                                      "other"}
    # The per-round budget check reads the host clock alone, with the same phases left out.
    assert abs(timer.host_training_seconds() - timer.training_seconds()) < 0.01
