"""Where an epoch's kept examples come from, the value `SelectionRounds.epoch` is handed:

- `ChunkRounds`: one round a chunk. The strategy is shown the chunk's ids and asks for scores
  where it needs them (`Strategy.wants_scores`); the round loads the chunk and runs a selection
  forward for them (`SelectionRounds.score`), and the strategy decides (`Strategy.decide`: keep
  each example with probability CDF_R(loss) ** beta, raysb.core.keep_rule). The round takes the
  kept rows. Every `rounds_per_exchange` rounds, when each rank holds about a batch, an exchange.
- `WholeEpoch`: where nothing needs a forward of its own to decide (`Strategy.decides_epoch`:
  `uniform`, free-sb, InfoBatch, Stale-SB between its passes), the whole epoch's ids decided as it
  starts, then a plain loop over the kept examples, each step's gathered just before it.
- `StreamedPlan`: the same for a streamed shard, which holds no example: the whole epoch's ids
  decided as it starts, then only the kept rows read and decoded, and trained on in rounds as
  `ChunkRounds` trains a streamed epoch's chunks (`KeptPlan`).

Each yields `Share`s, what this rank puts into one exchange; the rounds exchange, count and step.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from raysb.core.batch_former import Batch, PendingRows
from raysb.core.errors import AgreedError
from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_device
from raysb.training.selection.loss_reads import check_per_example
from raysb.training.selection.rounds import PlanProgress, RoundObserver, SelectionRounds, Share
from raysb.training.selection.strategies import ChunkContext, Decision, Scores
from raysb.training.timing import PhaseTimer


class ChunkLookahead:
    """An epoch's chunks, pulled ahead of the one being trained on.

    One ahead tells whether the current chunk is the last (`ahead` is empty); with pipelined
    scoring, `depth` ahead, each handed to `submit` as it is pulled so that its losses are ready
    when training reaches it. Once the chunks run out it yields empty ones: lockstep ranks whose
    shards ran out first still join every round.
    """

    def __init__(self, chunks, empty_chunk, timer: PhaseTimer, submit=None, depth: int = 1):
        self.chunks, self.empty_chunk, self.timer = chunks, empty_chunk, timer
        self.submit, self.depth = submit, depth
        self.ahead: deque = deque()

    def next(self):
        with self.timer.phase("data"):
            while len(self.ahead) <= self.depth:
                pulled = next(self.chunks, None)
                if pulled is None:
                    break
                if self.submit is not None:
                    self.submit(pulled)
                self.ahead.append(pulled)
        return self.ahead.popleft() if self.ahead else self.empty_chunk()


class ChunkRounds:
    """Kept examples a round at a time: each chunk of `upcoming` decided (scored where its strategy
    asks) and loaded, and an exchange every `rounds_per_exchange` rounds, when each rank holds about
    a batch. A rank whose chunks run out joins the remaining rounds with nothing kept; each exchange
    says whether a rank has more, so every rank ends the epoch at the same exchange."""

    def __init__(self, upcoming: ChunkLookahead, plan: KeptPlan | None = None):
        """`plan`: the chunks are kept rows of an epoch decided as it starts, trained on as they come."""
        self.upcoming, self.plan = upcoming, plan

    def shares(self, rounds: SelectionRounds, epoch: int, context: ChunkContext, select: bool,
               observer: RoundObserver):
        upcoming, timer, exchange, plan = self.upcoming, rounds.timer, rounds.exchange, self.plan
        world = rounds.collective.world_size
        unit = rounds.chunk_size * world
        # The window since the last exchange: its kept batches, the last round's (empty or not: what an
        # exchange of nothing sends, its columns named), its examples, stop vote and failure.
        batches, last, considered, stop_vote = [], None, 0, False
        error = plan.error if plan is not None else None
        for round_index in itertools.count():
            rounds.round_index = round_index
            chunk = upcoming.next()
            kept = None
            with timer.phase("bookkeeping"):
                # A rank that failed earlier in the window keeps nothing more until the exchange reports it.
                if error is None and plan is not None:
                    kept = plan.batch(context, chunk)
                elif error is None:
                    try:
                        kept = _decided(rounds, epoch, chunk, context, select)
                    except AgreedError as failure:
                        error = failure
                    else:
                        observer.chosen(chunk, kept.sample_ids)
            if kept is None:
                kept = _nothing()
            vote = bool(observer.should_stop(epoch, round_index))
            if len(kept):
                batches.append(kept)
            if rounds.round_graph is not None and (vote or not upcoming.ahead):
                # Where the epoch may end here, the rows of captured rounds whose kept count is still in flight.
                in_flight = rounds.round_graph.drained()
                if in_flight is not None:
                    batches.append(in_flight)
            taken = len(chunk) if plan is None else plan.considered_with(len(chunk))
            last, considered, stop_vote = kept, considered + taken, stop_vote or vote
            # The same rounds on every rank, whatever each kept: no rank waits alone in the all-gather.
            if (round_index + 1) % rounds.rounds_per_exchange:
                continue
            if error is not None:  # a failed window sends no examples: their columns may be what failed
                shared = _nothing()
            else:
                shared = Batch.concat(batches) if len(batches) > 1 else batches[0] if batches else last
            reached = (round_index + 1) * unit if plan is None else plan.reached() * world
            yield Share(shared, considered, reached=reached, stop_vote=stop_vote, error=error, last=not upcoming.ahead)
            batches, last, considered, stop_vote, error = [], None, 0, False, None
            if exchange.stop_requested or exchange.epoch_finished:
                return


def _decided(rounds: SelectionRounds, epoch: int, chunk, context: ChunkContext, select: bool) -> Batch:
    """The examples of `chunk` to train on, loaded: the strategy's decision on their ids and the scores
    it asks for, which a selection forward gives. Taken from the chunk where it was loaded whole to be
    scored, else gathered alone (only the kept examples are loaded and augmented)."""
    if not select:
        return context.load(chunk)
    in_flight = None
    if rounds.round_graph is not None:  # SB's round whole on the device, where it takes this chunk
        with rounds.timer.phase("selection"):
            captured = rounds.round_graph(chunk, rounds.counters.optimizer_steps)
        if captured is not None:
            kept, finite_check = captured
            rounds.counters.selection_forward_examples += len(chunk)
            rounds.reads.selection_sums.append((rounds.round_index, rounds.counts.steps, finite_check))
            return kept
        in_flight = rounds.round_graph.drained()  # earlier captured rounds' rows go first
    strategy = rounds.strategy
    ids = context.sample_ids(chunk)
    wanted = strategy.wants_scores(epoch, ids)
    loaded = scores = None
    if wanted is Scores.ALL:
        loaded = context.load(chunk)
        scores = _scored(rounds, context, loaded)
    elif wanted is not Scores.NONE and len(wanted):
        scores = _scored(rounds, context, context.load(chunk[wanted.to(chunk.device)]))
    decision = strategy.decide(epoch, ids, scores)
    if loaded is None:
        kept = context.load(chunk if decision.kept is None else chunk[decision.kept.to(chunk.device)])
    else:
        # Only the staleness correction reads them: carried further, every queue join would copy them too.
        if decision.keep_probabilities is not None and rounds.staleness_selector is not None:
            loaded.keep_probabilities = to_device(decision.keep_probabilities, loaded.sample_ids.device)
        kept = loaded if decision.kept is None else loaded.take(decision.kept)
    if decision.weights is not None:
        kept.weights = to_device(decision.weights, kept.sample_ids.device)
    return kept if in_flight is None else Batch.concat([in_flight, kept])


def _scored(rounds: SelectionRounds, context: ChunkContext, batch: Batch) -> torch.Tensor:
    """Selection losses of `batch` from `context`, counted and timed, and checked finite on the device: the
    check is read with the training losses (`LossReads.read`), so no round waits for it. Until then a NaN
    only skews a few rounds' choices, and the run stops at the read."""
    with rounds.timer.phase("selection"):
        losses = context.score(batch)
        check_per_example(losses, len(batch), "selection")
        rounds.counters.selection_forward_examples += len(batch)
        # One op a round: a NaN or infinity makes the float64 sum non-finite (float32 losses cannot
        # overflow it). Read with the training losses, which name the first bad round.
        rounds.reads.selection_sums.append((rounds.round_index, rounds.counts.steps, losses.sum(dtype=torch.float64)))
        return losses.float()


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
               observer: RoundObserver):
        exchange, lockstep = rounds.exchange, rounds.spec.lockstep
        yield Share(_nothing(), 0, stop_vote=bool(observer.should_stop(epoch, 0)), bounded=False)
        if exchange.stop_requested:
            return
        table = rounds.strategy.loss_table()
        if table is not None and table.sharded:
            with rounds.timer.phase("bookkeeping"):
                # Each rank decides the examples it owns, against the whole set's scores.
                table.owner.share(table, rounds.collective)
        ids = context.sample_ids(self.order)
        kept, error, chosen, weights = _nothing(), None, torch.empty(0, dtype=torch.int64), None
        try:
            with rounds.timer.phase("bookkeeping"):
                decision = _decision_whole(rounds, epoch, ids, select)
                chosen = torch.arange(len(ids)) if decision.kept is None else decision.kept
                weights = decision.weights
                observer.chosen(self.order, ids[chosen])
        except AgreedError as failure:
            error = failure
        else:
            places = self.order[chosen] if self.device is None else to_device(self.order[chosen], self.device)

            def gathered(start: int, stop: int) -> Batch:
                batch = context.load(places[start:stop])
                if weights is not None:
                    batch.weights = to_device(weights[start:stop], batch.sample_ids.device)
                return batch

            kept = Batch(ids[chosen], weights=weights) if lockstep else PendingRows(len(chosen), gathered)
        unit = rounds.chunk_size * rounds.collective.world_size
        plan = PlanProgress(exchange.queued(), unit, None if lockstep else chosen)
        yield Share(kept, len(ids), plan=plan, error=error, bounded=False, votes_each_step=True)
        if lockstep:
            # The epoch's recorded losses, on every rank before the next epoch's first exchange, whose
            # round-sized bound a whole epoch's would exceed. Its stop vote is what the steps agreed.
            yield Share(_nothing(), 0, plan=plan, stop_vote=rounds.stop_requested, clock_s=exchange.leader_clock_s,
                        bounded=False)
        elif rounds.stop_requested:
            # Kept but never reached: neither trained nor queued, so not counted as kept either.
            taken = len(chosen) - exchange.drop_pending()
            rounds.counts.considered = int(chosen[taken]) if taken < len(chosen) else len(ids)
            rounds.counts.kept = taken
        else:
            exchange.load_pending()


