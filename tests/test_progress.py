"""What a run prints inside an epoch: a line every few seconds with how far, how fast, how long,
or on a terminal a bar that the epoch's own line replaces."""

import contextlib
import fcntl
import os
import pty
import re
import struct
import termios
import threading

from raysb.cli import main
from raysb.training import progress as progress_module
from raysb.training.progress import BAR_REFRESH_S, EpochProgress, EpochStatus, epoch_line

from conftest import needs_fashion_mnist


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def counts(considered, steps=0, loss_sum=0.0):
    return {"epoch_considered": considered, "epoch_reached": considered, "epoch_steps": steps, "epoch_loss_sum": loss_sum}


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


@needs_fashion_mnist
def test_an_epoch_decided_as_it_starts_shows_how_far_its_steps_are(tmp_path, capsys):
    # Traditional and free-sb decide a whole epoch as it starts: their lines once said 100% of its
    # examples and ~0s left from the first, at a rate that kept falling.
    assert main(["train", "--strategy", "traditional", "--subset", "2000", "--test-subset", "200", "--epochs", "1",
                 "--batch-size", "50", "--progress-seconds", "1e-9", "--set", "record_analysis=false",
                 "--out", str(tmp_path / "run")]) == 0
    shares = [int(share) for share in re.findall(r"(\d+)% of its examples", capsys.readouterr().out)]
    assert len(shares) >= 10 and shares == sorted(shares), shares
    assert shares[0] < 20 and shares[-1] >= 90, shares


def test_an_epoch_without_a_step_shows_no_train_loss_rather_than_nan():
    """It once printed `train_loss nan`, which reads as a failure."""
    row = dict(epoch=2, test_error=0.5, train_loss=float("nan"), kept_fraction=0.3, epoch_steps=0, lr=0.1,
               optimizer_steps=4, wall_s=1.0, time_selection_s=0.0, time_train_forward_s=0.0, time_backward_s=0.0,
               time_data_s=0.0, time_bookkeeping_s=0.0, time_other_s=0.0)
    line = epoch_line(row, 3)
    assert "train_loss – (no step)  kept 30.0%  steps 0" in line and "nan" not in line
    assert "train_loss 1.250" in epoch_line({**row, "train_loss": 1.25, "epoch_steps": 2}, 3)


def test_an_epoch_line_gives_the_estimated_wrong_labels_and_the_doubt_rule_where_the_run_has_them():
    row = dict(epoch=3, test_error=0.1, train_loss=0.5, kept_fraction=0.3, epoch_steps=9, lr=0.1,
               optimizer_steps=40, wall_s=1.0, time_selection_s=0.0, time_train_forward_s=0.0, time_backward_s=0.0,
               time_data_s=0.0, time_bookkeeping_s=0.0, time_other_s=0.0)
    assert "kept 30.0%  steps 9" in epoch_line(row, 3)
    assert "kept 30.0%  wrong labels 21.5% (doubt tiered)  steps 9" in epoch_line(
        {**row, "suspected_label_share": 0.215, "label_doubt_rule": "tiered"}, 3)
    assert "kept 30.0%  wrong labels –  steps 9" in epoch_line({**row, "suspected_label_share": None}, 3)
    # A sharded loss table's run: no rank holds every margin to estimate the share, but the rule applied.
    assert "kept 30.0%  doubt off  steps 9" in epoch_line({**row, "label_doubt_rule": "off"}, 3)


class BarConsole:
    """A console that draws a bar (a ProgressConsole), keeping the lines and statuses it is given in order."""

    def __init__(self):
        self.calls = []

    def __call__(self, line):
        self.calls.append(line)

    def progress(self, status):
        self.calls.append(status)


