"""The training loop: selection chunks -> kept examples -> full batches -> optimizer steps.

`Engine` owns one model replica and one shard of the data (raysb.data.shards). It
knows nothing of Ray: a distributed run gives every rank the same engine with a
lockstep `Batching` policy and its own shard (see raysb.training.batching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from raysb.core.batch_former import Batch
from raysb.core.schedules import learning_rate, schedule_progress, warmup_factor
from raysb.core.selection import NonFiniteLossError, check_finite, staleness_weights
from raysb.data import BatchTransform, ImageDataset
from raysb.data.shards import MemoryShard, RawExamples, StreamShard
from raysb.data.streaming import StreamedSplit
from raysb.training.batching import Batching, Carried, LocalBatching, LockstepBatching
from raysb.training.collective import Collective
from raysb.training.pipeline import PipelinedSelection
from raysb.training.scoring import SelectionScorer
from raysb.training.strategies import Strategy
from raysb.training.timing import PhaseTimer
from raysb.training.trace import SelectionTrace


@dataclass
class Counters:
    """Cumulative example and step counts of a run."""

    selection_forward_examples: int = 0
    train_forward_examples: int = 0
    backprop_examples: int = 0
    optimizer_steps: int = 0
    examples_considered: int = 0
    examples_kept: int = 0


@dataclass
class Schedule:
    name: str
    base_lr: float
    total_epochs: int
    milestones: list
    factor: float
    key: str
    warmup_epochs: float = 0.0


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        shard: MemoryShard | StreamShard,
        transform: BatchTransform,
        schedule: Schedule,
        batch_size: int,
        selection_batch_size: int,
        prime_epochs: int,
        seed: int,
        device: torch.device,
        lockstep: Collective | None = None,
        scoring_model: torch.nn.Module | None = None,
        scorer: SelectionScorer | None = None,
        trace: SelectionTrace | None = None,
        pipeline: PipelinedSelection | None = None,
        anneal_epochs: int = 0,
        staleness_correction: bool = False,
    ):
        self.model = model
        # Selection and evaluation run on the bare module: no DDP hooks, no collectives.
        self.scoring_model = scoring_model or model
        self.scorer = scorer or SelectionScorer(self.scoring_model, device)
        self.optimizer = optimizer
        self.strategy = strategy
        self.shard = shard
        self.transform = transform
        self.schedule = schedule
        self.batch_size = batch_size
        self.chunk_size = strategy.chunk_size(batch_size, selection_batch_size)
        self.prime_epochs = prime_epochs
        self.anneal_epochs = anneal_epochs
        self.staleness_correction = staleness_correction and strategy.selector is not None
        self.device = device
        self.counters = Counters()
        self.timer = PhaseTimer(device)
        # Ranks in lockstep agree on every round over `lockstep`; one process forms batches alone.
        self.batching: Batching = (
            LocalBatching(batch_size)
            if lockstep is None
            else LockstepBatching(
                lockstep,
                batch_size,
                self.load_ids,
                strategy.loss_table(),
                self.chunk_size,
                carried=self._carried_examples() if shard.carries_examples else None,
            )
        )
        # Data order and augmentation draw from CPU generators so a seed gives
        # the same run on CPU and GPU; the draws are moved to the device.
        self.order_generator = torch.Generator().manual_seed(seed)
        self.augment_generator = torch.Generator().manual_seed(seed + 1)
        self._epoch = 0
        self._step_in_epoch = 0
        self._loss_sum = 0.0
        self.trace = trace
        self.pipeline = pipeline
        if trace is not None and strategy.selector is not None:
            strategy.selector.observer = lambda *decisions: trace.record_decisions(
                self._epoch + 1, self.counters.optimizer_steps, *decisions
            )

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
            raw_images = raw.images if self.shard.carries_examples else None
            return Batch(raw.sample_ids, inputs, raw.labels, raw_images=raw_images)

    def _carried_examples(self) -> Carried:
        """Streamed shards cannot gather by id: kept examples travel as labels and uint8 images."""
        return Carried(
            schema={"labels": (torch.int64, ()), "images": (torch.uint8, self.shard.image_shape)},
            columns_of=lambda kept: {"labels": kept.labels, "images": kept.raw_images},
            load=lambda ids, columns: self.load_raw(RawExamples(ids, columns["images"], columns["labels"])),
        )

    def load_ids(self, sample_ids: torch.Tensor) -> Batch:
        """Gather examples by stable id (lockstep ranks train on ids other ranks kept)."""
        return self.load_raw(self.shard.raw_by_ids(sample_ids))

    def score(self, batch: Batch) -> torch.Tensor:
        """Selection forward: eval mode so BatchNorm statistics are not moved by scoring."""
        with self.timer.phase("selection"):
            losses = None
            if self.pipeline is not None:
                losses = self.pipeline.losses_for(batch, self.counters.optimizer_steps)
            if losses is None:
                losses = self.scorer(batch.inputs, batch.labels, self.counters.optimizer_steps)
            self.counters.selection_forward_examples += len(batch)
            check_finite(losses, self._where())
            return losses.float()

    # -- training -------------------------------------------------------------------
    def train_epoch(self, epoch: int, should_stop=lambda: False) -> bool:
        """Train one epoch; returns True if `should_stop` ended it early.

        Every rank takes part in every round's exchange (one round per selection
        chunk), whatever it kept or hit. A rank whose chunks run out before the
        others' (streamed shards may differ by a batch) joins the remaining
        rounds with nothing kept; each round says whether a rank has more, so
        the epoch ends on the same round everywhere.
        """
        self._epoch, self._step_in_epoch, self._loss_sum = epoch, 0, 0.0
        self._epoch_considered = self._epoch_kept = self._epoch_steps = 0
        plain_sgd = self.trains_on_everything(epoch)
        scoring_ahead = self.pipeline is not None and not plain_sgd and self.strategy.scores_whole_chunks(epoch)
        self.scorer.new_epoch()
        if self.pipeline is not None:
            self.pipeline.new_epoch()
        with self.timer.phase("data"):
            chunks = self.shard.epoch_chunks(self.chunk_size, self.order_generator)
        upcoming = ChunkLookahead(
            chunks,
            self.shard.empty_chunk,
            self.timer,
            (lambda chunk: self.pipeline.submit(chunk, self._synced_load(chunk))) if scoring_ahead else None,
            self.pipeline.depth if scoring_ahead else 1,
        )
        while True:
            chunk = upcoming.next()
            error = None
            with self.timer.phase("bookkeeping"):
                try:
                    kept = self.load(chunk) if plain_sgd else self.strategy.choose(epoch, chunk, self)
                except NonFiniteLossError as failure:
                    error, kept = str(failure), self.load(chunk[:0])
                if scoring_ahead:
                    self.pipeline.release(chunk)
                # A primed or annealed epoch trains on everything without choosing;
                # counting it would show every example as kept at least once.
                if self.trace is not None and not plain_sgd:
                    self.trace.record_chunk(self.sample_ids(chunk), kept.sample_ids)
            self._epoch_considered += len(chunk)
            self._epoch_kept += len(kept)
            batches = self.batching.ready_batches(kept, should_stop(), error, upcoming.exhausted)
            while True:
                with self.timer.phase("bookkeeping"):
                    batch = next(batches, None)
                if batch is None:
                    break
                self.train_step(batch)
            if self.batching.stop_requested:
                if self.pipeline is not None:
                    self.pipeline.discard()
                self._close_epoch()
                return True
            if self.batching.epoch_finished:
                self._close_epoch()
                return False

    def _synced_load(self, chunk) -> Batch:
        """A chunk's batch for the pipeline's scorer, whose model copy is first brought up to date."""
        self.pipeline.sync(self.scoring_model, self.counters.optimizer_steps)
        return self.load(chunk)

    def start_training_clock(self) -> None:
        """Time from here on is training: setup before it (data, model, worker group) is not."""
        self.timer = PhaseTimer(self.device)

    def trains_on_everything(self, epoch: int) -> bool:
        """Plain SGD: while priming the first epochs, and annealing to the full data in the last."""
        return epoch < self.prime_epochs or epoch >= self.schedule.total_epochs - self.anneal_epochs

    def _close_epoch(self) -> None:
        self.counters.examples_considered += self._epoch_considered
        self.counters.examples_kept += self._epoch_kept
        if self.trace is not None:
            self.trace.close_epoch()

    def train_step(self, batch: Batch) -> None:
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with self.timer.phase("train_forward"):
            losses = F.cross_entropy(self.model(batch.inputs), batch.labels, reduction="none")
            loss = self.batch_loss(losses, batch)
            # Agreed across ranks before backward: a rank that skipped it would leave
            # the others waiting in DDP's gradient all-reduce.
            if not self.batching.agree_finite(bool(torch.isfinite(loss))):
                raise NonFiniteLossError(
                    f"training loss is not finite (here {float(loss.detach())}) at {self._where()}"
                )
        with self.timer.phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.strategy.observe_training_losses(losses.detach())
        self.counters.train_forward_examples += len(batch)
        self.counters.backprop_examples += len(batch)
        self.counters.optimizer_steps += 1
        self._step_in_epoch += 1
        self._epoch_steps += 1
        self._loss_sum += float(loss.detach())

    def batch_loss(self, losses: torch.Tensor, batch: Batch) -> torch.Tensor:
        if batch.weights is not None:
            return (losses * batch.weights).mean()
        if self.staleness_correction and batch.keep_probabilities is not None:
            # The training forward's own losses say what selection would keep now.
            now = self.strategy.selector.probabilities_now(losses)
            weights = staleness_weights(now, batch.keep_probabilities)
            # Self-normalised: the step keeps its size however stale the batch was.
            return (losses * weights).sum() / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
        return losses.mean()

    def current_lr(self) -> float:
        s = self.schedule
        progress = schedule_progress(
            s.key, self._epoch, self.counters.backprop_examples, self.shard.num_examples
        )
        warmup = warmup_factor(
            self.counters.backprop_examples, self.batch_size, self.shard.num_examples, s.warmup_epochs
        )
        return warmup * learning_rate(s.name, s.base_lr, progress, s.total_epochs, s.milestones, s.factor)

    def progress_counts(self) -> dict[str, float]:
        """Cumulative counters plus this epoch's, all additive so ranks can sum them."""
        return {
            **self.counters_dict(),
            "epoch_kept": self._epoch_kept,
            "epoch_considered": self._epoch_considered,
            "epoch_steps": self._epoch_steps,
            "epoch_loss_sum": self._loss_sum,
        }

    def _where(self) -> str:
        return f"epoch {self._epoch + 1}, step {self._step_in_epoch + 1}"

    # -- evaluation -----------------------------------------------------------------
    def evaluate(self, test_data: ImageDataset | StreamedSplit, batch_size: int) -> tuple[float, float]:
        """Test error and mean loss; timed as evaluation, so excluded from training time."""
        with self.timer.phase("evaluation"):
            self.scoring_model.eval()
            wrong, loss_sum = 0, 0.0
            with torch.inference_mode():
                for images, labels in test_data.batches(batch_size):
                    images, labels = images.to(self.device), labels.to(self.device)
                    logits = self.scoring_model(self.transform(images, None, train=False))
                    loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
                    wrong += int((logits.argmax(1) != labels).sum())
            return wrong / len(test_data), loss_sum / len(test_data)

    def counters_dict(self) -> dict[str, int]:
        return asdict(self.counters)

    # -- checkpointing ----------------------------------------------------------------
    # A checkpoint is taken at an epoch boundary and continues bit-for-bit. Under
    # data parallelism it has two parts: the shared state, equal on every rank
    # (DDP keeps parameters, and so the optimizer, in step), and each rank's own.
    def shared_state_dict(self) -> dict:
        return {"model": _bare(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def rank_state_dict(self) -> dict:
        """What may differ between ranks, on the CPU so it can travel to rank 0.

        Buffers are here because DDP broadcasts rank 0's only at the start of each
        training forward, which then moves every rank's BatchNorm statistics by its
        own batch; selection scores in eval mode with those statistics, so a rank
        restored with rank 0's would keep other examples than it did.
        """
        return {
            "buffers": {name: buffer.detach().cpu().clone() for name, buffer in _bare(self.model).named_buffers()},
            "strategy": self.strategy.state_dict(),
            "batching": self.batching.state_dict(),
            "counters": self.counters_dict(),
            "order_generator": self.order_generator.get_state(),
            "augment_generator": self.augment_generator.get_state(),
            "timer": self.timer.state_dict(),
        }

    def load_state_dict(self, shared: dict, rank: dict) -> None:
        model = _bare(self.model)
        model.load_state_dict(shared["model"])
        self.optimizer.load_state_dict(shared["optimizer"])
        with torch.no_grad():
            for name, value in rank["buffers"].items():
                model.get_buffer(name).copy_(value)
        self.strategy.load_state_dict(rank["strategy"])
        self.batching.load_state_dict(rank["batching"])
        self.counters = Counters(**rank["counters"])
        self.order_generator.set_state(rank["order_generator"])
        self.augment_generator.set_state(rank["augment_generator"])
        self.timer.load_state_dict(rank["timer"])


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


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DistributedDataParallel wrapper, so checkpoints load anywhere."""
    return getattr(model, "module", model)