class StreamedPlan:
    """A streamed epoch decided whole as it starts (where `SelectionRounds.plans` said so). This rank's
    rows in the epoch's order (`StreamShard.epoch_order`, from `seed`) are decided at once, as
    `WholeEpoch` decides an in-memory epoch's, once every rank holds the records they rank against;
    then only the kept rows are read and decoded (`StreamShard.kept_chunks`) and trained on in rounds
    of `chunk_size`, the kept examples travelling between lockstep ranks as a streamed epoch's do.
    Where no rank leaves a row out (Traditional; free-sb's first epoch, nothing scored yet), the
    epoch streams every row as it would undecided, and nothing is decided again."""

    def __init__(self, shard, seed: int, chunk_size: int, timer: PhaseTimer):
        self.shard, self.seed, self.chunk_size, self.timer = shard, seed, chunk_size, timer

    def shares(self, rounds: SelectionRounds, epoch: int, context: ChunkContext, select: bool,
               observer: RoundObserver):
        # Nothing kept yet, its columns named (examples travel between lockstep ranks); the exchange brings
        # every rank's recorded losses, which the decisions rank against.
        nothing = context.load(self.shard.empty_chunk())
        yield Share(nothing, 0, stop_vote=bool(observer.should_stop(epoch, 0)), bounded=False)
        if rounds.exchange.stop_requested:
            return
        order = self.shard.epoch_order(self.seed)
        ids = self.shard.sample_ids(order)
        kept, weights, error = torch.empty(0, dtype=torch.int64), None, None
        try:
            with rounds.timer.phase("bookkeeping"):
                decision = _decision_whole(rounds, epoch, ids, select)
            kept = torch.arange(len(ids)) if decision.kept is None else decision.kept
            weights = decision.weights
        except AgreedError as failure:
            error = failure  # reported at the first round's exchange, on every rank
        every_row = error is None and len(kept) == len(ids) and (weights is None or bool((weights == 1).all()))
        if rounds.collective.all_true(every_row):
            chunks = self.shard.stream(self.chunk_size, self.seed)
            yield from ChunkRounds(ChunkLookahead(chunks, self.shard.empty_chunk, self.timer)).shares(
                rounds, epoch, context, False, observer)
            return
        if error is None:
            observer.chosen(order, ids[kept])
        chunks = self.shard.kept_chunks(order[kept], self.chunk_size, self.seed)
        plan = KeptPlan(len(ids), ids[kept], weights, error)
        yield from ChunkRounds(ChunkLookahead(chunks, self.shard.empty_chunk, self.timer), plan).shares(
            rounds, epoch, context, select, observer)


