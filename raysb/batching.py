"""From each rank's kept examples to the training batches it runs.

Two policies behind one interface (`Batching.ready_batches`):

- `LocalBatching`: one process. Kept examples, with the inputs they were scored
  on, queue in a `BatchFormer`; every full batch of b is trained on.

- `LockstepBatching`: N data-parallel ranks whose Bernoulli selection keeps a
  different number of examples on each rank. After every selection chunk (a
  "round") the ranks all-gather the sample ids they kept and append them, in
  rank order, to a *global queue* of which every rank holds an identical copy.
  While the queue holds N*b ids, the next N*b are popped and rank r trains on
  slice [r*b, (r+1)*b). Because every rank applies the same deterministic rule to
  the same queue, all ranks run the same number of equal-sized steps without
  any further communication, kept examples on a busy rank are trained on by an
  idle one, and nothing is dropped: kept = backpropagated + queue remainder.
  The same all-gather carries Stale-SB's freshly scored losses, so every rank
  knows every example's last loss wherever it is seen next, and two flags: the
  stop vote of rank 0 (time budget) and any rank's error, so that all ranks
  stop at the same round instead of one waiting forever in a collective.
"""

from __future__ import annotations

import time

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from raysb.batch_former import Batch, BatchFormer
from raysb.collective import Collective
from raysb.selection import NonFiniteLossError
from raysb.strategies import LossTable


class Batching(Protocol):
    def ready_batches(self, kept: Batch, stop_vote: bool, error: str | None) -> Iterator[Batch]:
        """Batches this rank trains on now; raises if any rank reported an error."""

    def agree_finite(self, finite: bool) -> bool:
        """Whether every rank's training loss is finite (a collective in lockstep)."""

    @property
    def stop_requested(self) -> bool: ...

    def queued(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LocalBatching:
    def __init__(self, batch_size: int):
        self.former = BatchFormer(batch_size)
        self.stop_requested = False

    def ready_batches(self, kept: Batch, stop_vote: bool = False, error: str | None = None):
        if error:
            raise NonFiniteLossError(error)
        self.former.add(kept)
        self.stop_requested = stop_vote
        while self.former.full_batches() and not self.stop_requested:
            yield self.former.pop()

    def agree_finite(self, finite: bool) -> bool:
        return finite

    def queued(self) -> int:
        return len(self.former)

    def state_dict(self) -> dict:
        remainder = self.former.drain()
        if remainder is not None:
            self.former.add(remainder)
        return {"remainder": remainder}

    def load_state_dict(self, state: dict) -> None:
        self.former.drain()
        if state["remainder"] is not None:
            self.former.add(state["remainder"])


@dataclass
class RoundPayload:
    """What one rank shares after a selection chunk, packed into one float64 tensor."""

    HEADER = 4

    kept_ids: torch.Tensor
    kept_weights: torch.Tensor
    scored_ids: torch.Tensor
    scored_losses: torch.Tensor
    stop_vote: bool
    error: bool

    def pack(self) -> torch.Tensor:
        # float64 holds integer ids exactly up to 2**53.
        header = torch.tensor(
            [self.kept_ids.numel(), self.scored_ids.numel(), float(self.stop_vote), float(self.error)],
            dtype=torch.float64,
        )
        parts = [self.kept_ids, self.kept_weights, self.scored_ids, self.scored_losses]
        return torch.cat([header, *[p.detach().cpu().double().reshape(-1) for p in parts]])

    @staticmethod
    def unpack(packed: torch.Tensor) -> "RoundPayload":
        kept, scored = int(packed[0]), int(packed[1])
        body = packed[RoundPayload.HEADER :]
        return RoundPayload(
            kept_ids=body[:kept].long(),
            kept_weights=body[kept : 2 * kept].float(),
            scored_ids=body[2 * kept : 2 * kept + scored].long(),
            scored_losses=body[2 * kept + scored : 2 * kept + 2 * scored].float(),
            stop_vote=bool(packed[2]),
            error=bool(packed[3]),
        )


class LockstepBatching:
    def __init__(
        self,
        collective: Collective,
        batch_size: int,
        load_ids: Callable[[torch.Tensor], Batch],
        loss_table: LossTable | None = None,
        chunk_size: int | None = None,
    ):
        """`chunk_size` (examples per round) bounds the payload, saving one collective per round."""
        self.collective = collective
        self.payload_bound = None if chunk_size is None else RoundPayload.HEADER + 4 * chunk_size
        self.batch_size = batch_size
        self.load_ids = load_ids
        self.loss_table = loss_table
        self.queue_ids = torch.empty(0, dtype=torch.int64)
        self.queue_weights = torch.empty(0)
        self.stop_requested = False
        self.rounds = 0
        self.exchange_seconds = 0.0

    def ready_batches(self, kept: Batch, stop_vote: bool, error: str | None) -> Iterator[Batch]:
        scored_ids, scored_losses = (
            self.loss_table.take_unshared() if self.loss_table is not None else (torch.empty(0),) * 2
        )
        mine = RoundPayload(
            kept_ids=kept.sample_ids,
            kept_weights=kept.loss_weights(),
            scored_ids=scored_ids,
            scored_losses=scored_losses,
            stop_vote=stop_vote and self.collective.rank == 0,
            error=error is not None,
        )
        started = time.perf_counter()
        packed = self.collective.all_gather(mine.pack(), self.payload_bound)
        rounds = [RoundPayload.unpack(p) for p in packed]
        self.exchange_seconds += time.perf_counter() - started
        self.rounds += 1
        failed = [rank for rank, p in enumerate(rounds) if p.error]
        if failed:
            detail = error or "see the log of that rank"
            raise NonFiniteLossError(f"rank(s) {failed} stopped the run: {detail}")
        if self.loss_table is not None:
            for payload in rounds:
                self.loss_table.record(payload.scored_ids, payload.scored_losses, share=False)
        self.queue_ids = torch.cat([self.queue_ids, *[p.kept_ids for p in rounds]])
        self.queue_weights = torch.cat([self.queue_weights, *[p.kept_weights for p in rounds]])
        self.stop_requested = rounds[0].stop_vote
        if self.stop_requested:
            return
        world, b, rank = self.collective.world_size, self.batch_size, self.collective.rank
        for _ in range(self.steps_ready()):
            step_ids, self.queue_ids = self.queue_ids[: world * b], self.queue_ids[world * b :]
            step_weights, self.queue_weights = self.queue_weights[: world * b], self.queue_weights[world * b :]
            batch = self.load_ids(step_ids[rank * b : (rank + 1) * b])
            own_weights = step_weights[rank * b : (rank + 1) * b]
            if not bool((own_weights == 1).all()):
                batch.weights = own_weights.to(batch.inputs.device)
            yield batch

    def steps_ready(self) -> int:
        return self.queue_ids.numel() // (self.collective.world_size * self.batch_size)

    def agree_finite(self, finite: bool) -> bool:
        return self.collective.all_true(finite)

    def queued(self) -> int:
        return self.queue_ids.numel()

    def state_dict(self) -> dict:
        return {"queue_ids": self.queue_ids.clone(), "queue_weights": self.queue_weights.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.queue_ids = state["queue_ids"].clone()
        self.queue_weights = state["queue_weights"].clone()
