"""The console a run writes to: on a terminal, a tqdm bar inside each epoch; elsewhere, plain lines."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator, TextIO

from tqdm import tqdm

from raysb.training.progress import EpochStatus, print_line

# What the bar shows beside itself; tqdm puts ", " before the postfix, which here reads as a list.
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} examples{postfix}"


class TerminalConsole:
    """raysb's lines on a terminal, and each epoch's progress as a tqdm bar below them.

    A line first clears the bar: the epoch's own line replaces the bar that led to it, and the
    next status starts a fresh bar. On a --workers run the driver's relay thread calls it while
    the main thread may print, hence the lock.
    """

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.bar: tqdm | None = None
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            self._clear_bar()
            self.stream.write(line + "\n")
            self.stream.flush()

    def progress(self, status: EpochStatus) -> None:
        with self.lock:
            if self.bar is not None and self.bar.desc == status.label:
                self.bar.n = _examples_seen(status)
                self.bar.set_postfix_str(_figures(status))  # and redraws
            else:
                self._clear_bar()
                self.bar = self._new_bar(status)

    def close(self) -> None:
        with self.lock:
            self._clear_bar()

    def _new_bar(self, status: EpochStatus) -> tqdm:
        # The figures are rank 0's (every rank's examples, its clock), not tqdm's own estimates
        # from when updates reach this process: those lag a relay's poll on --workers runs.
        return tqdm(total=status.examples, initial=_examples_seen(status), postfix=_figures(status),
                    desc=status.label, file=self.stream, leave=False, dynamic_ncols=True, bar_format=BAR_FORMAT,
                    mininterval=0)

    def _clear_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()  # leave=False: the bar's line is erased
            self.bar = None


def _examples_seen(status: EpochStatus) -> int:
    return min(int(status.seen), status.examples)


def _figures(status: EpochStatus) -> str:
    loss = f", train_loss {status.loss:.3f}" if status.loss is not None else ""
    return f"{status.rate:,.0f} examples/s, ~{status.left_s:.0f}s left, {status.steps} steps{loss}"


@contextlib.contextmanager
def run_console(log: Callable[[str], None] | None, bar: bool = True) -> Iterator[Callable[[str], None]]:
    """`log` as given; else this process's stdout: a TerminalConsole where it is a terminal and
    `bar` allows (its bar cleared when the block ends, however it ends), plain lines elsewhere
    (pipes, files, CI, Ray Jobs logs), as a run printed them before bars."""
    if log is not None:
        yield log
    elif not (bar and sys.stdout.isatty()):
        yield print_line
    else:
        console = TerminalConsole(sys.stdout)
        try:
            yield console
        finally:
            console.close()
