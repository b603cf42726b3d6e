"""What a run prints inside an epoch: a line every few seconds with how far, how fast, how long."""

from raysb.training.progress import EpochProgress, epoch_line


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def counts(considered, steps=0, loss_sum=0.0):
    return {"epoch_considered": considered, "epoch_steps": steps, "epoch_loss_sum": loss_sum}


def test_a_line_every_interval_with_fraction_rate_and_time_left():
    lines, clock = [], FakeClock()
    progress = EpochProgress(lines.append, epochs=5, examples_per_epoch=10_000, world_size=2, every_s=10, clock=clock)
    progress.update(0, lambda: counts(0))  # the epoch starts: nothing to say yet
    clock.now += 4
    progress.update(0, lambda: counts(1000))
    assert lines == []  # not before the interval
    clock.now += 6
    progress.update(0, lambda: counts(2500, steps=20, loss_sum=30.0))
    # 2 ranks x 2500 = half the epoch in 10 s: 500 examples/s, 10 s left.
    assert lines == [
        "  epoch   1/5   50% of its examples  500 examples/s  ~10s left in the epoch  20 steps  train_loss 1.500"
    ]
    clock.now += 5
    progress.update(0, lambda: counts(3000))
    assert len(lines) == 1  # the interval counts from the last line
    clock.now += 5
    progress.update(0, lambda: counts(4000))
    assert len(lines) == 2 and "80% of its examples" in lines[-1] and "steps" in lines[-1]


def test_a_new_epoch_restarts_the_clock_and_zero_turns_it_off():
    lines, clock = [], FakeClock()
    progress = EpochProgress(lines.append, epochs=2, examples_per_epoch=1000, world_size=1, every_s=1, clock=clock)
    progress.update(0, lambda: counts(0))
    clock.now += 50
    progress.update(1, lambda: counts(0))  # epoch 2 begins: its rate is not epoch 1's
    clock.now += 2
    progress.update(1, lambda: counts(100))
    assert lines == ["  epoch   2/2   10% of its examples  50 examples/s  ~18s left in the epoch  0 steps"]

    silent = EpochProgress(lines.append, epochs=2, examples_per_epoch=1000, world_size=1, every_s=0, clock=clock)
    for step in range(5):
        clock.now += 100
        silent.update(0, lambda: counts(step * 100))
    assert len(lines) == 1


def test_an_epoch_without_a_step_shows_no_train_loss_rather_than_nan():
    """It once printed `train_loss nan`, which reads as a failure."""
    row = dict(epoch=2, test_error=0.5, train_loss=float("nan"), kept_fraction=0.3, epoch_steps=0, lr=0.1,
               optimizer_steps=4, wall_s=1.0, time_selection_s=0.0, time_train_forward_s=0.0, time_backward_s=0.0,
               time_data_s=0.0, time_bookkeeping_s=0.0, time_other_s=0.0)
    line = epoch_line(row, 3)
    assert "train_loss – (no step)  kept 30.0%  steps 0" in line and "nan" not in line
    assert "train_loss 1.250" in epoch_line({**row, "train_loss": 1.25, "epoch_steps": 2}, 3)
