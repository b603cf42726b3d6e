"""raysb's image trainer on one rank: its parts around the selection rounds.

`Engine` puts together the parts the builders make (raysb.training.builders), each readable alone:
the selection rounds (raysb.training.selection.rounds: selection, batch forming, the lockstep
exchange, the machinery `raysb.SelectiveBackprop` runs in users' own loops), the chunk feed (the
rank's shard of the data, loaded, augmented and scored: raysb.training.chunk_feed), the training
step (raysb.training.train_step), the run's schedule (the lr and what it makes of selection:
raysb.training.run_schedule), evaluation (raysb.training.evaluation) and the held-out split a
strategy's card asks for (raysb.training.held_out). It knows nothing of Ray: a distributed run gives
every rank the same engine with a collective and its own shard.
"""

from __future__ import annotations

import struct
import zlib

from collections.abc import Callable

import torch

from raysb.core.batch_former import Batch
from raysb.core.work_units import work_epochs
from raysb.training.chunk_feed import ChunkFeed
from raysb.training.evaluation import Evaluation
from raysb.training.held_out import HeldOutSplit
from raysb.training.run_schedule import RunSchedule
from raysb.training.selection.counts import Counters
from raysb.training.selection.rounds import RoundObserver, SelectionRounds
from raysb.training.timing import PhaseTimer
from raysb.training.trace import SelectionTrace
from raysb.training.train_step import TrainingStep

# On a GPU the training loss is read to the host every this many steps: reading it every step made
# each backward wait for its forward. A CPU has nothing queued to wait for, so it checks every step.
GPU_LOSS_READ_EVERY = 16


