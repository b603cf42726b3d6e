"""One CDF_R for all ranks: a Ray actor that merges every rank's losses.

Each rank pushes the losses of every selection chunk (a "round") without
waiting, and ranks against a *versioned snapshot*: version v is the last R
losses after every rank's rounds 0..v were merged, in rank order. A rank
refreshes its snapshot every `sync_interval` rounds, pinned to version
`round - lag`, so all ranks rank against bit-identical histories (one
percentile function) while the pushes of the most recent `lag` rounds are
still in flight; staleness is `lag` to `lag + sync_interval - 1` rounds.
Each refresh also requests the next one, which the actor answers as soon as
that version is complete, so a rank rarely waits on the actor.

If the actor dies or stops answering, a run that may restart
(`restart_on_loss`) fails its worker group, and Ray Train resumes it from the
last checkpoint with a new actor seeded from it, so selection continues exactly
as it would have. A run that may not restart falls back, on every rank, to the
rank's own last R losses (kept alongside all along) and says so: ranking stays
sensible, no rank blocks, and the summary records when it happened.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict

import numpy as np
import ray
import torch

from raysb.core.selection import LossHistory


@ray.remote(num_cpus=0, max_concurrency=1000)
class LossHistoryActor:
    def __init__(self, world_size: int, capacity: int, retained_snapshots: int = 64):
        self.world_size = world_size
        self.history = LossHistory(capacity)
        self.pending: dict[int, dict[int, np.ndarray]] = {}
        self.published = -1
        self.snapshots: OrderedDict[int, np.ndarray] = OrderedDict()
        self.retained = retained_snapshots
        self.pushed_examples = 0
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        # Created on first use so it binds to the actor's event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def push(self, rank: int, round_index: int, losses: np.ndarray) -> None:
        if round_index <= self.published:
            return
        self.pending.setdefault(round_index, {})[rank] = losses
        self.pushed_examples += len(losses)
        await self._publish_complete_rounds()

    async def _publish_complete_rounds(self) -> None:
        advanced = False
        while len(self.pending.get(self.published + 1, {})) == self.world_size:
            complete = self.pending.pop(self.published + 1)
            for r in range(self.world_size):
                self.history.extend(torch.from_numpy(np.array(complete[r], dtype=np.float32)))
            self._publish(self.published + 1)
            advanced = True
        if advanced:
            async with self._condition():
                self._condition().notify_all()

    def _publish(self, version: int) -> None:
        self.published = version
        self.snapshots[version] = self.history.chronological().numpy().copy()
        while len(self.snapshots) > self.retained:
            self.snapshots.popitem(last=False)

    async def snapshot(self, version: int) -> tuple[int, np.ndarray]:
        async with self._condition():
            await self._condition().wait_for(lambda: self.published >= version)
        if version in self.snapshots:
            return version, self.snapshots[version]
        oldest = next(iter(self.snapshots))
        return oldest, self.snapshots[oldest]

    async def restore(self, merged: np.ndarray, last_round: int) -> None:
        """Seed a new actor with a checkpointed history (idempotent: every rank calls it).

        Ranks' pushes of the rounds after `last_round` may arrive first; they wait in
        `pending` and are published here, and snapshot requests already waiting are woken.
        """
        if self.published >= last_round:
            return
        self.history.extend(torch.from_numpy(np.array(merged, dtype=np.float32)))
        self._publish(last_round)
        async with self._condition():
            self._condition().notify_all()
        await self._publish_complete_rounds()

    def stats(self) -> dict:
        return {"published_version": self.published, "pushed_examples": self.pushed_examples}


class HistoryActorLost(RuntimeError):
    """The shared loss-history actor died or stopped answering (the worker group restarts)."""


class SharedLossHistory:
    """The `LossHistory` interface over the actor, for `Selector(history=...)`."""

    def __init__(
        self,
        actor,
        rank: int,
        capacity: int,
        sync_interval: int = 4,
        lag: int = 1,
        timeout_s: float = 120.0,
        device: torch.device | str = "cpu",
        log=print,
        restart_on_loss: bool = False,
    ):
        self.actor = actor
        self.restart_on_loss = restart_on_loss
        self.rank = rank
        self.capacity = capacity
        self.sync_interval = sync_interval
        self.lag = lag
        self.timeout_s = timeout_s
        self.device = device
        self.log = log
        self.own = LossHistory(capacity, device)
        # Rounds this rank has pushed: one per `extend`, which selection calls once per round
        # that ranks losses (plain-SGD rounds push nothing). The actor's versions count them.
        self.pushed_rounds = 0
        self.snapshot = torch.empty(0, device=device)
        self.snapshot_version = -1
        self.requested: dict[int, ray.ObjectRef] = {}
        self.failed_at_round: int | None = None
        self.actor_seconds = 0.0
        self.staleness_rounds_sum = 0

    def __len__(self) -> int:
        return self.values().numel()

    def extend(self, losses: torch.Tensor) -> None:
        self.own.extend(losses)
        if self.failed_at_round is None:
            started = time.perf_counter()
            try:
                self.actor.push.remote(self.rank, self.pushed_rounds, losses.detach().float().cpu().numpy())
                if self.pushed_rounds % self.sync_interval == 0:
                    self._pull(max(0, self.pushed_rounds - self.lag), self.pushed_rounds + self.sync_interval - self.lag)
            except (ray.exceptions.RayError, TimeoutError) as error:
                self._lost(error)
            self.actor_seconds += time.perf_counter() - started
        self.staleness_rounds_sum += self.pushed_rounds - self.snapshot_version
        self.pushed_rounds += 1

    def _lost(self, error: Exception) -> None:
        what = f"rank {self.rank}: the loss-history actor is unavailable at round {self.pushed_rounds} ({type(error).__name__})"
        if self.restart_on_loss:
            raise HistoryActorLost(f"{what}; restarting from the last checkpoint")
        self.failed_at_round = self.pushed_rounds
        self.log(f"raysb: {what}; ranking against this rank's own last {self.capacity} losses")

    def _pull(self, version: int, next_version: int) -> None:
        reply = self.requested.pop(version, None) or self.actor.snapshot.remote(version)
        self.requested[next_version] = self.actor.snapshot.remote(next_version)
        got, values = ray.get(reply, timeout=self.timeout_s)
        self.snapshot = torch.from_numpy(np.array(values, dtype=np.float32)).to(self.device)
        self.snapshot_version = got

    def values(self) -> torch.Tensor:
        if self.failed_at_round is not None or not self.snapshot.numel():
            return self.own.values()
        return self.snapshot

    def stats(self) -> dict:
        return {
            "rounds": self.pushed_rounds,
            "mean_staleness_rounds": self.staleness_rounds_sum / self.pushed_rounds if self.pushed_rounds else 0.0,
            "actor_seconds": self.actor_seconds,
            "actor_failed_at_round": self.failed_at_round,
        }

    def state_dict(self) -> dict:
        """This rank's view plus the merged history of every round so far.

        With the merged history a resumed run's new actor starts where the old
        one stood, so selection after a restart is the same as without one.
        """
        merged = None
        if self.failed_at_round is None and self.pushed_rounds > 0:
            try:
                _, merged = ray.get(self.actor.snapshot.remote(self.pushed_rounds - 1), timeout=self.timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as error:
                # Recorded, so a run resumed from this checkpoint also ranks on its own.
                self._lost(error)
        return {
            "own": self.own.state_dict(),
            "pushed_rounds": self.pushed_rounds,
            "snapshot": self.snapshot.cpu(),
            "snapshot_version": self.snapshot_version,
            "merged": merged,
            "staleness_rounds_sum": self.staleness_rounds_sum,
            "actor_seconds": self.actor_seconds,
            "failed_at_round": self.failed_at_round,
        }

    def load_state_dict(self, state: dict) -> None:
        self.own.load_state_dict(state["own"])
        self.pushed_rounds = int(state["pushed_rounds"])
        self.snapshot = state["snapshot"].to(self.device)
        self.snapshot_version = int(state["snapshot_version"])
        self.staleness_rounds_sum = int(state["staleness_rounds_sum"])
        self.actor_seconds = float(state["actor_seconds"])
        # A rank that had lost the actor keeps ranking against its own losses, as it would have.
        self.failed_at_round = state["failed_at_round"]
        if state["merged"] is not None:
            self.actor.restore.remote(state["merged"], self.pushed_rounds - 1)


def shared_loss_history(
    collective, capacity: int, device: torch.device | str = "cpu", **options
) -> SharedLossHistory:
    """One CDF_R for a worker group: rank 0 names a fresh actor and every rank joins it (a collective).

    Fresh per worker-group incarnation: a restarted group never meets the rounds of
    the one that died, and concurrent runs never share one. `options` go to
    SharedLossHistory. The actor answers before this returns.
    """
    session = collective.broadcast_object(uuid.uuid4().hex[:12] if collective.rank == 0 else None)
    actor = LossHistoryActor.options(name=f"raysb-cdf-{session}", get_if_exists=True).remote(
        collective.world_size, capacity
    )
    history = SharedLossHistory(actor, collective.rank, capacity, device=device, **options)
    ray.get(actor.stats.remote(), timeout=history.timeout_s)
    return history
