"""An epoch on one rank: the paper's method, decided a chunk at a time or the whole epoch at once.

`SelectionRounds` is what both of raysb's front doors run: `raysb.SelectiveBackprop`
(a user's own loop and batches) and raysb's image trainer (raysb.training.engine),
each plugging in its chunks, how to load and score them, and its clock. `epoch` is the one
driver; where the kept examples come from is the value it is handed, a round a chunk or the
whole epoch decided as it starts (raysb.training.selection.sources).

Then, the same whatever the source: the exchange queues the kept examples (across lockstep ranks,
one all-gather: raysb.training.selection.exchange), every full batch of b is yielded and the
caller trains on it (`loss` or `whole_step`) before asking for the next. Each step is agreed, its
loss noted for the next read (raysb.training.selection.loss_reads) and counted
(raysb.training.selection.counts); progress (what an epoch-keyed lr reads) and the stop votes are
kept here.

Every rank takes part in every exchange, at the same rounds whatever it kept or hit, so
ranks end epochs, stop and fail at the same exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from raysb.core.batch_former import Batch
from raysb.core.errors import AgreedError
from raysb.core.label_doubt import ClassLogits
from raysb.core.spec import SelectionSpec
from raysb.training.collective import Collective
from raysb.training.selection.counts import Counters, EpochCounts
from raysb.training.selection.exchange import Carried, KeptExchange, LocalQueue, LockstepExchange, StepVote
from raysb.training.selection.loss_reads import LossFunction, LossReads, batch_loss, called, check_per_example
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies import ChunkContext, Strategy
from raysb.training.timing import PhaseTimer


@dataclass
class Share:
    """What this rank puts into one exchange, and how far the steps it makes ready reach."""

    kept: Batch | PendingRows
    # This epoch's examples (this rank's) whose decisions it carries.
    considered: int
    # How far the steps after it reach, in the epoch's examples (every rank's): those of the chunks
    # decided so far. An epoch decided as it starts counts them step by step instead (`plan`).
    reached: int = 0
    plan: PlanProgress | None = None
    stop_vote: bool = False
    error: AgreedError | None = None
    # Whether this rank's chunks ran out with it (every rank's: the epoch ends).
    last: bool = True
    # The clock it carries (None: the rank's clock as it exchanges).
    clock_s: float | None = None
    # At most a round's examples (not a whole epoch's): bounds the exchange's payload.
    bounded: bool = True
    # Its steps vote on stopping, one by one: an epoch decided as it starts has no rounds to vote at.
    votes_each_step: bool = False


class PlanProgress:
    """How far the steps of an epoch decided as it starts reach. Alone, as its rounds would count
    it: every example considered through the chunk round (of `unit` examples) that would have
    decided the last kept example a step trained (`positions`: the kept examples' places in the
    epoch's order). Lockstep ranks queue the epoch's kept examples rank by rank, not round by
    round: there a step reaches the share of the kept examples it trained, in whole rounds."""

    def __init__(self, queued_before: int, unit: int, positions: torch.Tensor | None):
        self.queued_before, self.unit = queued_before, unit
        # Read at every step: on the host once, not one tensor read a step.
        self.positions = None if positions is None else positions.tolist()
        self.kept = self.popped = 0

    def exchanged(self, queued: int) -> None:
        """The queue after the epoch's exchange: the queued before it, then its kept examples (every rank's)."""
        self.kept = queued - self.queued_before

    def trained_share(self) -> float:
        """The share of the epoch's kept examples its steps have trained (the earlier epochs' first)."""
        if not self.kept:
            return 0.0 if not self.popped else 1.0
        return min(1.0, max(0, self.popped - self.queued_before) / self.kept)

    def reached(self, examples: int) -> int:
        if not self.kept:
            return examples  # nothing to train: over as it starts
        if not self.popped:
            return 0
        taken = max(0, self.popped - self.queued_before)  # the queued examples of earlier epochs go first
        if self.positions is None:
            considered = -(-taken * examples // self.kept)
        else:
            considered = max(1, self.positions[taken - 1] + 1 if taken else 1)
        return -(-considered // self.unit) * self.unit


class RoundObserver:
    """What a trainer is told of, and asked at, each round; this base is told nothing and never stops."""

    def chosen(self, chunk, kept_ids: torch.Tensor) -> None:
        """This rank chose the examples `kept_ids` from `chunk` (before the exchange)."""

    def should_stop(self, epoch: int, round_index: int) -> bool:
        """Asked on every rank each round; rank 0's True ends the epoch at the next exchange on every rank."""
        return False


