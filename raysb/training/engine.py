"""raysb's image trainer: its data, augmentation, scorer and schedule around the selection rounds.

`Engine` owns one model replica and one shard of the data (raysb.data.shards). Each
epoch's selection, batch forming and lockstep exchange are `SelectionRounds`'
(raysb.training.selection.rounds), the machinery `raysb.SelectiveBackprop` runs in users' own
loops; the engine supplies the chunks, how to load and score them, the learning rate
and the optimizer step. It knows nothing of Ray: a distributed run gives every rank
the same engine with a collective and its own shard.
"""

from __future__ import annotations

import struct
import zlib

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysb.core.batch_former import Batch
from raysb.core.label_doubt import ClassifiedLosses, ClassLogits
from raysb.core.schedules import learning_rate, schedule_progress, warmup_factor
from raysb.core.selectivity import scheduled_selectivity, scheduled_strength, selects
from raysb.core.spec import SelectionSpec
from raysb.core.work_units import work_epochs
from raysb.data import BatchTransform, ImageDataset
from raysb.data.shards import MemoryShard, RawExamples, StreamShard
from raysb.data.streaming import StreamedSplit
from raysb.training.collective import Collective, bare_module
from raysb.training.cuda_graphs import CapturedStep, CaptureRefused
from raysb.training.selection.exchange import Carried
from raysb.training.selection.pipeline import PipelinedSelection
from raysb.training.precision import autocast, gradient_scaler
from raysb.training.selection.rounds import (ChunkLookahead, ChunkRounds, Counters, RoundObserver, SelectionRounds,
                                             WholeEpoch)
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.selection.strategies import Strategy
from raysb.training.timing import PhaseTimer
from raysb.training.trace import SelectionTrace

# On a GPU the training loss is read to the host every this many steps: reading it every step made
# each backward wait for its forward. A CPU has nothing queued to wait for, so it checks every step.
GPU_LOSS_READ_EVERY = 16