class Engine:
    def __init__(self, rounds: SelectionRounds, feed: ChunkFeed, step: TrainingStep, schedule: RunSchedule,
                 evaluation: Evaluation, trace: SelectionTrace | None = None, held_out: HeldOutSplit | None = None,
                 plan_epochs: bool = True):
        """`plan_epochs`: an epoch whose decisions need no forward of their own is decided whole as it
        starts and run as a plain loop (SelectionRounds.plans, then a WholeEpoch source), where its
        examples are held in memory; False runs every epoch in rounds (the same distribution, chunk by
        chunk).
        `trace`: raysb report's record of what selection chose. `held_out`: the share of the training
        data held out of training where the strategy's card asks for one."""
        self.rounds, self.feed, self.step, self.schedule = rounds, feed, step, schedule
        self.evaluation, self.trace, self.held_out, self.plan_epochs = evaluation, trace, held_out, plan_epochs
        self.strategy, self.shard, self.device, self.pipeline = rounds.strategy, feed.shard, feed.device, feed.pipeline
        self.batch_size, self.chunk_size = rounds.batch_size, rounds.chunk_size
        self.rounds.clock = {"time": rounds.timer.host_training_seconds, "work": self.work_done}.get(
            schedule.lr_schedule.key)
        # A scored example's cost over a trained one's (raysb.core.work): set before training under a
        # work budget, and carried by checkpoints so a resumed run counts work as it did.
        self.scoring_cost: float | None = None
        self.lr_checksum = 0
        # The console's lines: the step's on how the device trains, and the engine's own.
        self._notices = step.notices
        if trace is not None and self.strategy.selector is not None:
            self.strategy.selector.observer = lambda *decisions: trace.record_decisions(
                schedule.epoch + 1, rounds.counters.optimizer_steps, *decisions
            )

    @property
    def model(self) -> torch.nn.Module:
        """The module trained (a compiled or DDP-wrapped one where the run wraps it)."""
        return self.step.model

    @property
    def timer(self) -> PhaseTimer:
        return self.rounds.timer

    @property
    def counters(self) -> Counters:
        return self.rounds.counters

    def work_done(self) -> float:
        """This run's work so far, in epochs of training (raysb.core.work), from this rank's counts."""
        counters = self.counters
        return work_epochs(counters.backprop_examples + counters.side_trained_examples,
                           counters.selection_forward_examples + counters.side_forward_examples,
                           self.scoring_cost or 0.0, self.rounds.collective.world_size, self.shard.num_examples)

    # -- training -------------------------------------------------------------------
    def train_epoch(self, epoch: int, should_stop: Callable[[int, int], bool] | None = None) -> bool:
        """Train one epoch; returns True if `should_stop(epoch, round_index)` (rank 0's) ended it early."""
        rounds, pipeline = self.rounds, self.pipeline
        select = self.schedule.start_epoch(epoch)
        scoring_ahead = pipeline is not None and select and self.strategy.scores_whole_chunks(epoch)
        self.feed.scorer.new_epoch()
        if pipeline is not None:
            pipeline.new_epoch()
        # An epoch that does not select asks no strategy (every rank knows it is one).
        source = self.feed.source(lambda ids: not select or rounds.plans(epoch, ids), rounds.chunk_size,
                                  self.strategy.loss_table(), self.plan_epochs, scoring_ahead, select)
        observer = _EngineRounds(self.feed, self.trace if select else None, scoring_ahead, should_stop)
        for batch in rounds.epoch(epoch, source, self.feed, select=select, observer=observer):
            self.train_step(batch)
        if rounds.stop_requested and pipeline is not None:
            pipeline.discard()
        if self.trace is not None:
            with self.timer.phase("probes"):  # raysb report's counts, not training
                self.trace.close_epoch()
        if self.held_out is not None:
            line = self.held_out.after_epoch(epoch)
            if line is not None:
                self.notice(line)
        return rounds.stop_requested

    def train_step(self, batch: Batch) -> None:
        lr = self.schedule.lr()
        # Every step's lr in one number, so ranks can show they stepped with the same ones.
        self.lr_checksum = zlib.crc32(struct.pack("<d", lr), self.lr_checksum)
        self.step(batch, lr, self.rounds)

    def start_training_clock(self, startup_seconds: float, restored: bool) -> None:
        """Time from here on is training: setup before it (data, model, worker group), `startup_seconds`
        long, is start-up. A `restored` clock runs on from its checkpoint's time."""
        if not restored:
            self.timer.clear()  # phases timed in setup are not the run's
        self.timer.start(startup_seconds)

    def agreed_epoch_end(self, budget_spent: bool) -> bool:
        """Rank 0's `budget_spent` as the epoch ends, with its schedule clock, taken up by every rank (a
        collective): what the schedule reads from here on is its value at the epoch's end."""
        clock = self.rounds.clock() if self.rounds.clock is not None else 0.0
        spent, self.rounds.exchange.leader_clock_s = self.rounds.collective.broadcast_object((budget_spent, clock))
        return spent

    def progress_counts(self) -> dict[str, float]:
        return {**self.rounds.progress_counts(), **self.feed.read_counts()}

    def graphs(self) -> list:
        """The CUDA graphs (raysb.training.cuda_graphs.GraphedFunction) this engine replays: its step's,
        its scorer's, its keep rule's, its rounds'."""
        step, scoring, keep_rule = self.step.captured_step, self.feed.scorer.captured, self.keep_rule_graph
        round_graph = self.rounds.round_graph
        return [*(step.captured_graphs() if step is not None else []),
                *(scoring.captured_graphs() if scoring is not None else []),
                *(keep_rule.captured_graphs() if keep_rule is not None else []),
                *(round_graph.captured_graphs() if round_graph is not None else [])]

    @property
    def keep_rule_graph(self):
        """The strategy's keep rule replayed as a graph (raysb.training.selection.keep_rule_graph), or None."""
        selector = self.strategy.selector
        return selector.captured_rule if selector is not None else None

    def notice(self, line: str) -> None:
        """A line for the run's console, shown with the next notices (`take_notices`)."""
        self._notices.append(line)

    def take_notices(self) -> list[str]:
        """Lines for the run's console since the last call: how the device trains (a refused capture),
        what the strategy did (its over-fitting guard)."""
        notices = list(self._notices)
        self._notices.clear()
        return notices

    # -- checkpointing ----------------------------------------------------------------
    # A checkpoint is taken at an epoch boundary and continues bit-for-bit. Under
    # data parallelism it has two parts: the shared state, equal on every rank
    # (DDP keeps parameters, and so the optimizer, in step), and each rank's own.
    def shared_state_dict(self) -> dict:
        return {**self.step.shared_state_dict(), "scoring_cost": self.scoring_cost}

    def rank_state_dict(self) -> dict:
        """What may differ between ranks, on the CPU so it can travel to rank 0: the model's buffers
        (`TrainingStep.buffers`), the selection state and the data's generators."""
        return {"buffers": self.step.buffers(), "selection": self.rounds.state_dict(), **self.feed.state_dict()}

    def load_state_dict(self, shared: dict, rank: dict) -> None:
        self.step.load_state_dict(shared, rank["buffers"])
        self.scoring_cost = shared.get("scoring_cost")  # absent from checkpoints made before work budgets
        self.rounds.load_state_dict(rank["selection"])
        self.feed.load_state_dict(rank)


class _EngineRounds(RoundObserver):
    """The engine's part in each round: the trace's counts, the pipeline's unused scores, the run's stop vote."""

    def __init__(self, feed: ChunkFeed, trace: SelectionTrace | None, scoring_ahead: bool, should_stop):
        """`trace`: None in an epoch that does not select (a primed or annealed epoch trains on everything
        without choosing; counting it would show every example as kept at least once)."""
        self.feed, self.trace, self.scoring_ahead = feed, trace, scoring_ahead
        self.stop = should_stop

    def chosen(self, chunk, kept_ids: torch.Tensor) -> None:
        if self.scoring_ahead:
            self.feed.pipeline.release(chunk)
        if self.trace is not None:
            self.trace.record_chunk(self.feed.sample_ids(chunk), kept_ids)

    def should_stop(self, epoch: int, round_index: int) -> bool:
        return self.stop is not None and self.stop(epoch, round_index)
