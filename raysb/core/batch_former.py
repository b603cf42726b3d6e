"""Queue kept examples until a full training batch is waiting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    """Examples that travel together: stable sample ids and named columns of equal length.

    A batch reads like the dict of tensors it was made from (`batch["label"]`,
    `batch.keys()`); indexing it with a mask, indices or a slice takes rows.
    `weights` are per-example loss weights (importance-sampling corrections);
    None means every example counts equally. `keep_probabilities` are the
    probabilities with which selection kept each example (NaN where no selection
    chose it), for raysb.core.keep_rule.staleness_weights.
    """

    sample_ids: torch.Tensor
    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: torch.Tensor | None = None
    keep_probabilities: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        return self.take(key)

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def keys(self):
        return self.columns.keys()

    @property
    def device(self) -> torch.device:
        return self.sample_ids.device

    def take(self, index: torch.Tensor | slice) -> "Batch":
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            # Each boolean-mask index would find the mask's nonzeros again; do it once.
            index = index.nonzero().squeeze(1)
        columns = {}
        for name, column in self.columns.items():  # a loop, not a comprehension: a batch is taken every step
            columns[name] = column[index]
        return Batch(
            self.sample_ids[index],
            columns,
            None if self.weights is None else self.weights[index],
            None if self.keep_probabilities is None else self.keep_probabilities[index],
        )

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        # Plain loops: batches are joined every round, and each comprehension would be a call of its own.
        ids, columns = [], {}
        weighted = selected = False
        for batch in batches:
            ids.append(batch.sample_ids)
            for name in batches[0].columns:
                columns.setdefault(name, []).append(batch.columns[name])
            weighted = weighted or batch.weights is not None
            selected = selected or batch.keep_probabilities is not None
        weights, probabilities = [], []
        for batch in batches:
            if weighted:
                weights.append(batch.loss_weights())
            if selected:
                probabilities.append(batch.chosen_with())
        for name, parts in columns.items():
            columns[name] = torch.cat(parts)
        return Batch(torch.cat(ids), columns, torch.cat(weights) if weighted else None,
                     torch.cat(probabilities) if selected else None)

    def chosen_with(self) -> torch.Tensor:
        """Keep probabilities, NaN for examples no selection chose."""
        if self.keep_probabilities is not None:
            return self.keep_probabilities
        return torch.full((len(self),), float("nan"), device=self.device)

    def loss_weights(self) -> torch.Tensor:
        if self.weights is not None:
            return self.weights
        return torch.ones(len(self), device=self.device)


class PendingRows:
    """Kept examples not gathered yet: an epoch decided as it starts loads each step's examples just
    before the step, as a plain loop does, not the whole epoch's at once. `load(start, stop)` gathers
    rows [start, stop) of the kept examples."""

    def __init__(self, count: int, load: Callable[[int, int], Batch]):
        self.start, self.stop, self.load = 0, count, load

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, count: int) -> Batch:
        """The next `count` rows, loaded."""
        batch = self.load(self.start, self.start + count)
        self.start += count
        return batch


class BatchFormer:
    """FIFO of kept examples that hands out batches of exactly `batch_size`.

    Whatever does not fill a batch stays queued (the carried remainder) and is
    trained on first once more examples arrive, so no kept example is dropped
    or repeated. The queue's last part may be `PendingRows`, loaded as batches take them.
    """

    def __init__(self, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._chunks: list[Batch] = []
        self._pending: PendingRows | None = None
        self.queued = 0  # examples queued, loaded or pending

    def __len__(self) -> int:
        return self.queued

    def add(self, batch: Batch | PendingRows) -> None:
        if not len(batch):
            return
        if self._pending is not None:
            raise ValueError("rows are still pending: load or drop them before queueing more")
        if isinstance(batch, PendingRows):
            self._pending = batch
        else:
            self._chunks.append(batch)
        self.queued += len(batch)

    def full_batches(self) -> int:
        return self.queued // self.batch_size

    def pop(self) -> Batch:
        if self.queued < self.batch_size:
            raise IndexError(f"only {self.queued} examples queued, need {self.batch_size}")
        loaded = self.queued - (self._pending.stop - self._pending.start if self._pending is not None else 0)
        if loaded < self.batch_size:  # the rest comes from the pending rows, gathered now
            self._chunks.append(self._pending.take(self.batch_size - loaded))
            if self._pending.start == self._pending.stop:
                self._pending = None
        merged = Batch.concat(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self.queued -= self.batch_size
        if len(merged) == self.batch_size:  # exactly a batch (a step's rows gathered for it): handed out whole
            self._chunks = []
            return merged
        head = merged.take(slice(0, self.batch_size))
        tail = merged.take(slice(self.batch_size, None))
        self._chunks = [tail] if len(tail) else []
        return head

    def load_pending(self) -> None:
        """Gather every pending row now (an epoch's remainder, which waits for the next epoch loaded)."""
        if self._pending is not None:
            self._chunks.append(self._pending.take(len(self._pending)))
            self._pending = None

    def drop_pending(self) -> int:
        """Forget the pending rows (an epoch stopped before reaching them); how many there were."""
        dropped = len(self._pending) if self._pending is not None else 0
        self._pending, self.queued = None, self.queued - dropped
        return dropped

    def drain(self) -> Batch | None:
        """Everything still queued, emptying the former (None if empty)."""
        self.load_pending()
        if not self.queued:
            return None
        merged = Batch.concat(self._chunks)
        self._chunks, self.queued = [], 0
        return merged
