"""The round's exchange: from each rank's kept examples to the training batches it runs.

Two policies behind one interface (`KeptExchange`): `exchange` shares a round's
outcome (on lockstep ranks, one all-gather), then `next_step` hands out the steps it
made ready, while `step_ready`.

- `LocalQueue`: one process. Kept examples, with the inputs they were scored
  on, queue in a `BatchFormer`; every full batch of b is trained on. Nothing
  crosses a process.

- `LockstepExchange`: N data-parallel ranks whose Bernoulli selection keeps a
  different number of examples on each rank. Every few selection chunks
  ("rounds": `SelectionSpec.rounds_per_exchange`, about a batch kept a rank) the
  ranks all-gather the sample ids they kept and append them, in rank order, to a
  *global queue* of which every rank holds an identical copy.
  While the queue holds N*b ids, the next N*b are popped and rank r trains on
  slice [r*b, (r+1)*b). Because every rank applies the same deterministic rule to
  the same queue, all ranks run the same number of equal-sized steps without
  any further communication, kept examples on a busy rank are trained on by an
  idle one, and nothing is dropped: kept = backpropagated + queue remainder.
  The same all-gather carries Stale-SB's freshly scored losses, so every rank
  knows every example's last loss wherever it is seen next, the stop vote of
  rank 0 (time budget), any rank's error (raysb.core.errors: its kind and
  message) and whether a rank has chunks left this epoch, so that all ranks
  stop, fail, and end each epoch at the same exchange instead of one waiting
  forever in a collective. For strategies that rank losses it also carries the
  bins of the losses each rank ranked since the last exchange, which every rank counts into
  the same loss histogram (raysb.training.selection.merged_histogram): one CDF_R for all.

  In-memory shards let every rank gather any example by id, so only ids
  travel. Streamed shards (raysb.data.shards.StreamShard) hold nothing but their
  current chunk, so the kept examples' columns (`Carried`: for raysb's image
  shards, labels and uint8 images; for a user's own batches, all their
  columns) travel with their ids, and the queue holds the examples themselves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from raysb.core.batch_former import Batch, BatchFormer
from raysb.core.columns import (
    ColumnSchema,
    bytes_per_row,
    empty_columns,
    pack_columns,
    unpack_columns,
)
from raysb.core.errors import AGREED_ERRORS, AgreedError
from raysb.core.transfer import to_device, to_host
from raysb.training.collective import Collective
from raysb.training.selection.merged_histogram import BIN_DTYPE, MergedLossHistogram
from raysb.training.selection.loss_table import RECORD_ROWS, LossTable
from raysb.training.selection.shard_summary import records_by_owner, records_of_rows


@dataclass
class Carried:
    """How kept examples travel when ranks cannot gather them by id (streamed data).

    `columns_of(kept)` gives the columns to send, matching `schema`; `load(ids, columns)`
    turns received ones into a training batch on this rank.
    """

    schema: ColumnSchema
    columns_of: Callable[[Batch], dict[str, torch.Tensor]]
    load: Callable[[torch.Tensor, dict[str, torch.Tensor]], Batch]


@dataclass
class StepVote:
    """What a training step's agreement carries in an epoch decided as it starts, where no round's
    exchange does (raysb.training.selection.rounds): this rank's stop vote and training clock."""

    stop: bool
    clock_s: float