class KeptPlan:
    """What an epoch decided as it starts kept of this rank's `considered` examples: `kept_ids`, with
    their loss `weights` where the decision weighs them (else None), and how far the rounds have read
    them; `error`, where deciding failed (the first round reports it)."""

    def __init__(self, considered: int, kept_ids: torch.Tensor, weights: torch.Tensor | None,
                 error: AgreedError | None = None):
        self.considered, self.kept, self.error = considered, kept_ids.numel(), error
        self.index, self.weights = SampleIndex(kept_ids), weights
        self.read = 0

    def batch(self, context: ChunkContext, chunk) -> Batch:
        """A chunk of kept rows, loaded, with its decided weights."""
        batch = context.load(chunk)
        if self.weights is not None:  # found by the chunk's host ids: no wait for the device
            batch.weights = to_device(self.weights[self.index.rows_of(context.sample_ids(chunk))], batch.device)
        return batch

    def considered_with(self, rows: int) -> int:
        """The examples considered that `rows` more kept rows read stand for: the epoch's share of them."""
        before = self.reached()
        self.read += rows
        return self.reached() - before

    def reached(self) -> int:
        """This rank's examples considered by the kept rows read so far (all of them once they are)."""
        return self.considered if self.read >= self.kept else self.considered * self.read // self.kept


def _decision_whole(rounds: SelectionRounds, epoch: int, ids: torch.Tensor, select: bool) -> Decision:
    """The strategy's decision on a whole epoch's `ids` (where `plans` said it needs no scores)."""
    if not select:
        return Decision()
    strategy = rounds.strategy
    if strategy.wants_scores(epoch, ids) is not Scores.NONE:
        raise RuntimeError(f"strategy {strategy.name} decides epoch {epoch + 1} whole but asks for scores")
    return strategy.decide(epoch, ids, None)


def _nothing() -> Batch:
    return Batch(torch.empty(0, dtype=torch.int64))
