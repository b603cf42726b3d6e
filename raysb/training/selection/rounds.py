"""An epoch on one rank: the paper's method, decided a chunk at a time or the whole epoch at once.

`SelectionRounds` is what both of raysb's front doors run: `raysb.SelectiveBackprop`
(a user's own loop and batches) and raysb's image trainer (raysb.training.engine),
each plugging in its chunks, how to load and score them, and its clock. `epoch` is the one
driver; where the kept examples come from is the value it is handed:

- `ChunkRounds`: one round a chunk. The strategy is shown the chunk's ids and asks for scores
  where it needs them (`Strategy.wants_scores`); the round loads the chunk and runs a selection
  forward for them (no autograd; the losses' finiteness is read with the training losses, the
  round's one host sync for it), and the strategy decides (`Strategy.decide`: keep each example
  with probability CDF_R(loss) ** beta, raysb.core.keep_rule). The round takes the kept rows.
  Every `rounds_per_exchange` rounds, when each rank holds about a batch, an exchange.
- `WholeEpoch`: where nothing needs a forward of its own to decide (`Strategy.decides_epoch`:
  `uniform`, free-sb, InfoBatch, Stale-SB between its passes), the whole epoch's ids decided as it
  starts, then a plain loop over the kept examples, each step's gathered just before it.

Then, the same whatever the source: the exchange queues the kept examples (across lockstep ranks,
one all-gather: raysb.training.selection.exchange), every full batch of b is yielded and the
caller trains on it (`loss` or `whole_step`) before asking for the next. Progress (what an
epoch-keyed lr reads), the counts and the stop votes are kept here, in one place.

Every rank takes part in every exchange, at the same rounds whatever it kept or hit, so
ranks end epochs, stop and fail at the same exchange.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from raysb.core.batch_former import Batch, PendingRows
from raysb.core.errors import AgreedError, BadBatchError, NonFiniteLossError
from raysb.core.keep_rule import staleness_weights
from raysb.core.label_doubt import ClassifiedLosses, ClassLogits
from raysb.core.transfer import to_host
from raysb.core.spec import SelectionSpec
from raysb.training.collective import Collective
from raysb.core.transfer import to_device
from raysb.training.selection.exchange import Carried, KeptExchange, LocalQueue, LockstepExchange, StepVote
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies import ChunkContext, Decision, Scores, Strategy
from raysb.training.timing import PhaseTimer

# One loss per example, or a ClassifiedLosses where the loss comes from class logits (their margins
# then record each trained example's signal, raysb.core.label_doubt).
LossFunction = Callable[[torch.nn.Module, Batch], "torch.Tensor | ClassifiedLosses"]


@dataclass
class Counters:
    """Cumulative example and step counts of a run (this rank's)."""

    selection_forward_examples: int = 0
    train_forward_examples: int = 0
    backprop_examples: int = 0
    optimizer_steps: int = 0
    examples_considered: int = 0
    examples_kept: int = 0
    # Work a strategy spends outside its rounds, on the run's held-out split (raysb.training.irreducible_loss,
    # the over-fitting guard): examples a side model trained on, and forwards scored like selection's.
    side_trained_examples: int = 0
    side_forward_examples: int = 0


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

    def chosen(self, chunk, kept_ids: torch.Tensor) -> None:
        """This rank chose the examples `kept_ids` from `chunk` (before the exchange)."""

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
        # The running (or last) epoch's chunk round; -1 before its first.
        self._round_index = -1
        # How far the running epoch's steps reach (`epoch_share`), and whether it is over.
        self._progress: RoundProgress | PlanProgress = RoundProgress(0)
        self._epoch_over = False
        # What the next training step's agreement carries in an epoch decided as it starts.
        self._step_vote: StepVote | None = None
        self._new_epoch_counts()

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
        source: ChunkRounds | WholeEpoch,
        context: ChunkContext,
        *,
        select: bool = True,
        observer: RoundObserver | None = None,
    ) -> Iterator[Batch]:
        """`epoch`, yielding the batches of b to train on: every rank's way through an epoch.

        `source` says where this rank's kept examples come from: `ChunkRounds`, a round a chunk and
        an exchange every `rounds_per_exchange` rounds, or `WholeEpoch`, the epoch decided as it
        starts. Each exchange shares what the rank kept (with its stop vote, error and clock) and
        makes steps ready; here they are counted, voted on and yielded, and the epoch's progress
        (what its lr reads, `epoch_share`) follows the examples they reach. `select=False` trains
        on every example (plain-SGD epochs: `selects` said no)."""
        observer = observer or RoundObserver()
        self._start_epoch(epoch)
        try:
            for share in source.shares(self, epoch, context, select, observer):
                self._epoch_considered += share.considered
                self._epoch_kept += len(share.kept)
                with self.timer.phase("bookkeeping"):
                    self.exchange.exchange(share.kept, share.stop_vote, share.error, last_chunk=share.last,
                                           clock_s=self._clock_s() if share.clock_s is None else share.clock_s,
                                           bounded=share.bounded)
                self._progress = share.progress
                share.progress.exchanged(self.exchange.queued())
                yield from self._steps(epoch, share, observer)
                # The source ends the epoch where this says so (after its last exchange, if it has one).
                self.stop_requested = self.stop_requested or self.exchange.stop_requested
            self._epoch_over = not self.stop_requested
            self._read_losses()
        finally:
            self._step_vote = None
            self._close_epoch()
        self._count_epoch()

    def _steps(self, epoch: int, share: Share, observer: RoundObserver) -> Iterator[Batch]:
        """Every step the last exchange made ready. Where `share.votes_each_step` (an epoch decided
        as it starts, which has no rounds to vote at), each step first asks for rank 0's stop vote,
        `should_stop(epoch, n)`, n the steps the epoch will have run where it stops: alone the vote
        stops the epoch before the step; in lockstep it travels with the step's agreement and stops
        the epoch after it. n = 0 was asked as the epoch started."""
        exchange = self.exchange
        while not exchange.stop_requested and exchange.step_ready():
            if share.votes_each_step:
                taken = self._epoch_steps + int(exchange.votes_with_steps)
                vote = StepVote(taken > 0 and bool(observer.should_stop(epoch, taken)), self._clock_s())
                if exchange.votes_with_steps:
                    self._step_vote = vote
                elif exchange.take_vote(vote):
                    return
            with self.timer.phase("bookkeeping"):
                batch = exchange.next_step()
            share.progress.step(len(batch) * self.collective.world_size)
            yield batch

    def plans(self, epoch: int, sample_ids: torch.Tensor) -> bool:
        """Whether `epoch`, over this rank's `sample_ids` in its order, is decided whole as it starts
        (`Strategy.decides_epoch`), agreed by every lockstep rank: one that cannot (an example on its
        shard never scored) sends them all to the rounds."""
        own = self.strategy.decides_epoch(epoch, sample_ids)
        return self.collective.all_true(own) if self.spec.lockstep else own

    def decided(self, epoch: int, chunk, context: ChunkContext, select: bool) -> Batch:
        """The examples of `chunk` to train on, loaded: the strategy's decision on their ids and the
        scores it asks for, which a selection forward gives (`score`)."""
        if not select:
            return context.load(chunk)
        decision, loaded = self._decision(epoch, chunk, context)
        return _kept_of(chunk, decision, loaded, context)

    def decision_whole(self, epoch: int, ids: torch.Tensor, select: bool) -> Decision:
        """The strategy's decision on a whole epoch's `ids` (where `plans` said it needs no scores)."""
        if not select:
            return Decision()
        if self.strategy.wants_scores(epoch, ids) is not Scores.NONE:
            raise RuntimeError(f"strategy {self.strategy.name} decides epoch {epoch + 1} whole but asks for scores")
        return self.strategy.decide(epoch, ids, None)

    def counted_to(self, considered: int, kept: int) -> None:
        """This epoch's counts where it stopped short of examples it had decided on."""
        self._epoch_considered, self._epoch_kept = considered, kept

    def _decision(self, epoch: int, chunk, context: ChunkContext) -> tuple[Decision, Batch | None]:
        """The strategy's decision on `chunk`, and the chunk loaded where its scores needed it whole."""
        ids = context.sample_ids(chunk)
        wanted = self.strategy.wants_scores(epoch, ids)
        loaded = scores = None
        if wanted is Scores.ALL:
            loaded = context.load(chunk)
            scores = self.score(context, loaded)
        elif wanted is not Scores.NONE and len(wanted):
            scores = self.score(context, context.load(chunk[wanted.to(chunk.device)]))
        return self.strategy.decide(epoch, ids, scores), loaded

    def _clock_s(self) -> float:
        # Read only for a budget-keyed lr (time by the host's clock: no wait for the device).
        return self.clock() if self.clock is not None else 0.0

    def _start_epoch(self, epoch: int) -> None:
        self._in_epoch = True
        self.epochs_started = epoch + 1
        self._round_index = -1
        self._progress = RoundProgress(0)
        self._epoch_over = False
        self.stop_requested = False
        self._new_epoch_counts()

    def _close_epoch(self) -> None:
        """Whether it ended or failed: nothing of it is left to read."""
        self._in_epoch = False
        self._unread_losses.clear()
        self._selection_sums = []

    def _count_epoch(self) -> None:
        self.counters.examples_considered += self._epoch_considered
        self.counters.examples_kept += self._epoch_kept

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
        logits: ClassLogits | None = None
        with self.timer.phase("train_forward"):
            try:
                losses, logits = with_logits(called(self.loss_fn, model, batch, "training"))
                check_per_example(losses, len(batch), "training")
                loss = self.batch_loss(losses, batch)
            except AgreedError as error:
                failure = error
            # Agreed before backward: a rank that skipped it would leave the others
            # waiting in DDP's gradient all-reduce.
            self._agree_step(failure)
            self._note_loss(loss.detach())
        self.strategy.observe_training_losses(batch, losses.detach(), logits)
        self._count_step(len(batch))
        return loss

    def whole_step(self, batch: Batch,
                   step: Callable[[Batch], tuple[torch.Tensor, torch.Tensor, ClassLogits]]) -> None:
        """A training step that `step(batch)` runs whole, forward, backward and update (a captured CUDA
        graph), returning the per-example losses, the loss and the logits: agreed and counted as
        `loss`'s are."""
        self._agree_step(None)
        with self.timer.phase("train_step"):
            losses, loss, logits = step(batch)
            self._note_loss(loss)
        self.strategy.observe_training_losses(batch, losses, logits)
        self._count_step(len(batch))

    def _agree_step(self, failure: AgreedError | None) -> None:
        vote, self._step_vote = self._step_vote, None
        self.exchange.agree(failure, vote)

    def _note_loss(self, loss: torch.Tensor) -> None:
        if not self._unread_losses:
            self._first_unread_step = self._step_in_epoch + 1
        self._unread_losses.append(loss)
        if len(self._unread_losses) >= self.loss_read_every:
            self._read_losses()

    def _count_step(self, examples: int) -> None:
        self.counters.train_forward_examples += examples
        self.counters.backprop_examples += examples
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
            # How far the epoch is, in examples considered: a whole epoch decided as it starts considered
            # every one at once, and its steps say how far it is.
            "epoch_reached": self._epoch_considered * self._progress.trained_share(),
            "epoch_steps": self._epoch_steps,
            "epoch_loss_sum": self._loss_sum + self._unread_loss_sum(),
        }

    def _unread_loss_sum(self) -> float:
        """The unread losses' sum, leaving them unread: progress lines ask on one rank alone, and
        only `_read_losses`, which every rank reaches at the same step, may agree on them."""
        return float(torch.stack(self._unread_losses).sum()) if self._unread_losses else 0.0

    def epoch_share(self, examples: int, epoch: int) -> float:
        """The share of `epoch`, of `examples` (every rank's), that the steps so far reach, the running
        one's included: the same on every lockstep rank. 0 before its first exchange; once it is over,
        1 (what it took where it stopped), so its metrics row reports the schedule's lr at its end.

        A step reaches the examples considered through the round that decided its examples: every
        example of the chunks decided so far, in whole rounds. A whole epoch decided as it starts
        counts them by the round that would have decided each (`PlanProgress`): the same lr at every
        step as its rounds would give, where they keep the same examples."""
        if epoch != self.epochs_started - 1:
            return 0.0
        if self._epoch_over:
            return 1.0
        return min(1.0, self._progress.reached(examples) / examples)

    @property
    def epoch_rounds(self) -> int:
        """The chunk rounds the running (or last) epoch ran: none where it was decided as it started."""
        return self._round_index + 1

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
        self.considered = 0
        self.stop_vote = False
        self.error: AgreedError | None = None

    def add(self, considered: int, kept: Batch, stop_vote: bool) -> None:
        if len(kept):
            self.batches.append(kept)
        self.last = kept
        self.considered += considered
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


