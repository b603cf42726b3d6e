"""Selective-Backprop for any training loop: one process, or every rank of a Ray Train job.

    sb = SelectiveBackprop(per_example_loss, batch_size=64, selectivity=0.33)
    for epoch in range(epochs):
        for batch in sb.batches(model, loader):   # exactly 64 kept examples on every rank
            loss = sb.loss(model, batch)          # their mean loss, weighted where selection needs it
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ray.train.report(sb.metrics())

`per_example_loss(model, batch)` returns one loss per example of `batch`, which reads
like the dict of tensors the data gave (`batch["label"]`). It is called without
autograd in eval mode to score examples, and in train mode by `loss`. The source is
any iterable of dict batches: a Ray Data shard's `iter_torch_batches`, a DataLoader,
a list. Its batches are cut into selection chunks; each chunk is scored, ranked
against CDF_R and its kept examples queue until b are waiting.

On Ray Train ranks (torch.distributed initialized) the ranks rank losses against one
shared CDF_R (raysb.distributed.loss_history) and exchange kept examples, all their
columns, after every chunk, so that every rank takes the same number of steps of
exactly b and no kept example is lost (raysb.training.batching). A bad batch or loss
on one rank stops every rank at the same round with the same error.

raysb's own trainer (raysb.training.engine) runs its epochs through this class too,
with its image data as the chunks and its scorer (int8, pipelined) as the scores.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from raysb.core.batch_former import Batch
from raysb.core.columns import ColumnSchema, empty_columns, schema_of
from raysb.core.errors import AgreedError, BadBatchError, NonFiniteLossError
from raysb.core.selection import check_finite, staleness_weights
from raysb.core.selectivity import resolve_beta
from raysb.training.batching import Batching, Carried, LocalBatching, LockstepBatching
from raysb.training.collective import Collective, TorchCollective
from raysb.training.strategies import ChunkContext, Strategy, build_strategy
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


class SelectiveBackprop:
    def __init__(
        self,
        loss_fn: LossFunction,
        batch_size: int,
        *,
        selectivity: float | None = None,
        beta: float | None = None,
        strategy: str | Strategy = "sb",
        staleness: int = 3,
        selection_batch_size: int | None = None,
        history_size: int = 1024,
        keep_floor: float = 0.0,
        staleness_correction: bool | str = "auto",
        id_column: str | None = None,
        columns: Iterable[str] | None = None,
        seed: int = 0,
        kath18_reweight: bool = False,
        score_fn: LossFunction | None = None,
        collective: Collective | None = None,
        history=None,
        load_ids: Callable[[torch.Tensor], Batch] | None = None,
        carried: Carried | None = None,
        timer: PhaseTimer | None = None,
    ):
        """
        loss_fn: `loss_fn(model, batch)` -> a tensor of one loss per example of `batch`.
        batch_size: b, the examples of every training step on every rank.
        selectivity / beta: the expected kept fraction s, or beta (s = 1 / (beta + 1)); default s = 1/3.
        strategy: "sb", "stale-sb" (selection passes every `staleness`-th epoch, recorded losses
            reused in between; needs `id_column`), "traditional" or "kath18".
        selection_batch_size: examples scored per selection round (default b). Larger rounds
            cost less bookkeeping; their scores then feed several steps.
        staleness_correction: weight kept examples by their keep probability now over the one they
            were kept with ("auto": where scores feed later steps, a selection batch > b).
        id_column: a column of stable integer example ids; needed by stale-sb only.
        columns: the columns to use, by name: batches missing one are an error, others are
            dropped. Tuple batches (a DataLoader over a TensorDataset) are named by position.
        score_fn: `score_fn(model, batch)` -> the per-example losses selection ranks, if not
            loss_fn's (a cheaper proxy: a smaller model, downsampled inputs). Called like
            loss_fn for scoring: eval mode, no autograd, on the bare module.
        collective / history: found by themselves on Ray Train ranks (torch.distributed and
            the shared CDF_R actor); give them to run elsewhere.
        load_ids / carried / timer: how raysb's own trainer plugs in its data and clock.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.score_fn = score_fn or loss_fn
        self.batch_size = batch_size
        self.id_column = id_column
        self.columns = None if columns is None else list(columns)
        self.collective = collective if collective is not None else _found_collective()
        lockstep = self.collective.world_size > 1 or collective is not None
        if isinstance(strategy, str):
            beta = resolve_beta(beta, 1.0 / 3.0 if selectivity is None and beta is None else selectivity)
            if strategy == "stale-sb" and id_column is None:
                raise ValueError("strategy stale-sb reuses each example's last loss: name its id column (id_column=...)")
            if history is None and lockstep and strategy in ("sb", "stale-sb"):
                history = _shared_history(self.collective, history_size)
            strategy = build_strategy(
                strategy, batch_size, beta=beta, seed=seed, history=history, history_size=history_size,
                keep_floor=keep_floor, staleness=staleness, kath18_reweight=kath18_reweight,
            )
        self.strategy = strategy
        selection_batch_size = selection_batch_size or batch_size
        self.chunk_size = strategy.chunk_size(batch_size, selection_batch_size)
        if staleness_correction == "auto":
            staleness_correction = selection_batch_size > batch_size
        elif staleness_correction not in (True, False):
            raise ValueError(f"staleness_correction must be True, False or 'auto', got {staleness_correction!r}")
        self.staleness_correction = bool(staleness_correction) and strategy.selector is not None
        self.timer = timer or PhaseTimer(torch.device("cpu"))
        self.counters = Counters()
        self.load_ids, self.carried = load_ids, carried
        self.device = torch.device("cpu")
        self.schema: ColumnSchema | None = None
        self.batching: Batching | None = None
        if not lockstep:
            self.batching = LocalBatching(batch_size)
        elif load_ids is not None or carried is not None:
            self.batching = self._lockstep()
        self.epochs_started = 0
        self.next_sample_id = 0
        self.stop_requested = False
        self._in_epoch = False
        self._new_epoch_counts()

    # -- a user's loop ------------------------------------------------------------------
    def batches(
        self,
        model: torch.nn.Module,
        source: Iterable,
        *,
        select: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[Batch]:
        """One epoch of training batches of exactly b from `source` (this rank's data).

        `select=False` trains on every example (plain SGD epochs, e.g. the first).
        `should_stop()` is asked by rank 0 before every round; once it says so, every
        rank ends the epoch at the same round and `stop_requested` is set.
        Train on each batch with `loss` before asking for the next.
        """
        self.device = device = _device_of(model)
        epoch = self.epochs_started
        items = iter(source)
        with self.timer.phase("data"):
            first = next(items, None)
        if self.schema is None:
            self._agree_schema(first)
        raw = itertools.chain([] if first is None else [first], items)
        chunks = _rechunk(self._checked(raw, epoch), self.chunk_size)
        context = _UserContext(self, model, device)
        upcoming = ChunkLookahead(chunks, self._empty_chunk, self.timer)
        yield from self.rounds(epoch, upcoming, context, select=select, should_stop=should_stop)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The loss to backpropagate for `batch`: its examples' mean loss, weighted where
        selection asks for it (Kath18 reweighting, the staleness correction).

        Checked on every rank before it returns: if any rank's loss is not finite, or its
        loss function failed, every rank raises the same error here, before backward.
        """
        model.train()
        failure: AgreedError | None = None
        with self.timer.phase("train_forward"):
            try:
                losses = _called(self.loss_fn, model, batch, "training")
                _check_per_example(losses, len(batch), "training")
                loss = self.batch_loss(losses, batch)
                if not bool(torch.isfinite(loss)):
                    failure = NonFiniteLossError(
                        f"training loss is not finite (here {float(loss.detach())}) at {self._where()}"
                    )
            except AgreedError as error:
                failure = error
            # Agreed before backward: a rank that skipped it would leave the others
            # waiting in DDP's gradient all-reduce.
            self.batching.agree(failure)
        self.strategy.observe_training_losses(losses.detach())
        self.counters.train_forward_examples += len(batch)
        self.counters.backprop_examples += len(batch)
        self.counters.optimizer_steps += 1
        self._step_in_epoch += 1
        self._epoch_steps += 1
        self._loss_sum += float(loss.detach())
        return loss

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

    def metrics(self) -> dict[str, float]:
        """This rank's counts and time split, for `ray.train.report` (steps are equal on every rank)."""
        counts = self.counters_dict()
        split = self.timer.breakdown()
        return {
            "epochs": self.epochs_started,
            **counts,
            "kept_fraction": counts["examples_kept"] / counts["examples_considered"]
            if counts["examples_considered"] else 0.0,
            "epoch_kept_fraction": self._epoch_kept / self._epoch_considered if self._epoch_considered else 0.0,
            "epoch_steps": self._epoch_steps,
            "epoch_train_loss": self._loss_sum / self._epoch_steps if self._epoch_steps else float("nan"),
            "unused_kept_examples": self.batching.queued() if self.batching is not None else 0,
            "wall_s": self.timer.training_seconds(),
            **{f"time_{phase}_s": seconds for phase, seconds in split.items() if phase != "backward"},
        }

    # -- the rounds of an epoch, shared with raysb's own trainer ------------------------
    def rounds(
        self,
        epoch: int,
        upcoming: ChunkLookahead,
        context: ChunkContext,
        *,
        select: bool = True,
        should_stop: Callable[[], bool] | None = None,
        after_choice: Callable[[object, Batch], None] | None = None,
    ) -> Iterator[Batch]:
        """Select from each chunk of `upcoming`, exchange kept examples, yield full batches.

        Every rank takes part in every round's exchange (one round per selection chunk),
        whatever it kept or hit. A rank whose chunks run out before the others' joins the
        remaining rounds with nothing kept; each round says whether a rank has more, so
        the epoch ends on the same round everywhere.
        """
        self._in_epoch = True
        self.epochs_started = epoch + 1
        self.stop_requested = False
        self._new_epoch_counts()
        counted = _CountingContext(self, context)
        try:
            while True:
                chunk = upcoming.next()
                error = None
                with self.timer.phase("bookkeeping"):
                    try:
                        kept = self.strategy.choose(epoch, chunk, counted) if select else counted.load(chunk)
                    except AgreedError as failure:
                        error, kept = failure, Batch(torch.empty(0, dtype=torch.int64))
                    else:
                        if after_choice is not None:
                            after_choice(chunk, kept)
                self._epoch_considered += len(chunk)
                self._epoch_kept += len(kept)
                stop_vote = bool(should_stop()) if should_stop is not None else False
                batches = self.batching.ready_batches(kept, stop_vote, error, upcoming.exhausted)
                while True:
                    with self.timer.phase("bookkeeping"):
                        batch = next(batches, None)
                    if batch is None:
                        break
                    yield batch
                if self.batching.stop_requested or self.batching.epoch_finished:
                    self.stop_requested = self.batching.stop_requested
                    break
        finally:
            self._in_epoch = False
        self.counters.examples_considered += self._epoch_considered
        self.counters.examples_kept += self._epoch_kept

    def score(self, context: ChunkContext, batch: Batch) -> torch.Tensor:
        """Selection losses of `batch` from `context`, checked, counted and timed."""
        with self.timer.phase("selection"):
            losses = context.score(batch)
            _check_per_example(losses, len(batch), "selection")
            self.counters.selection_forward_examples += len(batch)
            check_finite(losses, self._where())
            return losses.float()

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's selection state, at an epoch boundary; save one per rank.

        Loaded into a SelectiveBackprop built the same way on the same rank, the next
        epoch selects and batches exactly as this run's would have.
        """
        if self._in_epoch:
            raise RuntimeError("state_dict() is taken between epochs, not while batches() is running")
        return {
            "rank": self.collective.rank,
            "world_size": self.collective.world_size,
            "strategy": self.strategy.state_dict(),
            "batching": self.batching.state_dict() if self.batching is not None else None,
            "schema": self.schema,
            "counters": self.counters_dict(),
            "timer": self.timer.state_dict(),
            "epochs_started": self.epochs_started,
            "next_sample_id": self.next_sample_id,
        }

    def load_state_dict(self, state: dict) -> None:
        here = (self.collective.rank, self.collective.world_size)
        if (state["rank"], state["world_size"]) != here:
            raise ValueError(
                f"this selection state was saved by rank {state['rank']} of {state['world_size']}; "
                f"this is rank {here[0]} of {here[1]}: resume with the same number of workers, each from its own state"
            )
        self.strategy.load_state_dict(state["strategy"])
        # The columns every rank agreed on come back with the state: no rank asks again.
        self.schema = state["schema"]
        if self.batching is None and self.schema is not None:
            self.batching = self._lockstep()
        if state["batching"] is not None:
            self.batching.load_state_dict(state["batching"])
        self.counters = Counters(**state["counters"])
        self.timer.load_state_dict(state["timer"])
        self.epochs_started = int(state["epochs_started"])
        self.next_sample_id = int(state["next_sample_id"])

    def counters_dict(self) -> dict[str, int]:
        return asdict(self.counters)

    def progress_counts(self) -> dict[str, float]:
        """Cumulative counters plus this epoch's, all additive so ranks can sum them."""
        return {
            **self.counters_dict(),
            "epoch_kept": self._epoch_kept,
            "epoch_considered": self._epoch_considered,
            "epoch_steps": self._epoch_steps,
            "epoch_loss_sum": self._loss_sum,
        }

    # -- internals --------------------------------------------------------------------
    def _new_epoch_counts(self) -> None:
        self._step_in_epoch = self._epoch_steps = 0
        self._epoch_considered = self._epoch_kept = 0
        self._loss_sum = 0.0

    def _where(self) -> str:
        return f"epoch {self.epochs_started}, step {self._step_in_epoch + 1}"

    def _lockstep(self) -> LockstepBatching:
        carried = self.carried
        if carried is None and self.load_ids is None:
            # Examples arrive on the CPU; they train where the model of the running epoch is.
            carried = Carried(
                self.schema,
                columns_of=lambda kept: kept.columns,
                load=lambda ids, columns: _on_device(Batch(ids, columns), self.device),
            )
        return LockstepBatching(
            self.collective, self.batch_size, self.load_ids, self.strategy.loss_table(), self.chunk_size, carried
        )

    def _agree_schema(self, first) -> None:
        """The columns every rank's batches must have: rank 0's first batch's (one collective, once)."""
        mine = None
        if first is not None:
            try:
                mine = schema_of(self._columns_of(first, 1))
            except BadBatchError as error:
                mine = str(error)
        agreed = self.collective.broadcast_object(mine) if self.batching is None else mine
        if not isinstance(agreed, dict):
            where = "" if self.collective.world_size == 1 else "rank 0: "
            raise BadBatchError(f"{where}{agreed or 'the data source gave no batches'}")
        self.schema = agreed
        if self.batching is None:
            self.batching = self._lockstep()

    def _checked(self, items: Iterator, epoch: int) -> Iterator[Batch | _InvalidChunk]:
        """`items` as Batches of the agreed columns, or markers of what was wrong with one."""
        for number, item in enumerate(items, start=1):
            try:
                columns = self._columns_of(item, number)
                found = schema_of(columns)
                if found != self.schema:
                    raise BadBatchError(
                        f"batch {number} has columns {_describe(found)}, unlike the first batch's {_describe(self.schema)}"
                    )
                yield Batch(self._ids_of(columns, number), columns)
            except BadBatchError as error:
                yield _InvalidChunk(f"epoch {epoch + 1}: {error}")

    def _columns_of(self, item, number: int) -> dict[str, torch.Tensor]:
        if isinstance(item, Mapping):
            named = dict(item)
        elif isinstance(item, (tuple, list)) and self.columns is not None and len(item) == len(self.columns):
            named = dict(zip(self.columns, item))
        else:
            raise BadBatchError(
                f"batch {number} is a {type(item).__name__}; give dict batches, or name tuple batches' "
                "positions with columns=[...]"
            )
        if self.columns is not None:
            missing = [name for name in self.columns if name not in named]
            if missing:
                raise BadBatchError(f"batch {number} has no column {missing[0]!r} (it has: {', '.join(map(str, named))})")
            wanted = self.columns + ([self.id_column] if self.id_column and self.id_column not in self.columns else [])
            named = {name: named[name] for name in wanted if name in named}
        columns = {}
        for name, value in named.items():
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise BadBatchError(
                    f"column {name!r} of batch {number} is a {type(value).__name__}, not a tensor with one row per example"
                )
            columns[name] = value
        lengths = {name: len(column) for name, column in columns.items()}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name} {length}" for name, length in lengths.items())
            raise BadBatchError(f"the columns of batch {number} have different lengths: {listed}")
        if self.id_column is not None and self.id_column not in columns:
            raise BadBatchError(f"batch {number} has no id column {self.id_column!r} (it has: {', '.join(columns)})")
        return columns

    def _ids_of(self, columns: dict[str, torch.Tensor], number: int) -> torch.Tensor:
        if self.id_column is None:
            # Ids only label examples in the exchange; unique per rank is enough.
            rows = len(next(iter(columns.values())))
            ids = self.collective.rank + self.collective.world_size * torch.arange(
                self.next_sample_id, self.next_sample_id + rows
            )
            self.next_sample_id += rows
            return ids
        ids = columns[self.id_column]
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise BadBatchError(f"id column {self.id_column!r} of batch {number} must hold one integer per example")
        return ids.long()

    def _empty_chunk(self) -> Batch:
        return Batch(torch.empty(0, dtype=torch.int64), empty_columns(self.schema or {}))


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