class KeptExchange(Protocol):
    def exchange(
        self, kept: Batch, stop_vote: bool, error: AgreedError | None, last_chunk: bool, clock_s: float = 0.0,
        bounded: bool = True,
    ) -> None:
        """Share this rank's round (kept examples, stop vote, error, whether its chunks ran out,
        its training clock); raises on every rank if any rank reported an error. `bounded`: at most a
        round's examples (not a whole epoch's)."""

    @property
    def leader_clock_s(self) -> float:
        """Rank 0's training clock at the last exchange: what a time-keyed lr reads on every rank."""

    def step_ready(self) -> bool:
        """Whether the queue holds this rank's next batch of b (after the exchange)."""

    def next_step(self) -> Batch:
        """This rank's next batch of b, taken from the queue."""

    # Whether a step's stop vote travels with the step's agreement (lockstep ranks: it stops the
    # epoch after that step) rather than deciding at once (one process: before the step).
    votes_with_steps: bool

    def agree(self, error: AgreedError | None, vote: StepVote | None = None) -> None:
        """Raise on every rank if any rank's training step failed (a collective in lockstep). With
        `vote`, the same collective sets `stop_requested` and `leader_clock_s` from rank 0's."""

    @property
    def stop_requested(self) -> bool: ...

    @property
    def epoch_finished(self) -> bool:
        """Whether the last round ended the epoch (no rank has chunks left)."""

    def queued(self) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LocalQueue:
    def __init__(self, batch_size: int):
        self.former = BatchFormer(batch_size)
        # The next step's batch: the former's own, not a call in between.
        self.next_step = self.former.pop
        self.stop_requested = False
        self.epoch_finished = False
        self.leader_clock_s = 0.0

    def exchange(
        self,
        kept: Batch,
        stop_vote: bool = False,
        error: AgreedError | None = None,
        last_chunk: bool = False,
        clock_s: float = 0.0,
        bounded: bool = True,
    ) -> None:
        if error is not None:
            raise error
        self.former.add(kept)
        self.stop_requested = stop_vote
        self.epoch_finished = last_chunk
        self.leader_clock_s = clock_s

    votes_with_steps = False

    def step_ready(self) -> bool:
        return self.former.queued >= self.former.batch_size

    def take_vote(self, vote: StepVote) -> bool:
        """A step's stop vote and clock, this process's own: whether to stop before the step."""
        self.stop_requested, self.leader_clock_s = vote.stop, vote.clock_s
        return vote.stop

    def agree(self, error: AgreedError | None, vote: StepVote | None = None) -> None:
        if vote is not None:
            self.take_vote(vote)
        if error is not None:
            raise error

    def load_pending(self) -> None:
        self.former.load_pending()

    def drop_pending(self) -> int:
        return self.former.drop_pending()

    def queued(self) -> int:
        return self.former.queued

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
    """What one rank shares after a selection chunk, packed into one byte tensor.

    Numbers travel as float64 (exact for integer ids up to 2**53), followed by
    an error's message (UTF-8, at most MESSAGE_BYTES), the loss-histogram bins
    of the round (int16) and, when the data streams, the kept examples' own
    columns (raysb.core.columns).
    """

    HEADER = 8
    MESSAGE_BYTES = 512

    kept_ids: torch.Tensor
    kept_weights: torch.Tensor
    kept_probabilities: torch.Tensor
    scored_ids: torch.Tensor
    # RECORD_ROWS rows (loss, margin, predicted label), a column a scored id (raysb.training.selection.loss_table).
    scored_records: torch.Tensor
    stop_vote: bool
    last_chunk: bool
    kept_columns: dict[str, torch.Tensor] | None = None
    # The bins of the losses this rank ranked this round (raysb.training.selection.merged_histogram).
    loss_bins: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=BIN_DTYPE))
    # The rank's training clock (seconds); rank 0's keys a time-keyed lr on every rank.
    clock_s: float = 0.0
    # raysb.core.errors: the kind's code (0: none) and what went wrong on this rank.
    error_code: int = 0
    error_message: str = ""

    @staticmethod
    def error_fields(error: AgreedError | None) -> dict:
        return {"error_code": 0 if error is None else error.code, "error_message": "" if error is None else str(error)}

    @staticmethod
    def failure(error: AgreedError | None) -> RoundPayload:
        """A payload of no examples that carries only `error` (or that none happened)."""
        nothing = torch.empty(0)
        return RoundPayload(nothing, nothing, nothing, nothing, torch.empty(RECORD_ROWS, 0), stop_vote=False,
                            last_chunk=False,
                            **RoundPayload.error_fields(error))

    def pack(self, schema: ColumnSchema | None = None) -> torch.Tensor:
        """`schema`: the carried columns' (the same on every rank); None when only ids travel."""
        message = torch.tensor(list(self.error_message.encode()[: self.MESSAGE_BYTES]), dtype=torch.uint8)
        header = torch.tensor(
            [self.kept_ids.numel(), self.scored_ids.numel(), self.stop_vote, self.error_code,
             self.last_chunk, message.numel(), self.clock_s, self.loss_bins.numel()],
            dtype=torch.float64,
        )
        parts = (self.kept_ids, self.kept_weights, self.kept_probabilities, self.scored_ids, self.scored_records)
        device = self.kept_ids.device
        numbers = torch.cat([to_device(part.detach(), device).double().reshape(-1) for part in parts])
        bins = to_device(self.loss_bins.detach(), device).to(BIN_DTYPE).reshape(-1)
        # One device-to-host copy of what the rounds made on the device (kept examples, recorded
        # losses, the losses' bins): the payload is packed on the host (gloo moves CPU tensors).
        copied = to_host(torch.cat([numbers.view(torch.uint8), bins.view(torch.uint8)]))
        packed = [header.view(torch.uint8), copied[: numbers.numel() * 8], message, copied[numbers.numel() * 8 :]]
        if schema is not None:
            packed.append(pack_columns(self.kept_columns, schema))
        return torch.cat(packed)

    @staticmethod
    def unpack(packed: torch.Tensor, schema: ColumnSchema | None = None) -> RoundPayload:
        header = packed[: 8 * RoundPayload.HEADER].clone().view(torch.float64)
        kept, scored, message, bins = int(header[0]), int(header[1]), int(header[5]), int(header[7])
        count = RoundPayload.HEADER + 3 * kept + (1 + RECORD_ROWS) * scored
        body = packed[: 8 * count].clone().view(torch.float64)[RoundPayload.HEADER :]
        sections = body.split([kept, kept, kept, scored, RECORD_ROWS * scored])
        bins_start = 8 * count + message
        columns_start = bins_start + BIN_DTYPE.itemsize * bins
        return RoundPayload(
            kept_ids=sections[0].long(),
            kept_weights=sections[1].float(),
            kept_probabilities=sections[2].float(),
            scored_ids=sections[3].long(),
            scored_records=sections[4].float().reshape(RECORD_ROWS, scored),
            stop_vote=bool(header[2]),
            last_chunk=bool(header[4]),
            clock_s=float(header[6]),
            loss_bins=packed[bins_start:columns_start].clone().view(BIN_DTYPE),
            kept_columns=None if schema is None else unpack_columns(packed[columns_start:], kept, schema),
            error_code=int(header[3]),
            error_message=bytes(packed[8 * count : bins_start].tolist()).decode(errors="replace"),
        )

    @staticmethod
    def byte_bound(chunk_size: int, schema: ColumnSchema | None) -> int:
        """The largest payload of a round of `chunk_size` examples."""
        per_example = (4 + RECORD_ROWS) * 8 + BIN_DTYPE.itemsize + (bytes_per_row(schema) if schema is not None else 0)
        return 8 * RoundPayload.HEADER + RoundPayload.MESSAGE_BYTES + chunk_size * per_example