@dataclass
class Share:
    """What this rank puts into one exchange, and how the steps it makes ready count."""

    kept: Batch | PendingRows
    # This epoch's examples (this rank's) whose decisions it carries.
    considered: int
    progress: RoundProgress | PlanProgress
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


class RoundProgress:
    """How far the steps after a round's exchange reach: every example of the chunks decided so far
    on every rank (`considered`)."""

    def __init__(self, considered: int):
        self.considered = considered

    def exchanged(self, queued: int) -> None:
        """The queue after the exchange."""

    def step(self, examples: int) -> None:
        """A step took `examples` off the queue (every rank's)."""

    def reached(self, examples: int) -> int:
        return self.considered

    def trained_share(self) -> float:
        """The share of the examples decided so far that the steps have reached: all (rounds decide as
        the steps go)."""
        return 1.0


class PlanProgress:
    """How far the steps of an epoch decided as it starts reach. Alone, as its rounds would count
    it: every example considered through the chunk round (of `unit` examples) that would have
    decided the last kept example a step trained (`positions`: the kept examples' places in the
    epoch's order). Lockstep ranks queue the epoch's kept examples rank by rank, not round by
    round: there a step reaches the share of the kept examples it trained, in whole rounds."""

    def __init__(self, queued_before: int, unit: int, positions: torch.Tensor | None):
        self.queued_before, self.unit, self.positions = queued_before, unit, positions
        self.kept = self.popped = 0

    def exchanged(self, queued: int) -> None:
        """The queue after the epoch's exchange: the queued before it, then its kept examples (every rank's)."""
        self.kept = queued - self.queued_before

    def step(self, examples: int) -> None:
        self.popped += examples

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
            considered = max(1, int(self.positions[taken - 1]) + 1 if taken else 1)
        return -(-considered // self.unit) * self.unit


class ChunkRounds:
    """Kept examples a round at a time: each chunk of `upcoming` decided (scored where its strategy
    asks) and loaded, and an exchange every `rounds_per_exchange` rounds, when each rank holds about
    a batch. A rank whose chunks run out joins the remaining rounds with nothing kept; each exchange
    says whether a rank has more, so every rank ends the epoch at the same exchange."""

    def __init__(self, upcoming: ChunkLookahead):
        self.upcoming = upcoming

    def shares(self, rounds: SelectionRounds, epoch: int, context: ChunkContext, select: bool,
               observer: RoundObserver) -> Iterator[Share]:
        window = _ExchangeWindow()
        unit = rounds.chunk_size * rounds.collective.world_size
        for round_index in itertools.count():
            rounds._round_index = round_index
            chunk = self.upcoming.next()
            kept = _nothing()
            with rounds.timer.phase("bookkeeping"):
                # A rank that failed earlier in the window keeps nothing more until the exchange reports it.
                if window.error is None:
                    try:
                        kept = rounds.decided(epoch, chunk, context, select)
                    except AgreedError as failure:
                        window.error = failure
                    else:
                        observer.chosen(chunk, kept.sample_ids)
            window.add(len(chunk), kept, bool(observer.should_stop(epoch, round_index)))
            # The same rounds on every rank, whatever each kept: no rank waits alone in the all-gather.
            if (round_index + 1) % rounds.rounds_per_exchange:
                continue
            yield Share(window.kept(), window.considered, RoundProgress((round_index + 1) * unit), window.stop_vote,
                        window.error, last=self.upcoming.exhausted)
            window = _ExchangeWindow()
            if rounds.exchange.stop_requested or rounds.exchange.epoch_finished:
                return


class WholeEpoch:
    """The epoch decided whole as it starts (where `SelectionRounds.plans` said so), then a plain
    loop over its kept examples in full batches of b, each step voting on stopping. `order`: this
    rank's examples in the epoch's order, as a chunk the context loads slices of. The examples
    queued from the last epoch go first, and those short of a full batch at the end wait for the
    next, as in the rounds: kept = backpropagated + queued. Lockstep ranks exchange as it starts
    (the recorded losses the decisions rank against), then their kept ids, which fix every rank's
    steps, and at its end (the epoch's recorded losses); alone, each step's examples are gathered
    just before it."""

    def __init__(self, order, device: torch.device | None = None):
        """`device`: where the shard's examples are; the kept examples' places go there once, so a
        step gathers its rows where they are without copying its places first."""
        self.order, self.device = order, device

    def shares(self, rounds: SelectionRounds, epoch: int, context: ChunkContext, select: bool,
               observer: RoundObserver) -> Iterator[Share]:
        exchange, lockstep = rounds.exchange, rounds.spec.lockstep
        yield Share(_nothing(), 0, RoundProgress(0), stop_vote=bool(observer.should_stop(epoch, 0)), bounded=False)
        if exchange.stop_requested:
            return
        table = rounds.strategy.loss_table()
        if table is not None and table.sharded:
            with rounds.timer.phase("bookkeeping"):
                # Each rank decides the examples it owns, against the whole set's scores.
                table.share_summary(rounds.collective)
        ids = context.sample_ids(self.order)
        kept, error, chosen, weights = _nothing(), None, torch.empty(0, dtype=torch.int64), None
        try:
            with rounds.timer.phase("bookkeeping"):
                decision = rounds.decision_whole(epoch, ids, select)
                chosen = torch.arange(len(ids)) if decision.kept is None else decision.kept
                weights = decision.weights
                observer.chosen(self.order, ids[chosen])
        except AgreedError as failure:
            error = failure
        else:
            places = self.order[chosen] if self.device is None else to_device(self.order[chosen], self.device)
            kept = Batch(ids[chosen], weights=weights) if lockstep else PendingRows(
                len(chosen), lambda start, stop: _gathered(context, places[start:stop], weights, start, stop))
        unit = rounds.chunk_size * rounds.collective.world_size
        progress = PlanProgress(exchange.queued(), unit, None if lockstep else chosen)
        yield Share(kept, len(ids), progress, error=error, bounded=False, votes_each_step=True)
        if lockstep:
            # The epoch's recorded losses, on every rank before the next epoch's first exchange, whose
            # round-sized bound a whole epoch's would exceed. Its stop vote is what the steps agreed.
            yield Share(_nothing(), 0, progress, stop_vote=rounds.stop_requested, clock_s=exchange.leader_clock_s,
                        bounded=False)
        elif rounds.stop_requested:
            # Kept but never reached: neither trained nor queued, so not counted as kept either.
            taken = len(chosen) - exchange.drop_pending()
            rounds.counted_to(int(chosen[taken]) if taken < len(chosen) else len(ids), taken)
        else:
            exchange.load_pending()


def _gathered(context: ChunkContext, positions, weights: torch.Tensor | None, start: int, stop: int) -> Batch:
    batch = context.load(positions)
    if weights is not None:
        batch.weights = to_device(weights[start:stop], batch.device)
    return batch


def _kept_of(chunk, decision: Decision, loaded: Batch | None, context: ChunkContext) -> Batch:
    """A chunk's kept examples as a batch: taken from the chunk where it was loaded whole to be
    scored, else gathered alone (only the kept examples are loaded and augmented)."""
    if loaded is None:
        kept = context.load(chunk if decision.kept is None else chunk[decision.kept.to(chunk.device)])
    else:
        if decision.keep_probabilities is not None:
            loaded.keep_probabilities = to_device(decision.keep_probabilities, loaded.device)
        kept = loaded if decision.kept is None else loaded.take(decision.kept)
    if decision.weights is not None:
        kept.weights = to_device(decision.weights, kept.device)
    return kept


def _nothing() -> Batch:
    return Batch(torch.empty(0, dtype=torch.int64))


def called(loss_fn: LossFunction, model: torch.nn.Module, batch: Batch, purpose: str) -> torch.Tensor:
    """`loss_fn(model, batch)`, its failures turned into a BadBatchError every rank can raise."""
    try:
        return loss_fn(model, batch)
    except AgreedError:
        raise
    except Exception as error:
        raise BadBatchError(f"loss_fn raised {type(error).__name__} in {purpose}: {error}") from error


def with_logits(output) -> tuple[torch.Tensor, ClassLogits | None]:
    """A loss function's output as (per-example losses, their forward's logits or None)."""
    if isinstance(output, ClassifiedLosses):
        return output.losses, output.logits
    return output, None


def check_per_example(losses, rows: int, purpose: str) -> None:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise BadBatchError(
            f"the loss function must return one loss per example, shape ({rows},), in {purpose}; it returned "
            f"{shape} (use reduction='none')"
        )