def test_a_console_that_draws_a_bar_gets_the_epochs_status_at_each_refresh_instead_of_lines():
    console, clock = BarConsole(), FakeClock()
    progress = EpochProgress(console, epochs=5, examples_per_epoch=10_000, world_size=2, every_s=10, clock=clock)
    progress.update(0, lambda: counts(0))
    clock.now += BAR_REFRESH_S  # well inside the 10 s a line waits for
    progress.update(0, lambda: counts(500, steps=4, loss_sum=6.0))
    clock.now += BAR_REFRESH_S
    progress.update(0, lambda: counts(1000, steps=8, loss_sum=10.0))
    first, second = console.calls  # statuses, no line
    # 2 ranks x 500 = a tenth of the epoch in 0.5 s; the same figures a line would print.
    assert first == EpochStatus(epoch=1, epochs=5, seen=1000, examples=10_000, rate=2000, left_s=4.5, steps=4, loss=1.5)
    assert first.line() == "  epoch   1/5   10% of its examples  2,000 examples/s  ~4s left in the epoch  4 steps  train_loss 1.500"
    assert second.done == 0.2 and second.loss == 1.25

    silent = EpochProgress(BarConsole(), epochs=5, examples_per_epoch=10_000, world_size=1, every_s=0, clock=clock)
    for step in range(3):
        clock.now += 100
        silent.update(0, lambda: counts(step * 100))
    assert silent.bar.calls == []  # --progress-seconds 0 turns the bar off too


def read_until_closed(master: int, received: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            return
        if not chunk:
            return
        received.append(chunk)


def on_a_terminal(run) -> tuple[int, str]:
    """`run()`'s result and what it wrote to stdout, stdout being a pseudo-terminal 120 columns wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    received: list[bytes] = []
    reader = threading.Thread(target=read_until_closed, args=(master, received))
    reader.start()
    try:
        with open(slave, "w", encoding="utf-8") as terminal, contextlib.redirect_stdout(terminal):
            result = run()
    finally:
        reader.join(timeout=30)
        os.close(master)
    return result, b"".join(received).decode("utf-8").replace("\r\n", "\n")  # the terminal's own line ends


SMALL_RUN = ["train", "--dataset", "fashion-mnist", "--strategy", "sb", "--selectivity", "0.33", "--epochs", "1",
             "--subset", "1000", "--test-subset", "500", "--batch-size", "50", "--set", "model_options.width=8"]


@needs_fashion_mnist
def test_a_terminal_shows_a_bar_inside_each_epoch_that_its_line_replaces_and_a_pipe_the_plain_lines(
    tmp_path, monkeypatch, capsys
):
    # A redraw before every round, so that an epoch on a fast machine draws one too.
    monkeypatch.setattr(progress_module, "BAR_REFRESH_S", 0.0)
    code, screen = on_a_terminal(lambda: main([*SMALL_RUN, "--out", str(tmp_path / "terminal")]))
    assert code == 0
    drawn = screen.split("\r")
    bar = re.compile(r"epoch   1/1 +\d+%\|.+\| \d+/1000 examples, [\d,]+ examples/s, ~\d+s left, \d+ steps")
    assert any(bar.match(part) for part in drawn), screen[:3000]
    # tqdm erases the bar (a carriage return, blanks, a carriage return), then the epoch's line is written.
    assert re.search(r"\r +\repoch   1/1  test_err", screen), screen[-3000:]
    assert "of its examples" not in screen  # the bar, not the lines a pipe gets
    assert screen.rstrip("\n").splitlines()[-1].startswith("raysb: completed after 1 epoch(s)")

    assert main([*SMALL_RUN, "--progress-seconds", "1e-9", "--out", str(tmp_path / "pipe")]) == 0
    printed = capsys.readouterr().out
    assert "\r" not in printed and "%|" not in printed and "\x1b" not in printed
    kinds = [re.match(r"raysb: |epoch   1/1  test_err|  epoch   1/1 +\d+% of its examples", line) for line in
             printed.splitlines()]
    assert all(kinds) and any(line.startswith("  epoch") for line in printed.splitlines()), printed
