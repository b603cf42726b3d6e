"""The rounds of an epoch on one rank: the paper's method, one selection chunk at a time.

`SelectionRounds` is what both of raysb's front doors run: `raysb.SelectiveBackprop`
(a user's own loop and batches) and raysb's image trainer (raysb.training.engine),
each plugging in its chunks, how to load and score them, and its clock. One round:

1. score and decide: the strategy loads the chunk, scores what it needs (a forward
   without autograd; the round checks the losses finite, its one host sync for that)
   and keeps each example with probability CDF_R(loss) ** beta (raysb.core.selection);
2. exchange: the kept examples join the queue of examples to train on; across
   lockstep ranks, with one all-gather (raysb.training.selection.exchange) every
   `SelectionSpec.rounds_per_exchange` rounds, when each rank holds about a batch;
3. train steps: every full batch of b the queue now holds is yielded; the caller
   trains on it (`loss`, backward, optimizer step) before asking for the next.

Every rank takes part in every exchange, at the same rounds whatever it kept or hit, so
ranks end epochs, stop and fail at the same exchange.

Where a strategy needs no forward of its own to decide (`Strategy.plans_epoch`: `uniform`,
free-sb, InfoBatch, Stale-SB between its passes), `planned_epoch` runs an epoch without rounds:
its decisions are made whole as it starts, and it is a plain loop over the kept examples in full
batches of b. Lockstep ranks exchange twice as it starts (the recorded losses the decisions rank
against, then the kept ids, which fix every rank's steps); each step's agreement carries rank 0's
stop vote and clock.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from raysb.core.batch_former import Batch
from raysb.core.errors import AgreedError, BadBatchError, NonFiniteLossError
from raysb.core.keep_rule import staleness_weights
from raysb.core.transfer import to_host
from raysb.core.spec import SelectionSpec
from raysb.training.collective import Collective
from raysb.core.transfer import to_device
from raysb.training.selection.exchange import Carried, KeptExchange, LocalQueue, LockstepExchange, StepVote
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies import ChunkContext, EpochPlan, Strategy
from raysb.training.timing import PhaseTimer

LossFunction = Callable[[torch.nn.Module, Batch], torch.Tensor]


@dataclass
class Counters:
    """Cumulative example and step counts of a run (this rank's)."""

    selection_forward_examples: int = 0
    train_forward_examples: int = 0
    backprop_examples: int = 0
    optimizer_steps: int = 0
    examples_considered: int = 0
    examples_kept: int = 0


COUNTER_NAMES = tuple(Counters.__dataclass_fields__)


def kept_fraction(kept: float, considered: float) -> float:
    return kept / considered if considered else 0.0


def metrics_row(totals: dict[str, float], split: dict[str, float], lr: float | None = None) -> dict:
    """The training columns of one metrics row, from `SelectionRounds.progress_counts` (one rank's,
    or summed over ranks) and a `PhaseTimer.breakdown`: this epoch's loss, kept fraction and
    steps, the run's cumulative counts, the learning rate where one is known, seconds per phase."""
    steps = totals["epoch_steps"]
    row = {
        "train_loss": totals["epoch_loss_sum"] / steps if steps else float("nan"),
        **{name: int(totals[name]) for name in COUNTER_NAMES},
        "kept_fraction": kept_fraction(totals["epoch_kept"], totals["epoch_considered"]),
        "epoch_steps": int(steps),
    }
    if lr is not None:
        row["lr"] = lr
    row.update({f"time_{phase}_s": seconds for phase, seconds in split.items()})
    return row


class RoundObserver:
    """What a trainer is told of, and asked at, each round; this base is told nothing and never stops."""

    def chosen(self, chunk, kept: Batch) -> None:
        """This rank chose `kept` from `chunk` (before the exchange)."""

    def should_stop(self, epoch: int, round_index: int) -> bool:
        """Asked on every rank each round; rank 0's True ends the epoch at the next exchange on every rank."""
        return False


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
        if loss_read_every < 1:
            raise ValueError(f"loss_read_every must be >= 1, got {loss_read_every}")
        self.loss_read_every = loss_read_every
        self._unread_losses: list[torch.Tensor] = []
        self.spec = spec
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.collective = collective
        self.timer = timer
        self.batch_size = spec.batch_size
        self.chunk_size = spec.chunk_size
        self.correct_staleness = spec.correct_staleness and strategy.selector is not None
        self.rounds_per_exchange = spec.rounds_per_exchange
        self._window = _ExchangeWindow()
        self.counters = Counters()
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
        # Each round's selection losses' sum since the last read, on their device (see `score`).
        self._selection_sums: list[tuple[int, int, torch.Tensor]] = []
        # The running (or last) epoch's round; -1 before its first (see `epoch_share`).
        self._round_index = -1
        # A planned epoch's [kept examples its steps so far reach, kept examples] (every rank's; see
        # `epoch_share`); None in an epoch of rounds.
        self._plan_reached: list[int] | None = None
        # What the next training step's agreement carries in a planned epoch.
        self._step_vote: StepVote | None = None
        self._new_epoch_counts()

    def use_lockstep(self, load_ids=None, carried: Carried | None = None) -> None:
        history = getattr(self.strategy.selector, "history", None)
        self.exchange = LockstepExchange(
            self.collective, self.batch_size, load_ids, self.strategy.loss_table(),
            self.chunk_size * self.rounds_per_exchange, carried,
            histogram=history if isinstance(history, MergedLossHistogram) else None,
        )

    # -- the rounds of an epoch ---------------------------------------------------------
    def epoch(
        self,
        epoch: int,
        upcoming: ChunkLookahead,
        context: ChunkContext,
        *,
        select: bool = True,
        observer: RoundObserver | None = None,
    ) -> Iterator[Batch]:
        """Every round of `epoch`, one per chunk of `upcoming`, yielding the batches to train on.

        A rank whose chunks run out before the others' joins the remaining rounds with
        nothing kept; each exchange says whether a rank has more, so the epoch ends at the
        same exchange everywhere. `select=False` trains on every example (plain-SGD epochs).
        """
        observer = observer or RoundObserver()
        self._start_epoch(epoch)
        scores = _CheckedScores(self, context)
        try:
            for round_index in itertools.count():
                exchanged = yield from self.round(epoch, round_index, upcoming, scores, select, observer)
                if exchanged and (self.exchange.stop_requested or self.exchange.epoch_finished):
                    self.stop_requested = self.exchange.stop_requested
                    break
            self._read_losses()
        finally:
            self._close_epoch()
        self._count_epoch()

    def plans(self, epoch: int, sample_ids: torch.Tensor) -> bool:
        """Whether `epoch`, over this rank's `sample_ids` in its order, is decided whole as it starts
        (`Strategy.plans_epoch`), agreed by every lockstep rank: one that cannot (an example on its
        shard never scored) sends them all to the rounds."""
        own = self.strategy.plans_epoch(epoch, sample_ids)
        return self.collective.all_true(own) if self.spec.lockstep else own

    def planned_epoch(
        self, epoch: int, order, context: ChunkContext, *, select: bool = True, observer: RoundObserver | None = None
    ) -> Iterator[Batch]:
        """`epoch` decided whole as it starts (`Strategy.plan_epoch`, where `plans` said so), then
        trained as a plain loop over its kept examples in full batches of b, yielding each.

        `order`: this rank's examples in the epoch's order, as a chunk `context` loads slices of.
        The examples queued from the last epoch go first, and those short of a full batch at the end
        wait for the next, as in the rounds: kept = backpropagated + queued. Rank 0's stop vote is
        asked before each step (as its round's is in an epoch of rounds). `select=False` trains on
        every example (plain-SGD epochs), as `epoch`'s does."""
        observer = observer or RoundObserver()
        self._start_epoch(epoch)
        self._plan_reached = [0, 0]
        try:
            sample_ids = context.sample_ids(order)
            if self.spec.lockstep:
                yield from self._planned_in_lockstep(epoch, order, sample_ids, select, observer)
            else:
                yield from self._planned_alone(epoch, order, sample_ids, select, context, observer)
            self._read_losses()
        finally:
            self._step_vote = None
            self._close_epoch()
        self._count_epoch()

    def _decided(self, epoch: int, order, sample_ids: torch.Tensor, select: bool, observer: RoundObserver) -> EpochPlan:
        with self.timer.phase("bookkeeping"):
            plan = self.strategy.plan_epoch(epoch, sample_ids) if select else EpochPlan(torch.arange(len(sample_ids)))
            observer.chosen(order, Batch(sample_ids[plan.kept]))
        self._epoch_considered, self._epoch_kept = len(sample_ids), len(plan.kept)
        return plan

    def _planned_alone(
        self, epoch: int, order, sample_ids: torch.Tensor, select: bool, context: ChunkContext, observer: RoundObserver
    ) -> Iterator[Batch]:
        self._read_clock()
        if observer.should_stop(epoch, 0):
            self.stop_requested = True
            return
        plan = self._decided(epoch, order, sample_ids, select, observer)
        kept = order[plan.kept.to(order.device)]
        former, b = self.exchange.former, self.batch_size

        def loaded(start: int, stop: int) -> Batch:
            batch = context.load(kept[start:stop])
            if plan.weights is not None:
                batch.weights = to_device(plan.weights[start:stop], batch.device)
            return batch

        self._plan_reached[1] = len(kept)
        taken = 0  # kept examples loaded so far
        for step in range((len(former) + len(kept)) // b):
            # Before the vote: a budget's stop is read at the clock that reached it (its lr is the end's).
            self._read_clock()
            if step and observer.should_stop(epoch, step):
                self.stop_requested = True
                # Kept but never reached: neither trained nor queued, so not counted as kept either.
                self._epoch_kept = taken
                self._epoch_considered = int(plan.kept[taken]) if taken < len(plan.kept) else len(sample_ids)
                return
            if len(former):
                needed = max(0, b - len(former))  # a stopped epoch may have left more than a batch
                if needed:
                    former.add(loaded(taken, taken + needed))
                batch, taken = former.pop(), taken + needed
            else:
                batch, taken = loaded(taken, taken + b), taken + b
            self._plan_reached[0] = taken
            yield batch
        if taken < len(kept):
            former.add(loaded(taken, len(kept)))
        self._plan_reached[0] = len(kept)  # over: every example considered

    def _planned_in_lockstep(
        self, epoch: int, order, sample_ids: torch.Tensor, select: bool, observer: RoundObserver
    ) -> Iterator[Batch]:
        exchange = self.exchange
        nothing = Batch(torch.empty(0, dtype=torch.int64))
        with self.timer.phase("bookkeeping"):
            # The last epoch's recorded losses first, so every rank decides against the same table.
            exchange.exchange(nothing, bool(observer.should_stop(epoch, 0)), None, last_chunk=True,
                              clock_s=self._clock_s(), bounded=False)
        if exchange.stop_requested:
            self.stop_requested = True
            return
        table = self.strategy.loss_table()
        if table is not None and table.sharded:
            with self.timer.phase("bookkeeping"):
                # Each rank decides the examples it owns, against the whole set's scores.
                table.share_summary(self.collective)
        kept, error = nothing, None
        try:
            plan = self._decided(epoch, order, sample_ids, select, observer)
            kept = Batch(sample_ids[plan.kept], weights=plan.weights)
        except AgreedError as failure:
            error = failure
        queued_before = exchange.queued()
        with self.timer.phase("bookkeeping"):
            # Every rank's kept ids, in rank order: the epoch's steps, the same on every rank.
            exchange.exchange(kept, False, error, last_chunk=True, clock_s=self._clock_s(), bounded=False)
        self._plan_reached[1] = exchange.queued() - queued_before
        batches = exchange.training_batches()
        for step in itertools.count(1):
            with self.timer.phase("bookkeeping"):
                batch = next(batches, None)
            if batch is None:
                self._plan_reached[0] = self._plan_reached[1]  # over: every example considered
                break
            # This epoch's kept examples (every rank's) that the steps so far reach, after the queued ones.
            self._plan_reached[0] = max(0, step * self.collective.world_size * self.batch_size - queued_before)
            self._step_vote = StepVote(bool(observer.should_stop(epoch, step)), self._clock_s())
            yield batch
            if exchange.stop_requested:
                self.stop_requested = True
                break
        with self.timer.phase("bookkeeping"):
            # The epoch's recorded losses, on every rank before the next epoch's first exchange, whose
            # round-sized bound a whole epoch's would exceed. Its stop vote is what the steps agreed.
            exchange.exchange(nothing, self.stop_requested, None, last_chunk=True, clock_s=exchange.leader_clock_s,
                              bounded=False)

    def _read_clock(self) -> None:
        """One process: its own clock is the leader's (a lockstep exchange or vote carries rank 0's)."""
        if self.clock is not None:
            self.exchange.leader_clock_s = self.clock()

    def _clock_s(self) -> float:
        # Read only for a budget-keyed lr (time by the host's clock: no wait for the device).
        return self.clock() if self.clock is not None else 0.0

    def _start_epoch(self, epoch: int) -> None:
        self._in_epoch = True
        self.epochs_started = epoch + 1
        self._round_index = -1
        self._plan_reached = None
        self.stop_requested = False
        self._new_epoch_counts()

    def _close_epoch(self) -> None:
        """Whether it ended or failed: nothing of it is left to read."""
        self._in_epoch = False
        self._unread_losses.clear()
        self._selection_sums = []
        self._window = _ExchangeWindow()

    def _count_epoch(self) -> None:
        self.counters.examples_considered += self._epoch_considered
        self.counters.examples_kept += self._epoch_kept

    def round(
        self,
        epoch: int,
        round_index: int,
        upcoming: ChunkLookahead,
        context: ChunkContext,
        select: bool,
        observer: RoundObserver,
    ) -> Iterator[Batch]:
        """One round: score and decide; at every `rounds_per_exchange`-th round of the epoch, the
        exchange, then the training batches it made ready. Returns whether it exchanged."""
        self._round_index = round_index
        chunk = upcoming.next()
        window = self._window
        kept = Batch(torch.empty(0, dtype=torch.int64))
        with self.timer.phase("bookkeeping"):
            # A rank that failed earlier in the window keeps nothing more until the exchange reports it.
            if window.error is None:
                try:
                    # Score and decide: the strategy loads the chunk and scores it where it needs to.
                    kept = self.strategy.kept_batch(epoch, chunk, context) if select else context.load(chunk)
                except AgreedError as failure:
                    window.error = failure
                else:
                    observer.chosen(chunk, kept)
        self._epoch_considered += len(chunk)
        self._epoch_kept += len(kept)
        window.add(kept, bool(observer.should_stop(epoch, round_index)))
        # The same rounds on every rank, whatever each kept: no rank waits alone in the all-gather.
        if (round_index + 1) % self.rounds_per_exchange:
            return False
        with self.timer.phase("bookkeeping"):
            self._window = _ExchangeWindow()
            self.exchange.exchange(window.kept(), window.stop_vote, window.error, last_chunk=upcoming.exhausted,
                                   clock_s=self._clock_s())
        batches = self.exchange.training_batches()
        while True:
            with self.timer.phase("bookkeeping"):
                batch = next(batches, None)
            if batch is None:
                return True
            yield batch

    def score(self, context: ChunkContext, batch: Batch) -> torch.Tensor:
        """Selection losses of `batch` from `context`, counted and timed, and checked finite on the
        device: the check is read with the training losses (`_read_losses`), so no round waits for
        it. Until then a NaN only skews a few rounds' choices, and the run stops at the read."""
        with self.timer.phase("selection"):
            losses = context.score(batch)
            check_per_example(losses, len(batch), "selection")
            self.counters.selection_forward_examples += len(batch)
            # One op a round: a NaN or infinity makes the float64 sum non-finite (float32 losses cannot
            # overflow it). Read with the training losses; `_read_losses` names the first bad round.
            self._selection_sums.append((self._round_index, self._step_in_epoch, losses.sum(dtype=torch.float64)))
            return losses.float()

    # -- a training step ----------------------------------------------------------------
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The loss to backpropagate for `batch`. A loss function's failure is agreed on every rank
        before it returns; its value is read and agreed finite then, or with the next
        `loss_read_every` steps' (raysb.training.engine reads a GPU's every 16)."""
        # Reading every module's flag is cheaper than train()'s walk that sets them; a wrapper's
        # own flag (DDP, torch.compile) says nothing of the module inside, which scoring sets to eval.
        if not all(module.training for module in model.modules()):
            model.train()
        failure: AgreedError | None = None
        with self.timer.phase("train_forward"):
            try:
                losses = called(self.loss_fn, model, batch, "training")
                check_per_example(losses, len(batch), "training")
                loss = self.batch_loss(losses, batch)
            except AgreedError as error:
                failure = error
            # Agreed before backward: a rank that skipped it would leave the others
            # waiting in DDP's gradient all-reduce.
            self._agree_step(failure)
            self._note_loss(loss.detach())
        self._count_step(batch, losses.detach())
        return loss

    def whole_step(self, batch: Batch, step: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A training step that `step(batch)` runs whole, forward, backward and update (a captured CUDA
        graph), returning the per-example losses and the loss: agreed and counted as `loss`'s are."""
        self._agree_step(None)
        with self.timer.phase("train_step"):
            losses, loss = step(batch)
            self._note_loss(loss)
        self._count_step(batch, losses)

    def _agree_step(self, failure: AgreedError | None) -> None:
        vote, self._step_vote = self._step_vote, None
        self.exchange.agree(failure, vote)

    def _note_loss(self, loss: torch.Tensor) -> None:
        if not self._unread_losses:
            self._first_unread_step = self._step_in_epoch + 1
        self._unread_losses.append(loss)
        if len(self._unread_losses) >= self.loss_read_every:
            self._read_losses()

    def _count_step(self, batch: Batch, losses: torch.Tensor) -> None:
        self.strategy.observe_training_losses(batch, losses)
        self.counters.train_forward_examples += len(batch)
        self.counters.backprop_examples += len(batch)
        self.counters.optimizer_steps += 1
        self._step_in_epoch += 1
        self._epoch_steps += 1

    def _read_losses(self) -> None:
        """The unread steps' training losses and the selection losses' finiteness in one host read
        (on a GPU, the wait for their forwards): the training losses summed for the epoch, and both
        agreed finite on every rank. Every rank reads at the same steps."""
        losses = torch.stack(self._unread_losses).double() if self._unread_losses else None
        scored = self._selection_sums
        self._unread_losses.clear()
        self._selection_sums = []
        parts = ([losses.sum().view(1)] if losses is not None else []) + [total for _, _, total in scored]
        if not parts:
            self.strategy.after_loss_read()
            return
        # The one read: the training losses' sum, then each round's selection losses' sum.
        read = to_host(torch.cat([part.reshape(1).to(parts[0].device) for part in parts])).tolist()
        self.strategy.after_loss_read()
        training_failure = selection_failure = None
        if losses is not None:
            total = read[0]
            self._loss_sum += total
            if not math.isfinite(total):
                values = to_host(losses).tolist()
                bad = next(i for i, value in enumerate(values) if not math.isfinite(value))
                step = self._first_unread_step + bad
                training_failure = step, NonFiniteLossError(
                    f"training loss is not finite (here {values[bad]}) at epoch {self.epochs_started}, "
                    f"step {step}; lower the learning rate or check the data and labels"
                )
        sums = read[1:] if losses is not None else read
        bad_round = next(((index, steps) for (index, steps, _), total in zip(scored, sums) if not math.isfinite(total)),
                         None)
        if bad_round is not None:
            selection_failure = bad_round[1] + 1, NonFiniteLossError(
                f"selection losses are not finite at epoch {self.epochs_started}, round {bad_round[0] + 1}; "
                "lower the learning rate or check the data and labels"
            )
        # The one that happened first: a round scored before step k + 1 comes before that step.
        found = [failure for failure in (selection_failure, training_failure) if failure is not None]
        failure = min(found, key=lambda pair: pair[0])[1] if found else None
        self.exchange.agree(failure)

    def batch_loss(self, losses: torch.Tensor, batch: Batch) -> torch.Tensor:
        if batch.weights is not None:
            return (losses * batch.weights).mean()
        if self.correct_staleness and batch.keep_probabilities is not None:
            # The training forward's own losses say what selection would keep now.
            now = self.strategy.selector.current_keep_probabilities(losses)
            weights = staleness_weights(now, batch.keep_probabilities)
            # Self-normalised: the step keeps its size however stale the batch was.
            return (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
        return losses.mean()

    # -- counts and state ---------------------------------------------------------------
    def progress_counts(self) -> dict[str, float]:
        """Cumulative counters plus this epoch's, all additive so ranks can sum them."""
        return {
            **asdict(self.counters),
            "epoch_kept": self._epoch_kept,
            "epoch_considered": self._epoch_considered,
            "epoch_steps": self._epoch_steps,
            "epoch_loss_sum": self._loss_sum + self._unread_loss_sum(),
        }

    def _unread_loss_sum(self) -> float:
        """The unread losses' sum, leaving them unread: progress lines ask on one rank alone, and
        only `_read_losses`, which every rank reaches at the same step, may agree on them."""
        return float(torch.stack(self._unread_losses).sum()) if self._unread_losses else 0.0

    def epoch_share(self, examples: int, epoch: int) -> float:
        """The share of `epoch`, of `examples` (every rank's), that its rounds have taken up so far,
        the running round's included: the same on every lockstep rank, which run the same rounds.
        0 before its first round; once it is over, what it took (all of it unless stopped early),
        so its metrics row reports the schedule's lr at its end, not at its start."""
        if epoch != self.epochs_started - 1:
            return 0.0
        unit = self.chunk_size * self.collective.world_size
        if self._plan_reached is not None:
            reached, kept = self._plan_reached
            if not kept:
                return float(not self.stop_requested)
            # As the rounds would count it: the examples considered up to the last one the steps reach,
            # whole rounds of them (exact where every example is kept; in proportion where not).
            considered = -(-reached * examples // kept)
            return min(1.0, -(-considered // unit) * unit / examples)
        return min(1.0, (self._round_index + 1) * unit / examples)

    @property
    def epoch_rounds(self) -> int:
        """The rounds the running (or last) epoch ran: none where it was planned."""
        return 0 if self._plan_reached is not None else self._round_index + 1

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
        self.counters = Counters(**state["counters"])
        self.timer.load_state_dict(state["timer"])
        self.epochs_started = int(state["epochs_started"])
        if self.exchange is not None:
            self.exchange.leader_clock_s = float(state.get("leader_clock", 0.0))  # absent before work budgets

    def _new_epoch_counts(self) -> None:
        self._step_in_epoch = self._epoch_steps = 0
        self._epoch_considered = self._epoch_kept = 0
        self._loss_sum = 0.0


class _ExchangeWindow:
    """What a rank gathered in the rounds since its last exchange."""

    def __init__(self):
        self.batches: list[Batch] = []
        # The last round's batch, empty or not: what an exchange of nothing sends, its columns named.
        self.last = Batch(torch.empty(0, dtype=torch.int64))
        self.stop_vote = False
        self.error: AgreedError | None = None

    def add(self, kept: Batch, stop_vote: bool) -> None:
        if len(kept):
            self.batches.append(kept)
        self.last = kept
        self.stop_vote = self.stop_vote or stop_vote

    def kept(self) -> Batch:
        if self.error is not None:
            # A failed window sends no examples: their columns may be what failed.
            return Batch(torch.empty(0, dtype=torch.int64))
        if len(self.batches) > 1:
            return Batch.concat(self.batches)
        return self.batches[0] if self.batches else self.last


class ChunkLookahead:
    """An epoch's chunks, pulled ahead of the one being trained on.

    One ahead tells whether the current chunk is the last; with pipelined scoring,
    `depth` ahead, each handed to `submit` as it is pulled so that its losses are
    ready when training reaches it. Once the chunks run out it yields empty ones:
    lockstep ranks whose shards ran out first still join every round.
    """

    def __init__(self, chunks, empty_chunk, timer: PhaseTimer, submit=None, depth: int = 1):
        self.chunks, self.empty_chunk, self.timer = chunks, empty_chunk, timer
        self.submit, self.depth = submit, depth
        self.ahead: deque = deque()
        self._pull(1 + depth)

    def next(self):
        chunk = self.ahead.popleft() if self.ahead else self.empty_chunk()
        self._pull(self.depth)
        return chunk

    @property
    def exhausted(self) -> bool:
        """Whether the chunk `next` returned last was the epoch's last."""
        return not self.ahead

    def _pull(self, count: int) -> None:
        with self.timer.phase("data"):
            while len(self.ahead) < count:
                pulled = next(self.chunks, None)
                if pulled is None:
                    return
                if self.submit is not None:
                    self.submit(pulled)
                self.ahead.append(pulled)


class _CheckedScores:
    """What strategies see: the context's data, and its scores checked and counted."""

    def __init__(self, rounds: SelectionRounds, context: ChunkContext):
        self.rounds, self.context = rounds, context

    def sample_ids(self, chunk) -> torch.Tensor:
        return self.context.sample_ids(chunk)

    def load(self, chunk) -> Batch:
        return self.context.load(chunk)

    def score(self, batch: Batch) -> torch.Tensor:
        return self.rounds.score(self.context, batch)

    def progress(self) -> float:
        return self.context.progress()


def called(loss_fn: LossFunction, model: torch.nn.Module, batch: Batch, purpose: str) -> torch.Tensor:
    """`loss_fn(model, batch)`, its failures turned into a BadBatchError every rank can raise."""
    try:
        return loss_fn(model, batch)
    except AgreedError:
        raise
    except Exception as error:
        raise BadBatchError(f"loss_fn raised {type(error).__name__} in {purpose}: {error}") from error


def check_per_example(losses, rows: int, purpose: str) -> None:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise BadBatchError(
            f"the loss function must return one loss per example, shape ({rows},), in {purpose}; it returned "
            f"{shape} (use reduction='none')"
        )