class EpochSource(Protocol):
    """Where an epoch's kept examples come from (raysb.training.selection.sources)."""

    def shares(self, rounds: SelectionRounds, epoch: int, context: ChunkContext, select: bool,
               observer: RoundObserver) -> Iterator[Share]: ...


class SelectionRounds:
    def __init__(
        self,
        spec: SelectionSpec,
        strategy: Strategy,
        loss_fn: LossFunction,
        collective: Collective,
        timer: PhaseTimer,
        *,
        load_ids: Callable[[torch.Tensor], Batch] | None = None,
        carried: Carried | None = None,
        loss_read_every: int = 1,
    ):
        """With `spec.lockstep`, ranks exchange every `spec.rounds_per_exchange` rounds over
        `collective` (else one process queues alone). A lockstep exchange needs `load_ids` (ranks
        gather examples by id) or `carried` (examples travel); without either it is set up later
        with `use_lockstep`, once the columns are known.
        `loss_read_every`: training losses are read to the host (summed, and checked finite on every
        rank) every this many steps and at an epoch's end; 1 checks each before its backward."""
        self.reads = LossReads(loss_read_every)
        self.spec = spec
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.collective = collective
        self.timer = timer
        self.batch_size = spec.batch_size
        self.chunk_size = spec.chunk_size
        # Where the staleness correction weighs each step (raysb.core.keep_rule.staleness_weights), the keep
        # rule it asks what selection would keep now.
        self.staleness_selector = strategy.selector if spec.correct_staleness else None
        # SB's round whole as one CUDA graph where it can be (raysb.training.selection.round_graph), set by
        # the image trainer: a chunk it takes is not loaded, scored and decided here.
        self.round_graph = None
        self.rounds_per_exchange = spec.rounds_per_exchange
        self.counts = EpochCounts()
        self.counters: Counters = self.counts.run
        # Set by a trainer whose lr is keyed to a budget (seconds, or work): each exchange then
        # carries rank 0's reading of it, so every rank steps with the same lr.
        self.clock: Callable[[], float] | None = None
        self.exchange: KeptExchange | None = None
        if not spec.lockstep:
            self.exchange = LocalQueue(spec.batch_size)
        elif load_ids is not None or carried is not None:
            self.use_lockstep(load_ids, carried)
        self.epochs_started = 0
        self.stop_requested = False
        self._in_epoch = False
        # The running (or last) epoch's chunk round; -1 before its first.
        self.round_index = -1
        # How far the running epoch's steps reach (`epoch_share`): the examples of the chunks decided so
        # far, or an epoch decided as it starts, its plan; and whether it is over.
        self._reached = 0
        self._plan: PlanProgress | None = None
        self._epoch_over = False
        # What the next training step's agreement carries in an epoch decided as it starts.
        self._step_vote: StepVote | None = None

    def use_lockstep(self, load_ids=None, carried: Carried | None = None) -> None:
        history = getattr(self.strategy.selector, "history", None)
        self.exchange = LockstepExchange(
            self.collective, self.batch_size, load_ids, self.strategy.loss_table(),
            self.chunk_size * self.rounds_per_exchange, carried,
            histogram=history if isinstance(history, MergedLossHistogram) else None,
        )

    # -- an epoch: the one driver ---------------------------------------------------------
    def epoch(
        self,
        epoch: int,
        source: EpochSource,
        context: ChunkContext,
        *,
        select: bool = True,
        observer: RoundObserver | None = None,
    ) -> Iterator[Batch]:
        """`epoch`, yielding the batches of b to train on: every rank's way through an epoch.

        `source` says where this rank's kept examples come from: `ChunkRounds`, a round a chunk and
        an exchange every `rounds_per_exchange` rounds, or `WholeEpoch`, the epoch decided as it
        starts (raysb.training.selection.sources). Each exchange shares what the rank kept (with its
        stop vote, error and clock) and makes steps ready; here they are counted, voted on and
        yielded, and the epoch's progress (what its lr reads, `epoch_share`) follows the examples
        they reach. `select=False` trains on every example (plain-SGD epochs: `selects` said no)."""
        observer = observer or RoundObserver()
        self._start_epoch(epoch)
        exchange, counts, world = self.exchange, self.counts, self.collective.world_size
        try:
            for share in source.shares(self, epoch, context, select, observer):
                counts.considered += share.considered
                counts.kept += len(share.kept)
                with self.timer.phase("bookkeeping"):
                    clock_s = share.clock_s
                    if clock_s is None:  # read only for a budget-keyed lr (the host's clock: no wait for the device)
                        clock_s = self.clock() if self.clock is not None else 0.0
                    exchange.exchange(share.kept, share.stop_vote, share.error, last_chunk=share.last,
                                      clock_s=clock_s, bounded=share.bounded)
                self._reached, plan = share.reached, share.plan
                self._plan = plan
                if plan is not None:
                    plan.exchanged(exchange.queued())
                # Every step the exchange made ready. Where `share.votes_each_step` (an epoch decided as it
                # starts, which has no rounds to vote at), each step first asks for rank 0's stop vote,
                # `should_stop(epoch, n)`, n the steps the epoch will have run where it stops (0 was asked as
                # it started): alone the vote stops the epoch before the step; in lockstep it travels with
                # the step's agreement and stops the epoch after it.
                while not exchange.stop_requested and exchange.step_ready():
                    if share.votes_each_step:
                        taken = counts.steps + int(exchange.votes_with_steps)
                        vote = StepVote(taken > 0 and bool(observer.should_stop(epoch, taken)),
                                        self.clock() if self.clock is not None else 0.0)
                        if exchange.votes_with_steps:
                            self._step_vote = vote
                        elif exchange.take_vote(vote):
                            break
                    with self.timer.phase("bookkeeping"):
                        batch = exchange.next_step()
                    if plan is not None:
                        plan.popped += len(batch) * world  # the examples the steps took off the queue, every rank's
                    yield batch
                # The source ends the epoch where this says so (after its last exchange, if it has one).
                self.stop_requested = self.stop_requested or exchange.stop_requested
            self._epoch_over = not self.stop_requested
            self.reads.read(self.strategy, exchange, self.epochs_started, counts.steps)
        finally:
            self._step_vote = None
            self._in_epoch = False
            self.reads.clear()
        counts.close_epoch()

    def plans(self, epoch: int, sample_ids: torch.Tensor) -> bool:
        """Whether `epoch`, over this rank's `sample_ids` in its order, is decided whole as it starts
        (`Strategy.decides_epoch`), agreed by every lockstep rank: one that cannot (an example on its
        shard never scored) sends them all to the rounds."""
        own = self.strategy.decides_epoch(epoch, sample_ids)
        return self.collective.all_true(own) if self.spec.lockstep else own

    def _start_epoch(self, epoch: int) -> None:
        self._in_epoch = True
        self.epochs_started = epoch + 1
        self.round_index = -1
        self._reached, self._plan = 0, None
        self._epoch_over = False
        self.stop_requested = False
        self.counts.new_epoch()
        self.reads.new_epoch()

    # -- a training step ----------------------------------------------------------------
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The loss to backpropagate for `batch`. A loss function's failure is agreed on every rank
        before it returns; its value is read and agreed finite then, or with the next
        `loss_read_every` steps' (raysb.training.engine reads a GPU's every 16)."""
        # Reading every module's flag is cheaper than train()'s walk that sets them; a wrapper's
        # own flag (DDP, torch.compile) says nothing of the module inside, which scoring sets to eval.
        for module in model.modules():
            if not module.training:
                model.train()
                break
        failure: AgreedError | None = None
        logits: ClassLogits | None = None
        with self.timer.phase("train_forward"):
            try:
                losses, logits = called(self.loss_fn, model, batch, "training")
                check_per_example(losses, len(batch), "training")
                loss = batch_loss(losses, batch, self.staleness_selector)
            except AgreedError as error:
                failure = error
            # Agreed before backward: a rank that skipped it would leave the others
            # waiting in DDP's gradient all-reduce.
            vote, self._step_vote = self._step_vote, None
            self.exchange.agree(failure, vote)
            # Read with the next `loss_read_every` steps' (this is step counts.steps + 1).
            self.reads.unread.append(loss.detach())
            if len(self.reads.unread) >= self.reads.every:
                self.reads.read(self.strategy, self.exchange, self.epochs_started, self.counts.steps + 1)
        self.strategy.observe_training_losses(batch, losses.detach(), logits)
        self.counts.step(len(batch))
        return loss

    def whole_step(self, batch: Batch,
                   step: Callable[[Batch], tuple[torch.Tensor, torch.Tensor, ClassLogits]]) -> None:
        """A training step that `step(batch)` runs whole, forward, backward and update (a captured CUDA
        graph), returning the per-example losses, the loss and the logits: agreed and counted as
        `loss`'s are."""
        vote, self._step_vote = self._step_vote, None
        self.exchange.agree(None, vote)
        with self.timer.phase("train_step"):
            losses, loss, logits = step(batch)
            self.reads.unread.append(loss)
            if len(self.reads.unread) >= self.reads.every:
                self.reads.read(self.strategy, self.exchange, self.epochs_started, self.counts.steps + 1)
        self.strategy.observe_training_losses(batch, losses, logits)
        self.counts.step(len(batch))

    # -- progress and state ---------------------------------------------------------------
    def progress_counts(self) -> dict[str, float]:
        """Cumulative counters plus this epoch's, all additive so ranks can sum them."""
        share = 1.0 if self._plan is None else self._plan.trained_share()
        return self.counts.progress_counts(share, self.reads.loss_sum + self.reads.unread_sum())

    def epoch_share(self, examples: int, epoch: int) -> float:
        """The share of `epoch`, of `examples` (every rank's), that the steps so far reach: the same on
        every lockstep rank; 0 before its first exchange; 1 once it is over (its metrics row reports the
        lr at its end). A step reaches every example of the chunks decided so far, in whole rounds; an
        epoch decided as it starts counts them by the round that would have decided each (`PlanProgress`)."""
        if epoch != self.epochs_started - 1:
            return 0.0
        if self._epoch_over:
            return 1.0
        return min(1.0, (self._reached if self._plan is None else self._plan.reached(examples)) / examples)

    @property
    def epoch_rounds(self) -> int:
        """The chunk rounds the running (or last) epoch ran: none where it was decided as it started."""
        return self.round_index + 1

    def queued(self) -> int:
        """Kept examples waiting for a full batch (the same on every lockstep rank)."""
        return self.exchange.queued() if self.exchange is not None else 0

    def state_dict(self) -> dict:
        """This rank's selection state, at an epoch boundary."""
        if self._in_epoch:
            raise RuntimeError("the selection state is taken between epochs, not while one is running")
        return {
            "rank": self.collective.rank,
            "world_size": self.collective.world_size,
            "strategy": self.strategy.state_dict(),
            "exchange": self.exchange.state_dict() if self.exchange is not None else None,
            "counters": asdict(self.counters),
            "timer": self.timer.state_dict(),
            "epochs_started": self.epochs_started,
            # Rank 0's budget clock at the last exchange: what a resumed epoch's start decides by.
            "leader_clock": self.exchange.leader_clock_s if self.exchange is not None else 0.0,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s state; a lockstep exchange must be set up first."""
        here = (self.collective.rank, self.collective.world_size)
        if (state["rank"], state["world_size"]) != here:
            raise ValueError(
                f"this selection state was saved by rank {state['rank']} of {state['world_size']}; "
                f"this is rank {here[0]} of {here[1]}: resume with the same number of workers, each from its own state"
            )
        self.strategy.load_state_dict(state["strategy"])
        if state["exchange"] is not None:
            self.exchange.load_state_dict(state["exchange"])
        # In place: the parts that read the counts (a trainer's chunk feed, its schedule) hold this object.
        vars(self.counters).update(vars(Counters(**state["counters"])))
        self.timer.load_state_dict(state["timer"])
        self.epochs_started = int(state["epochs_started"])
        if self.exchange is not None:
            self.exchange.leader_clock_s = float(state.get("leader_clock", 0.0))  # absent before work budgets
