"""Rank 0's console lines (and a sweep's trials'), printed by the driver as a single process prints them.

Ray forwards each worker's stdout to the driver with a `(RayTrainWorker pid=...)`
prefix, among Ray Train's own messages (a metrics dictionary at every report,
worker-group set-up, harmless tracebacks from its cleanup actors). A driver that
joins Ray with `log_to_driver=False` (raysb's default; `--verbose` keeps Ray's
output) shows none of that, so rank 0 sends its lines through a small actor that
the driver drains while the run trains.

Where the driver's console draws a progress bar (a terminal: raysb.training.terminal), rank 0
sends each epoch's status through the same relay and the driver, which owns the terminal,
draws the bar from it; elsewhere rank 0 sends progress as lines, as a single process prints them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysb.training.progress import EpochStatus, ProgressConsole

# How often the driver prints what rank 0 has sent: lines arrive a few per epoch.
POLL_SECONDS = 0.5
# A driver whose cluster died must not wait long for lines.
DRAIN_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0, max_restarts=0)
class ConsoleRelay:
    """Lines (and, for a driver that draws bars, epoch statuses) rank 0 has put and the driver
    has not taken yet."""

    def __init__(self, draws_bars: bool) -> None:
        self._draws_bars = draws_bars
        self._items: list[str | EpochStatus] = []

    def draws_bars(self) -> bool:
        return self._draws_bars

    def put(self, item: str | EpochStatus) -> None:
        self._items.append(item)

    def take(self) -> list[str | EpochStatus]:
        items, self._items = self._items, []
        return items


class RelayedLog:
    """A `log` for rank 0 of a run, or a sweep's trial: each line waits until the relay holds it,
    so none is lost when the run ends."""

    def __init__(self, relay) -> None:
        self.relay = relay

    def __call__(self, line: str) -> None:
        ray.get(self.relay.put.remote(line))


class RelayedBarLog(RelayedLog):
    """A RelayedLog whose driver draws a bar: epoch statuses go to it too, without waiting (one
    late or lost costs nothing, and a relay keeps one sender's calls in order)."""

    def progress(self, status: EpochStatus) -> None:
        self.relay.put.remote(status)


def relayed_log(relay) -> RelayedLog:
    """Rank 0's `log`, sending to `relay` (the driver's `relayed_console`)."""
    return RelayedBarLog(relay) if ray.get(relay.draws_bars.remote()) else RelayedLog(relay)


@contextlib.contextmanager
def relayed_console(log: Callable[[str], None]) -> Iterator:
    """A relay for the run's rank 0 to send lines to; `log` prints them here until the block ends
    (and draws the statuses it is sent, where it is a ProgressConsole)."""
    # On the driver's node: a relay on a worker node would die with that node, and every
    # later worker group's rank 0 would fail on its first line.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = ConsoleRelay.options(scheduling_strategy=here).remote(isinstance(log, ProgressConsole))
    stopped = threading.Event()

    def drain() -> None:
        for item in ray.get(relay.take.remote(), timeout=DRAIN_TIMEOUT_S):
            if isinstance(item, EpochStatus):
                log.progress(item)
            else:
                log(item)

    def pump() -> None:
        try:
            while not stopped.wait(POLL_SECONDS):
                drain()
        except ray.exceptions.RayError:
            pass  # the cluster is going away; the driver reports that, not this thread

    thread = threading.Thread(target=pump, name="raysb-console", daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        stopped.set()
        thread.join()
        with contextlib.suppress(ray.exceptions.RayError):
            drain()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(relay)