class _CountingContext:
    """What strategies see: the context's data, and its scores checked and counted."""

    def __init__(self, selection: SelectiveBackprop, context: ChunkContext):
        self.selection, self.context = selection, context

    def sample_ids(self, chunk) -> torch.Tensor:
        return self.context.sample_ids(chunk)

    def load(self, chunk) -> Batch:
        return self.context.load(chunk)

    def score(self, batch: Batch) -> torch.Tensor:
        return self.selection.score(self.context, batch)


class _UserContext:
    """Chunks of a user's own batches: moved to the model's device, scored by the loss function."""

    def __init__(self, selection: SelectiveBackprop, model: torch.nn.Module, device: torch.device):
        # Scoring uses the bare module: a DDP wrapper's forward would be a collective
        # (buffer broadcast) that ranks with nothing to score would not join.
        self.scoring_model = getattr(model, "module", model)
        self.selection, self.device = selection, device

    def sample_ids(self, chunk: Batch | _InvalidChunk) -> torch.Tensor:
        return _valid(chunk).sample_ids

    def load(self, chunk: Batch | _InvalidChunk) -> Batch:
        return _on_device(_valid(chunk), self.device)

    def score(self, batch: Batch) -> torch.Tensor:
        if not len(batch):  # a rank whose data ran out still joins the round
            return torch.zeros(0, device=self.device)
        self.scoring_model.eval()
        with torch.inference_mode():
            return _called(self.selection.score_fn, self.scoring_model, batch, "selection")