@dataclass
class Schedule:
    name: str
    base_lr: float
    # Its length in epochs, the unit of its milestones (OptimizationSettings.schedule_epochs).
    total_epochs: int
    milestones: list
    factor: float
    key: str
    warmup_epochs: float = 0.0
    # The budget a time- or work-keyed schedule ends at.
    time_budget: float | None = None
    work_budget: float | None = None
    # The epochs that end the run (None: a budget alone ends it); given beside a budget, a budget-keyed
    # schedule ends at whichever ends first.
    epochs: int | None = None


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: SelectionSpec,
        strategy: Strategy,
        shard: MemoryShard | StreamShard,
        transform: BatchTransform,
        schedule: Schedule,
        seed: int,
        device: torch.device,
        collective: Collective | None = None,
        scoring_model: torch.nn.Module | None = None,
        scorer: SelectionScorer | None = None,
        trace: SelectionTrace | None = None,
        pipeline: PipelinedSelection | None = None,
        anneal_epochs: int = 0,
        anneal_share: float = 0.0,
        kept_fraction_schedule: str = "constant",
        selection_strength_schedule: str = "constant",
        precision: str = "fp32",
        grad_clip_norm: float | None = None,
        plan_epochs: bool = True,
        capture_training: bool = False,
        uncompiled_model: torch.nn.Module | None = None,
        capture_refused: str | None = None,
        held_out: ImageDataset | None = None,
    ):
        """`collective`: the ranks form batches in lockstep over it (`spec.lockstep`); None is one
        process alone.
        `seed` seeds the data order and augmentation (selection draws from `spec.seed`).
        `precision`: training and evaluation forwards' (raysb.training.precision; a resolved one).
        `grad_clip_norm`: the largest gradient norm a step applies (None: no clipping).
        `kept_fraction_schedule`, `selection_strength_schedule`: how the kept fraction and how strongly
        the keep rule prefers high scores move over the run (raysb.core.selectivity).
        `plan_epochs`: an epoch whose decisions need no forward of their own is decided whole as it
        starts and run as a plain loop (SelectionRounds.plans, then .decision_whole), where its examples
        are held in memory; False runs every epoch in rounds (the same distribution, chunk by chunk).
        `capture_training`: every step runs as one CUDA graph (raysb.training.cuda_graphs; the
        optimizer must be fused), captured at the first; a model that cannot be captured trains
        eagerly, with a notice. `uncompiled_model`: where `model` is compiled only to be captured,
        the module without compiling, captured instead where the compiled one is refused.
        `capture_refused`: why a capture asked for cannot be (a setting a graph cannot hold): the run
        trains eagerly and says so as it starts (`take_notices`).
        `held_out`: the share of the training data held out of training where the strategy's card asks
        for one (raysb.data.prepare.split_holdout), on the device: its loss at each epoch's end goes to
        strategies that watch it, its forwards counted as scored work."""
        self.model = model
        # Selection and evaluation run on the bare module: no DDP hooks, no collectives.
        self.scoring_model = scoring_model or model
        self.scorer = scorer or SelectionScorer(self.scoring_model, device)
        self.optimizer = optimizer
        self.spec = spec
        self.strategy = strategy
        self.shard = shard
        self.transform = transform
        self.schedule = schedule
        self.batch_size = spec.batch_size
        self.anneal_epochs = anneal_epochs
        self.anneal_share = anneal_share
        self.kept_fraction_schedule = kept_fraction_schedule
        self.selection_strength_schedule = selection_strength_schedule
        self.device = device
        self.precision = precision
        self.scaler = gradient_scaler(precision, device)
        self.grad_clip_norm = grad_clip_norm
        self.plan_epochs = plan_epochs
        self.captured_step = CapturedStep(model, optimizer, precision, device, grad_clip_norm) if capture_training else None
        self.uncompiled_model = uncompiled_model
        self._capture_refused: str | None = None
        self._notices: list[str] = []
        if capture_refused is not None:
            self._refuse_capture(capture_refused)
        lockstep = collective is not None
        if lockstep != spec.lockstep:
            raise ValueError(
                f"the selection spec says lockstep={spec.lockstep} but a collective was "
                f"{'given' if lockstep else 'not given'}: ranks in lockstep need one, one process none"
            )
        self.rounds = SelectionRounds(
            spec,
            strategy,
            _cross_entropy_with_margins if _keeps_margins(strategy) else _cross_entropy,
            collective or Collective(),
            PhaseTimer(device),
            load_ids=self.load_ids if lockstep else None,
            carried=self._carried_examples() if lockstep and shard.carries_examples else None,
            loss_read_every=GPU_LOSS_READ_EVERY if device.type == "cuda" else 1,
        )
        self.rounds.clock = {"time": self.timer_seconds, "work": self.work_done}.get(schedule.key)
        # A scored example's cost over a trained one's (raysb.core.work): set before training under a
        # work budget, and carried by checkpoints so a resumed run counts work as it did.
        self.scoring_cost: float | None = None
        self.lr_checksum = 0
        self.chunk_size = self.rounds.chunk_size
        # Data order and augmentation draw from CPU generators so a seed gives
        # the same run on CPU and GPU; the draws are moved to the device.
        self.order_generator = torch.Generator().manual_seed(seed)
        self.augment_generator = torch.Generator().manual_seed(seed + 1)
        self._epoch = 0
        self.trace = trace
        self.pipeline = pipeline
        self.held_out = held_out
        if trace is not None and strategy.selector is not None:
            strategy.selector.observer = lambda *decisions: trace.record_decisions(
                self._epoch + 1, self.counters.optimizer_steps, *decisions
            )

    @property
    def timer(self) -> PhaseTimer:
        return self.rounds.timer

    def timer_seconds(self) -> float:
        return self.timer.host_training_seconds()

    def work_done(self) -> float:
        """This run's work so far, in epochs of training (raysb.core.work), from this rank's counts."""
        counters = self.counters
        return work_epochs(counters.backprop_examples + counters.side_trained_examples,
                           counters.selection_forward_examples + counters.side_forward_examples,
                           self.scoring_cost or 0.0, self.rounds.collective.world_size, self.shard.num_examples)

    @property
    def counters(self) -> Counters:
        return self.rounds.counters

    # -- ChunkContext: how strategies reach data and the model --------------------
    def sample_ids(self, chunk) -> torch.Tensor:
        return self.shard.sample_ids(chunk)

    def load(self, chunk) -> Batch:
        if self.pipeline is not None:
            submitted = self.pipeline.batch_for(chunk)
            if submitted is not None:
                return submitted
        return self.load_raw(self.shard.raw(chunk))

    def load_raw(self, raw: RawExamples) -> Batch:
        """Augment stored examples into training inputs on this rank's device."""
        with self.timer.phase("data"):
            raw = raw.to(self.device)
            inputs = self.transform(raw.images, self.augment_generator, train=True)
            # Only streamed shards send kept examples' images to other ranks.
            columns = {"inputs": inputs, "labels": raw.labels}
            if self.shard.carries_examples:
                columns["images"] = raw.images
            return Batch(raw.sample_ids, columns)

    def _carried_examples(self) -> Carried:
        """Streamed shards cannot gather by id: kept examples travel as labels and uint8 images."""
        return Carried(
            schema={"labels": (torch.int64, ()), "images": (torch.uint8, self.shard.image_shape)},
            columns_of=lambda kept: {"labels": kept["labels"], "images": kept["images"]},
            load=lambda ids, columns: self.load_raw(RawExamples(ids, columns["images"], columns["labels"])),
        )

    def load_ids(self, sample_ids: torch.Tensor) -> Batch:
        """Gather examples by stable id (lockstep ranks train on ids other ranks kept)."""
        return self.load_raw(self.shard.raw_by_ids(sample_ids))

    def score(self, batch: Batch) -> torch.Tensor:
        """Selection forward: eval mode so BatchNorm statistics are not moved by scoring."""
        losses = None
        if self.pipeline is not None:
            losses = self.pipeline.losses_for(batch, self.counters.optimizer_steps)
        if losses is None:
            losses = self.scorer(batch["inputs"], batch["labels"], self.counters.optimizer_steps)
        return losses

    # -- training -------------------------------------------------------------------
    def train_epoch(self, epoch: int, should_stop: Callable[[int, int], bool] | None = None) -> bool:
        """Train one epoch; returns True if `should_stop(epoch, round_index)` (rank 0's) ended it early."""
        self._epoch = epoch
        self._set_selection_schedules(epoch)
        select = self.selects(epoch)
        scoring_ahead = self.pipeline is not None and select and self.strategy.scores_whole_chunks(epoch)
        self.scorer.new_epoch()
        if self.pipeline is not None:
            self.pipeline.new_epoch()
        observer = _EngineRounds(self, select, scoring_ahead, should_stop)
        with self.timer.phase("data"):
            if self.plan_epochs and not self.shard.carries_examples:
                order = self._epoch_order()
                # An epoch that does not select asks no strategy (every rank knows it is one).
                planned = not select or self.rounds.plans(epoch, self.shard.sample_ids(order))
                source = WholeEpoch(order, self.shard.device) if planned else ChunkRounds(
                    self._lookahead(iter(order.split(self.chunk_size)), scoring_ahead))
            else:
                source = ChunkRounds(self._lookahead(self.shard.epoch_chunks(self.chunk_size, self.order_generator),
                                                     scoring_ahead))
        for batch in self.rounds.epoch(epoch, source, self, select=select, observer=observer):
            self.train_step(batch)
        if self.rounds.stop_requested and self.pipeline is not None:
            self.pipeline.discard()
        if self.trace is not None:
            with self.timer.phase("probes"):  # raysb report's counts, not training
                self.trace.close_epoch()
        if self.held_out is not None and self.strategy.watches_held_out():
            counts = self.rounds.progress_counts()
            if counts["epoch_steps"]:  # not an epoch a budget ended before its first step
                trained_loss = counts["epoch_loss_sum"] / counts["epoch_steps"]
                line = self.strategy.observe_held_out_loss(epoch, self.held_out_loss(), trained_loss)
                if line is not None:
                    self.notice(line)
        return self.rounds.stop_requested

    def held_out_loss(self) -> float:
        """The mean loss on the held-out split: a forward the method spends, timed as selection and
        counted as scored work."""
        with self.timer.phase("selection"):
            self.counters.side_forward_examples += len(self.held_out)
            return float(self.example_losses(self.held_out, self.batch_size).mean())

    def _epoch_order(self):
        """This rank's examples of the epoch, in its order: its shard's, or where its loss table is
        sharded, the ones it owns (it alone holds their scores; the others reach it by the exchange)."""
        table = self.strategy.loss_table()
        if table is not None and table.sharded:
            return self.shard.owned_order(self.order_generator, table.owns)
        return self.shard.epoch_order(self.order_generator)

    def _lookahead(self, chunks, scoring_ahead: bool) -> ChunkLookahead:
        return ChunkLookahead(
            chunks,
            self.shard.empty_chunk,
            self.timer,
            (lambda chunk: self.pipeline.submit(chunk, self._synced_load(chunk))) if scoring_ahead else None,
            self.pipeline.depth if scoring_ahead else 1,
        )

    def _set_selection_schedules(self, epoch: int) -> None:
        """The kept fraction and the keep rule's strength that the schedules set as `epoch` starts."""
        if self.kept_fraction_schedule == self.selection_strength_schedule == "constant":
            return
        lr_share = self.lr_share()
        if self.kept_fraction_schedule != "constant":
            selectivity = scheduled_selectivity(self.kept_fraction_schedule, self.spec.selectivity, lr_share)
            self.strategy.set_selectivity(epoch, selectivity)
        if self.selection_strength_schedule != "constant":
            self.strategy.set_selection_strength(epoch, scheduled_strength(self.selection_strength_schedule, lr_share))

    def _synced_load(self, chunk) -> Batch:
        """A chunk's batch for the pipeline's scorer, whose model copy is first brought up to date."""
        self.pipeline.sync(self.scoring_model, self.counters.optimizer_steps)
        return self.load(chunk)

    def start_training_clock(self, startup_seconds: float, restored: bool) -> None:
        """Time from here on is training: setup before it (data, model, worker group), `startup_seconds`
        long, is start-up. A `restored` clock runs on from its checkpoint's time."""
        if not restored:
            self.rounds.timer = PhaseTimer(self.device)  # phases timed in setup are not the run's
        self.timer.start(startup_seconds)

    def selects(self, epoch: int) -> bool:
        """Whether `epoch` selects at all (raysb.core.selectivity.selects): not while priming, not
        while annealing to the full data, not where the strategy anneals by its own rule."""
        progress = self.progress()
        return selects(epoch, progress, first_epoch=self.spec.first_epoch, total_epochs=self.schedule.epochs,
                       anneal_epochs=self.anneal_epochs, anneal_share=self.anneal_share,
                       strategy_anneals=self.strategy.anneals(epoch, progress))

    def train_step(self, batch: Batch) -> None:
        lr = self.current_lr()
        # Every step's lr in one number, so ranks can show they stepped with the same ones.
        self.lr_checksum = zlib.crc32(struct.pack("<d", lr), self.lr_checksum)
        if self.captured_step is not None and self._captured(batch):
            self.captured_step.set_lr(lr)
            self.rounds.whole_step(batch, self._replayed)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(self.precision, self.device):
            loss = self.rounds.loss(self.model, batch)
        with self.timer.phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            # Without fp16 the scaler is off: scale() and step() are the plain backward and step.
            self.scaler.scale(loss).backward()
            if self.grad_clip_norm is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16's scaled ones
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def _captured(self, batch: Batch) -> bool:
        """Whether `batch` trains as the captured step: captured at the first step (timed as a training
        step, so a time budget counts it), which, where the model cannot be captured, trains eagerly
        from then on and says why."""
        with self.timer.phase("train_step"):
            return self.ensure_captured(batch["inputs"], batch["labels"], batch.weights)

    def ensure_captured(self, inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Whether the step is captured, capturing it for batches shaped as these where it is not yet."""
        step = self.captured_step
        if step is None or step.captured:
            return step is not None
        try:
            step.capture(inputs, labels, weights)
            return True
        except CaptureRefused as refused:
            reason = str(refused)
        if self.uncompiled_model is not None:
            # The compile was raysb's choice, not the user's: capture the plain module instead.
            self.model, self.uncompiled_model = self.uncompiled_model, None
            self.captured_step = CapturedStep(self.model, self.optimizer, self.precision, self.device,
                                              self.grad_clip_norm)
            try:
                self.captured_step.capture(inputs, labels, weights)
                self._notices.append(f"raysb: training step captured without torch.compile (compiled: {reason})")
                return True
            except CaptureRefused as refused:
                reason = f"compiled: {reason}; uncompiled: {refused}"
        self._refuse_capture(reason)
        return False

    def _refuse_capture(self, reason: str) -> None:
        self.captured_step, self._capture_refused = None, reason
        self._notices.append(f"raysb: training step not captured as a CUDA graph ({reason}): training eagerly")

    def _replayed(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, ClassLogits]:
        return self.captured_step(batch["inputs"], batch["labels"], batch.weights)

    def graphs(self) -> list:
        """The CUDA graphs (raysb.training.cuda_graphs.GraphedFunction) this engine replays: its step's, its scorer's."""
        step, scoring = self.captured_step, self.scorer.captured
        return [*(step.captured_graphs() if step is not None else []),
                *(scoring.captured_graphs() if scoring is not None else [])]

    def notice(self, line: str) -> None:
        """A line for the run's console, shown with the next notices (`take_notices`)."""
        self._notices.append(line)

    def take_notices(self) -> list[str]:
        """Lines for the run's console since the last call: how the device trains (a refused capture)."""
        notices, self._notices = self._notices, []
        return notices

    @property
    def compiled_training(self) -> bool:
        return hasattr(self.model, "_orig_mod")  # torch.compile's wrapper (raysb.training.collective.bare_module)

    def capture_stats(self) -> dict:
        """How the training step ran, for the run's summary."""
        step = self.captured_step
        stats = {"captured_training": step is not None and step.captured, "compiled_training": self.compiled_training}
        if step is not None:
            stats.update(training_captures=step.captures, training_capture_s=round(step.capture_seconds, 3))
        if self._capture_refused is not None:
            stats["training_capture_refused"] = self._capture_refused
        return stats

    def progress(self) -> float:
        """How much of the run is done, in [0, 1], as the schedule counts it (ChunkContext)."""
        return min(1.0, self._schedule_progress() / self.schedule.total_epochs)

    def _schedule_progress(self) -> float:
        s = self.schedule
        return schedule_progress(
            s.key,
            # The running epoch in part: an epoch-keyed lr moves every step, not once an epoch.
            self._epoch + self.rounds.epoch_share(self.shard.num_examples, self._epoch),
            self._run_backprop_examples(),
            self.shard.num_examples,
            # Rank 0's clock (seconds, or work) at the last exchange, the same on every rank.
            training_seconds=self.rounds.exchange.leader_clock_s,
            time_budget=s.time_budget,
            total_epochs=s.total_epochs,
            work_done=self.rounds.exchange.leader_clock_s,
            work_budget=s.work_budget,
            epochs_end_run=s.epochs is not None,
        )

    def agreed_epoch_end(self, budget_spent: bool) -> bool:
        """Rank 0's `budget_spent` as the epoch ends, with its schedule clock, taken up by every rank (a
        collective): what the schedule reads from here on is its value at the epoch's end."""
        clock = self.rounds.clock() if self.rounds.clock is not None else 0.0
        spent, self.rounds.exchange.leader_clock_s = self.rounds.collective.broadcast_object((budget_spent, clock))
        return spent

    def lr_share(self) -> float:
        """The lr's share of its peak now (warmup aside): what the selection schedules follow."""
        s = self.schedule
        return learning_rate(s.name, 1.0, self._schedule_progress(), s.total_epochs, s.milestones, s.factor)

    def current_lr(self) -> float:
        s = self.schedule
        progress = self._schedule_progress()
        world = self.rounds.collective.world_size
        warmup = warmup_factor(
            self._run_backprop_examples(), world * self.batch_size, self.shard.num_examples, s.warmup_epochs
        )
        return warmup * learning_rate(s.name, s.base_lr, progress, s.total_epochs, s.milestones, s.factor)

    def _run_backprop_examples(self) -> int:
        """Every rank's backpropagated examples: lockstep ranks take the same steps of b. (Counted from
        this rank's alone against the whole training set, N workers warmed up N times slower.)"""
        return self.rounds.collective.world_size * self.counters.backprop_examples

    def progress_counts(self) -> dict[str, float]:
        return self.rounds.progress_counts()

    # -- evaluation -----------------------------------------------------------------
    def example_losses(self, data: ImageDataset, batch_size: int) -> torch.Tensor:
        """Each of `data`'s examples' loss under the bare model in eval mode, unaugmented, without
        autograd, on the device (held-out losses, irreducible ones)."""
        with torch.inference_mode():
            return torch.cat([F.cross_entropy(logits, labels, reduction="none")
                              for logits, labels in self._eval_logits(data, batch_size)])

    def evaluate(self, test_data: ImageDataset | StreamedSplit, batch_size: int) -> tuple[float, float]:
        """Test error and mean loss; timed as evaluation, so excluded from training time."""
        with self.timer.phase("evaluation"), torch.inference_mode():
            # Summed on the device, read once at the end: no host sync per batch.
            wrong = torch.zeros((), dtype=torch.int64, device=self.device)
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for logits, labels in self._eval_logits(test_data, batch_size):
                loss_sum += F.cross_entropy(logits, labels, reduction="sum")
                wrong += (logits.argmax(1) != labels).sum()
            return int(wrong) / len(test_data), float(loss_sum) / len(test_data)

    def _eval_logits(self, data: ImageDataset | StreamedSplit, batch_size: int):
        """Each batch of `data` as (fp32 logits, labels) on the device, under the bare model in eval
        mode and unaugmented; the caller holds autograd off."""
        self.scoring_model.eval()
        for images, labels in data.batches(batch_size):
            images, labels = images.to(self.device), labels.to(self.device)
            with autocast(self.precision, self.device):
                logits = self.scoring_model(self.transform(images, None, train=False))
            yield logits.float(), labels

    # -- checkpointing ----------------------------------------------------------------
    # A checkpoint is taken at an epoch boundary and continues bit-for-bit. Under
    # data parallelism it has two parts: the shared state, equal on every rank
    # (DDP keeps parameters, and so the optimizer, in step), and each rank's own.
    def shared_state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        for group in optimizer["param_groups"]:  # a captured step's lr is a device tensor: saved as a float
            group["lr"] = float(group["lr"])
        return {
            "model": bare_module(self.model).state_dict(),
            "optimizer": optimizer,
            "scaler": self.scaler.state_dict(),
            "scoring_cost": self.scoring_cost,
        }

    def rank_state_dict(self) -> dict:
        """What may differ between ranks, on the CPU so it can travel to rank 0.

        Buffers are here because DDP broadcasts rank 0's only at the start of each
        training forward, which then moves every rank's BatchNorm statistics by its
        own batch; selection scores in eval mode with those statistics, so a rank
        restored with rank 0's would keep other examples than it did.
        """
        return {
            "buffers": {name: buffer.detach().cpu().clone() for name, buffer in bare_module(self.model).named_buffers()},
            "selection": self.rounds.state_dict(),
            "order_generator": self.order_generator.get_state(),
            "augment_generator": self.augment_generator.get_state(),
        }

    def load_state_dict(self, shared: dict, rank: dict) -> None:
        model = bare_module(self.model)
        model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        if self.captured_step is not None:
            self.captured_step.invalidate()  # the optimizer's state tensors are new ones
        self.scaler.load_state_dict(shared["scaler"])
        self.scoring_cost = shared.get("scoring_cost")  # absent from checkpoints made before work budgets
        with torch.no_grad():
            for name, value in rank["buffers"].items():
                model.get_buffer(name).copy_(value)
        self.rounds.load_state_dict(rank["selection"])
        self.order_generator.set_state(rank["order_generator"])
        self.augment_generator.set_state(rank["augment_generator"])


class _EngineRounds(RoundObserver):
    """The engine's part in each round: the trace's counts, the pipeline's unused scores, the run's stop vote."""

    def __init__(self, engine: Engine, select: bool, scoring_ahead: bool, should_stop):
        self.engine, self.select, self.scoring_ahead = engine, select, scoring_ahead
        self.stop = should_stop

    def chosen(self, chunk, kept_ids: torch.Tensor) -> None:
        if self.scoring_ahead:
            self.engine.pipeline.release(chunk)
        # A primed or annealed epoch trains on everything without choosing;
        # counting it would show every example as kept at least once.
        if self.engine.trace is not None and self.select:
            self.engine.trace.record_chunk(self.engine.sample_ids(chunk), kept_ids)

    def should_stop(self, epoch: int, round_index: int) -> bool:
        return self.stop is not None and self.stop(epoch, round_index)


def _keeps_margins(strategy: Strategy) -> bool:
    table = strategy.loss_table()
    return table is not None and table.tracks_margins


def _cross_entropy(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["inputs"]), batch["labels"], reduction="none")


def _cross_entropy_with_margins(model: torch.nn.Module, batch: Batch) -> ClassifiedLosses:
    # The margins come from the logits this forward computes anyway: each trained example's signal of a
    # wrong label costs no forward, and the step no operation (the table computes them at its flush).
    logits = model(batch["inputs"])
    return ClassifiedLosses(F.cross_entropy(logits, batch["labels"], reduction="none"),
                            ClassLogits.of(logits, batch["labels"]))
