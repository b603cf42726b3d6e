"""Rank 0's console lines (and a sweep's trials'), printed by the driver as a single process prints them.

Ray forwards each worker's stdout to the driver with a `(RayTrainWorker pid=...)`
prefix, among Ray Train's own messages (a metrics dictionary at every report,
worker-group set-up, harmless tracebacks from its cleanup actors). A driver that
joins Ray with `log_to_driver=False` (raysb's default; `--verbose` keeps Ray's
output) shows none of that, so rank 0 sends its lines through a small actor that
the driver drains while the run trains.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# How often the driver prints what rank 0 has sent: lines arrive a few per epoch.
POLL_SECONDS = 0.5
# A driver whose cluster died must not wait long for lines.
DRAIN_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0, max_restarts=0)
class ConsoleRelay:
    """Lines rank 0 has put and the driver has not taken yet."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def put(self, line: str) -> None:
        self._lines.append(line)

    def take(self) -> list[str]:
        lines, self._lines = self._lines, []
        return lines


def relayed_log(relay) -> Callable[[str], None]:
    """A `log` for rank 0 of a run, or a sweep's trial: each line waits until the relay holds it,
    so none is lost when the run ends."""

    def log(line: str) -> None:
        ray.get(relay.put.remote(line))

    return log


@contextlib.contextmanager
def relayed_console(log: Callable[[str], None]) -> Iterator:
    """A relay for the run's rank 0 to send lines to; `log` prints them here until the block ends."""
    # On the driver's node: a relay on a worker node would die with that node, and every
    # later worker group's rank 0 would fail on its first line.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = ConsoleRelay.options(scheduling_strategy=here).remote()
    stopped = threading.Event()

    def drain() -> None:
        for line in ray.get(relay.take.remote(), timeout=DRAIN_TIMEOUT_S):
            log(line)

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