class _InvalidChunk:
    """A source batch that failed its checks: it raises when a strategy uses it, inside the
    round, so the error reaches every rank through the round's exchange."""

    device = torch.device("cpu")

    def __init__(self, message: str):
        self.message = message

    def __len__(self) -> int:
        return 0

    def __getitem__(self, index) -> _InvalidChunk:
        return self


def _valid(chunk: Batch | _InvalidChunk) -> Batch:
    if isinstance(chunk, _InvalidChunk):
        raise BadBatchError(chunk.message)
    return chunk


def _on_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.sample_ids.to(device), {name: column.to(device) for name, column in batch.columns.items()})


def _rechunk(items: Iterator[Batch | _InvalidChunk], size: int) -> Iterator[Batch | _InvalidChunk]:
    """Selection chunks of exactly `size` examples (the last may be smaller) from batches of any size."""
    pending: list[Batch] = []
    held = 0
    for item in items:
        if isinstance(item, _InvalidChunk):
            yield item
            continue
        pending.append(item)
        held += len(item)
        if held < size:
            continue
        merged = Batch.concat(pending) if len(pending) > 1 else pending[0]
        start = 0
        while held - start >= size:
            yield merged.take(slice(start, start + size))
            start += size
        pending = [merged.take(slice(start, None))] if start < held else []
        held -= start
    if held:
        yield Batch.concat(pending) if len(pending) > 1 else pending[0]