class KeptQueue:
    """The global queue: every rank's kept examples in round and rank order, the same on every rank.

    Each queued example has an id, a loss weight, the probability it was kept with
    and, when examples travel, its carried columns (kept apart, so any names will do).
    """

    def __init__(self, schema: ColumnSchema | None):
        self.columns = {
            "ids": torch.empty(0, dtype=torch.int64),
            "weights": torch.empty(0),
            "probabilities": torch.empty(0),
        }
        self.carried = empty_columns(schema or {})

    def __len__(self) -> int:
        return self.columns["ids"].numel()

    def extend(self, payload: RoundPayload) -> None:
        new = {"ids": payload.kept_ids, "weights": payload.kept_weights, "probabilities": payload.kept_probabilities}
        self.columns = {name: torch.cat([column, new[name]]) for name, column in self.columns.items()}
        received = payload.kept_columns or {}
        self.carried = {name: torch.cat([column, received[name]]) for name, column in self.carried.items()}

    def pop(self, count: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The first `count` queued examples: (ids, weights and probabilities; carried columns)."""
        head = {name: column[:count] for name, column in self.columns.items()}
        carried = {name: column[:count] for name, column in self.carried.items()}
        self.columns = {name: column[count:] for name, column in self.columns.items()}
        self.carried = {name: column[count:] for name, column in self.carried.items()}
        return head, carried

    def state_dict(self) -> dict:
        return {**{name: column.clone() for name, column in self.columns.items()},
                "carried": {name: column.clone() for name, column in self.carried.items()}}

    def load_state_dict(self, state: dict) -> None:
        own = {name: column for name, column in state.items() if name != "carried"}
        carried = state.get("carried", {})
        if set(own) != set(self.columns) or set(carried) != set(self.carried):
            raise ValueError(
                f"checkpointed lockstep queue holds {sorted(own)} and carried columns {sorted(carried)}, "
                f"expected {sorted(self.columns)} and {sorted(self.carried)}"
            )
        self.columns = {name: column.clone() for name, column in own.items()}
        self.carried = {name: column.clone() for name, column in carried.items()}


class LockstepExchange:
    def __init__(
        self,
        collective: Collective,
        batch_size: int,
        load_ids: Callable[[torch.Tensor], Batch],
        loss_table: LossTable | None = None,
        chunk_size: int | None = None,
        carried: Carried | None = None,
        histogram: MergedLossHistogram | None = None,
    ):
        """`carried` is given when the data streams: kept examples then travel, not just ids.

        `chunk_size` (examples per round) bounds the payload, saving one collective per round.
        `histogram`: the shared CDF_R, merged in every round's exchange.
        """
        self.collective = collective
        self.histogram = histogram
        self.carried = carried
        self.schema = None if carried is None else carried.schema
        self.payload_bound = None if chunk_size is None else RoundPayload.byte_bound(chunk_size, self.schema)
        self.batch_size = batch_size
        self.load_ids = load_ids
        self.loss_table = loss_table
        self.queue = KeptQueue(self.schema)
        self.stop_requested = False
        self.epoch_finished = False
        self.leader_clock_s = 0.0
        self.rounds = 0
        self.exchange_seconds = 0.0
        self.exchanged_bytes = 0

    def exchange(
        self, kept: Batch, stop_vote: bool, error: AgreedError | None, last_chunk: bool, clock_s: float = 0.0,
        bounded: bool = True,
    ) -> None:
        scored_ids, scored_records = (
            self.loss_table.take_unshared() if self.loss_table is not None
            else (torch.empty(0), torch.empty(RECORD_ROWS, 0))
        )
        to_owners = self.loss_table is not None and self.loss_table.sharded
        if to_owners:  # a sharded table's records go to the rank that owns each, not to every rank
            started = time.perf_counter()
            owned = self.collective.all_to_all(records_by_owner(scored_ids, scored_records, self.collective.world_size))
            self.exchange_seconds += time.perf_counter() - started
            self.exchanged_bytes += sum(rows.nbytes for rows in owned)
            scored_ids, scored_records = torch.empty(0), torch.empty(RECORD_ROWS, 0)
        mine = RoundPayload(
            kept_ids=kept.sample_ids,
            kept_weights=kept.loss_weights(),
            kept_probabilities=kept.chosen_with(),
            scored_ids=scored_ids,
            scored_records=scored_records,
            stop_vote=stop_vote and self.collective.rank == 0,
            last_chunk=last_chunk,
            clock_s=clock_s,
            kept_columns=self._columns_to_send(kept, error),
            loss_bins=self.histogram.take_round() if self.histogram is not None else torch.empty(0, dtype=BIN_DTYPE),
            **RoundPayload.error_fields(error),
        )
        started = time.perf_counter()
        packed = self.collective.all_gather(mine.pack(self.schema), self.payload_bound if bounded else None)
        rounds = [RoundPayload.unpack(p, self.schema) for p in packed]
        self.exchange_seconds += time.perf_counter() - started
        self.exchanged_bytes += sum(p.numel() for p in packed)
        self.rounds += 1
        if self.histogram is not None:
            # Before the raise, so every rank's histogram stays the same in a round that fails.
            self.histogram.merge([payload.loss_bins for payload in rounds])
        raise_if_any_failed(rounds, error)
        if to_owners:  # in rank order, as the rounds' records are applied
            self.loss_table.apply(*records_of_rows(torch.cat(owned)))
        elif self.loss_table is not None:
            for payload in rounds:
                self.loss_table.apply(payload.scored_ids, payload.scored_records)
        for payload in rounds:
            self.queue.extend(payload)
        self.stop_requested = rounds[0].stop_vote
        self.leader_clock_s = rounds[0].clock_s
        self.epoch_finished = all(p.last_chunk for p in rounds)

    votes_with_steps = True

    def step_ready(self) -> bool:
        return self.steps_ready() > 0

    def next_step(self) -> Batch:
        world, b, rank = self.collective.world_size, self.batch_size, self.collective.rank
        queued, carried = self.queue.pop(world * b)
        mine = slice(rank * b, (rank + 1) * b)
        step = {name: column[mine] for name, column in queued.items()}
        if self.carried is not None:
            batch = self.carried.load(step["ids"], {name: column[mine] for name, column in carried.items()})
        else:
            batch = self.load_ids(step["ids"])
        # Both tests read CPU tensors (the queue lives on the host): no device sync.
        if not bool((step["weights"] == 1).all()):
            batch.weights = to_device(step["weights"], batch.device)
        if not bool(step["probabilities"].isnan().all()):
            batch.keep_probabilities = to_device(step["probabilities"], batch.device)
        return batch

    def _columns_to_send(self, kept: Batch, error: AgreedError | None) -> dict[str, torch.Tensor] | None:
        if self.carried is None:
            return None
        # A failed round sends no examples: their columns may be what failed.
        return empty_columns(self.schema) if error is not None else self.carried.columns_of(kept)

    def steps_ready(self) -> int:
        return len(self.queue) // (self.collective.world_size * self.batch_size)

    def agree(self, error: AgreedError | None, vote: StepVote | None = None) -> None:
        if vote is None:
            if self.collective.all_true(error is None):
                return
        else:
            leader = self.collective.rank == 0
            ok, running, negative_clock = self.collective.all_min(
                [float(error is None), float(not (leader and vote.stop)), -vote.clock_s if leader else math.inf]
            )
            self.stop_requested, self.leader_clock_s = not running, -negative_clock
            if ok:
                return
        # Every rank is here together, so the failed ranks' messages can travel.
        gathered = self.collective.all_gather(RoundPayload.failure(error).pack())
        raise_if_any_failed([RoundPayload.unpack(p) for p in gathered], error)

    def queued(self) -> int:
        return len(self.queue)

    def costs(self, steps: int) -> dict:
        """What the exchange cost this rank, in all and per optimizer step, for a run's summary or metrics."""
        steps = max(1, steps)
        costs = {
            "lockstep_rounds": self.rounds,
            # Includes waiting for the slowest rank to reach the exchange.
            "lockstep_exchange_seconds": self.exchange_seconds,
            "lockstep_exchange_ms_per_step": 1000 * self.exchange_seconds / steps,
            "lockstep_exchange_kb_per_step": self.exchanged_bytes / 1024 / steps,
        }
        if self.histogram is not None:
            merged = self.histogram.stats()
            costs.update({
                "histogram_window_steps": merged["window_steps"],
                "histogram_merge_seconds": merged["merge_seconds"],
                "histogram_merge_ms_per_step": 1000 * merged["merge_seconds"] / steps,
                # The bins' share of the exchange's bytes.
                "histogram_kb_per_step": merged["bytes_received"] / 1024 / steps,
            })
        return costs

    def state_dict(self) -> dict:
        statistics = {"rounds": self.rounds, "exchange_seconds": self.exchange_seconds,
                      "exchanged_bytes": self.exchanged_bytes}
        return {"queue": self.queue.state_dict(), "statistics": statistics}

    def load_state_dict(self, state: dict) -> None:
        self.queue.load_state_dict(state["queue"])
        statistics = state["statistics"]
        self.rounds, self.exchange_seconds = statistics["rounds"], statistics["exchange_seconds"]
        self.exchanged_bytes = statistics["exchanged_bytes"]


def raise_if_any_failed(rounds: list[RoundPayload], own: AgreedError | None) -> None:
    """Raise, on every rank alike, the error of the first rank that reported one.

    The rank that failed re-raises its own exception, with its traceback.
    """
    failed = [rank for rank, payload in enumerate(rounds) if payload.error_code]
    if not failed:
        return
    if own is not None:
        raise own
    first = rounds[failed[0]]
    raise AGREED_ERRORS[first.error_code](f"rank {failed[0]} stopped the run: {first.error_message}")
