"""A --workers run's console: rank 0 sends its lines through the relay, and its epoch's progress
too where the driver's console draws a bar, so that the driver, which owns the terminal, draws it."""

import sys

import pytest

import test_progress
from raysb.distributed.console import relayed_console, relayed_log
from raysb.training.progress import EpochProgress, EpochStatus
from test_progress import BarConsole, FakeClock, counts


def rank_zero(relay) -> None:
    """Rank 0's part, as the epoch loop plays it: a line, half an epoch's progress, the epoch's line."""
    clock = FakeClock()
    log = relayed_log(relay)
    progress = EpochProgress(log, epochs=1, examples_per_epoch=100, world_size=1, every_s=1.0, clock=clock)
    log("raysb: sb on fashion-mnist")
    progress.update(0, lambda: counts(0))
    clock.now += 1.0  # due as a line and as a redraw
    progress.update(0, lambda: counts(50, steps=2, loss_sum=3.0))
    log("epoch   1/1  test_err 10.00%")


@pytest.mark.parametrize("draws_bars", [True, False], ids=["terminal", "pipe"])
def test_the_driver_draws_rank_zeros_progress_where_its_console_draws_bars_and_prints_lines_elsewhere(
    ray_session, draws_bars
):
    import ray.cloudpickle

    # Ray workers cannot import the test modules: send rank 0's part and its helpers by value.
    for module in (sys.modules[__name__], test_progress):
        ray.cloudpickle.register_pickle_by_value(module)
    driver = BarConsole()
    console = driver if draws_bars else driver.__call__  # a plain `log` draws nothing
    with relayed_console(console) as relay:
        ray_session.get(ray_session.remote(rank_zero).remote(relay), timeout=120)
    status = EpochStatus(epoch=1, epochs=1, seen=50, examples=100, rate=50.0, left_s=1.0, steps=2, loss=1.5)
    shown = status if draws_bars else status.line()
    # In order: the bar comes before the epoch's line that replaces it.
    assert driver.calls == ["raysb: sb on fashion-mnist", shown, "epoch   1/1  test_err 10.00%"]