def _called(loss_fn: LossFunction, model: torch.nn.Module, batch: Batch, purpose: str) -> torch.Tensor:
    """`loss_fn(model, batch)`, its failures turned into a BadBatchError every rank can raise."""
    try:
        return loss_fn(model, batch)
    except AgreedError:
        raise
    except Exception as error:
        raise BadBatchError(f"loss_fn raised {type(error).__name__} in {purpose}: {error}") from error


def _check_per_example(losses, rows: int, purpose: str) -> None:
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (rows,):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise BadBatchError(
            f"the loss function must return one loss per example, shape ({rows},), in {purpose}; it returned "
            f"{shape} (use reduction='none')"
        )


def _describe(schema: ColumnSchema) -> str:
    return "{" + ", ".join(f"{name}: {str(dtype).replace('torch.', '')}{list(shape)}" for name, (dtype, shape) in schema.items()) + "}"


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _found_collective() -> Collective:
    """torch.distributed's group where one is running (Ray Train ranks), else a world of one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return TorchCollective()
    return Collective()


def _shared_history(collective: Collective, capacity: int):
    """The worker group's shared CDF_R where Ray runs it; on other launchers each rank ranks alone."""
    import ray

    if not ray.is_initialized():
        return None
    from raysb.distributed.loss_history import shared_loss_history

    return shared_loss_history(collective, capacity)
