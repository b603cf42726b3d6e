"""Ctrl-C (SIGINT) and SIGTERM end a run with one line: where it stopped, its last checkpoint,
and the command that continues it."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from dataclasses import dataclass
from typing import Iterator

# The command that continues a run: everything else comes from the run's own config.yaml (raysb.resume).
RESUME_COMMAND = "raysb train --out {out} --resume"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread; `line` says what the run left.

    A KeyboardInterrupt, so that no `except Exception` on its way up takes it for a failure
    of the run, and a plain Ctrl-C in code that never installed raysb's handler is caught the
    same way."""

    def __init__(self, signal_name: str, line: str = ""):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.line = line or f"raysb: stopped by {signal_name} before training started"

    @property
    def exit_status(self) -> int:
        # The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM.
        return 128 + signal.Signals[self.signal_name]


# The signal signals_interrupt's handler took last. Ray's `ray.get` turns whatever its signal check
# raised into a KeyboardInterrupt of its own, so the exception that reaches raysb may not say.
_received: list[str] = []
# How many `interrupts_deferred` blocks the main thread is in.
_deferring = [0]


def raise_if_received() -> None:
    """Raise Interrupted if a signal came and its handler's exception did not get through: a handler
    runs wherever the main thread is, and there (an import's hook, a finalizer) Python can print
    an exception as "ignored" and go on. The training loop asks at every round."""
    if _received:
        raise Interrupted(_received[-1])


def signal_name(stop: KeyboardInterrupt) -> str:
    return getattr(stop, "signal_name", None) or (_received[-1] if _received else "SIGINT")


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise Interrupted in the main thread: SIGTERM (a
    scheduler's, `kill`'s) would otherwise end the process without a word, and SIGINT with a
    traceback. Only the first signal: the handlers in place before come back with it, so a
    second Ctrl-C ends a clean-up that hangs."""
    numbers = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.getsignal(number) for number in numbers}

    def restore() -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)

    def stop(number: int, frame) -> None:
        restore()
        _received.append(signal.Signals(number).name)
        if not _deferring[0]:
            raise Interrupted(_received[-1])

    for number in numbers:
        signal.signal(number, stop)
    try:
        yield
    finally:
        restore()
        _received.clear()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A signal that comes while the block runs is raised as it ends: a checkpoint's commit and the
    run's record of it happen both or neither, so the line an interrupt ends the run with names the
    checkpoint on disk (raised between them, it said there was none to resume from)."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0]:
        raise_if_received()


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """SIGTERM's handler comes back after the block, on the main thread: `ray.init` replaces it with
    an exit that says nothing, and its core worker with a crash handler that aborts the process on
    SIGTERM, so without this SIGTERM would end a Ray run in no way raysb chose."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None:  # None: not set from Python, nothing to restore
            signal.signal(signal.SIGTERM, before)


@dataclass
class RunPosition:
    """How far a run has got, for the line an interrupt ends it with."""

    # None: a budget alone ends the run.
    epochs: int | None
    # Epochs finished; None: training has not started.
    finished: int | None = None
    # The epoch the newest checkpoint follows; None: no checkpoint yet.
    checkpoint: int | None = None

    def line(self, stop: KeyboardInterrupt, out: str, location: str) -> str:
        """`location`: where the newest checkpoint is (a file, or Ray Train's checkpoint folder)."""
        name = signal_name(stop)
        if self.finished is None:
            where = "before training started"
        elif self.epochs is None:
            where = f"in epoch {self.finished + 1}"
        else:
            where = f"in epoch {min(self.finished + 1, self.epochs)} of {self.epochs}"
        if self.checkpoint is None:
            return (
                f"raysb: stopped by {name} {where}, before its first checkpoint: nothing to resume; "
                "the same command starts the run again"
            )
        return (
            f"raysb: stopped by {name} {where}; last checkpoint after epoch {self.checkpoint} ({location}); "
            f"continue with: {RESUME_COMMAND.format(out=shlex.quote(out))}"
        )
