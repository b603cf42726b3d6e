"""A user's own batches as selection chunks: checked, named, given ids, cut to size.

`raysb.SelectiveBackprop` takes any iterable of dict batches (Ray Data's
`iter_torch_batches`, a DataLoader, a list; tuple batches named with `columns=`).
Here they become `Batch`es of the columns every rank agreed on, cut into chunks of
the selection batch size, and scored with the user's loss function. A batch that
fails its checks becomes a marker that raises inside the round that uses it, so
the error reaches every rank through that round's exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from raysb.core.batch_former import Batch
from raysb.core.columns import ColumnSchema, empty_columns, schema_of
from raysb.core.errors import BadBatchError
from raysb.training.collective import Collective, bare_module
from raysb.training.precision import autocast
from raysb.training.selection.loss_reads import LossFunction, called


class UserBatches:
    """Turns a user's batches into chunks of the agreed columns, with stable or made-up ids."""

    def __init__(
        self, collective: Collective, columns: Iterable[str] | None, id_column: str | None, id_bound: int | None = None
    ):
        """`columns`: the columns to use (others are dropped; tuple batches are named by position).
        `id_column`: a column of stable integer ids; without one, ids unique on this rank are made.
        `id_bound`: ids must lie in [0, id_bound) (they index the rows of a table that many long)."""
        self.collective = collective
        self.id_bound = id_bound
        self.columns = None if columns is None else list(columns)
        self.id_column = id_column
        # The columns every rank's batches must have: rank 0's first batch's.
        self.schema: ColumnSchema | None = None
        self.next_sample_id = 0

    def schema_of_first(self, first) -> ColumnSchema | str | None:
        """The columns of this rank's first batch, or what is wrong with it (None: no batch)."""
        if first is None:
            return None
        try:
            return schema_of(self.columns_of(first, 1))
        except BadBatchError as error:
            return str(error)

    def chunks(self, items: Iterator, epoch: int, size: int) -> Iterator[Batch | InvalidChunk]:
        """An epoch's selection chunks of exactly `size` examples (the last may be smaller)."""
        return _rechunk(self._checked(items, epoch), size)

    def empty_chunk(self) -> Batch:
        return Batch(torch.empty(0, dtype=torch.int64), empty_columns(self.schema or {}))

    def _checked(self, items: Iterator, epoch: int) -> Iterator[Batch | InvalidChunk]:
        """`items` as Batches of the agreed columns, or markers of what was wrong with one."""
        for number, item in enumerate(items, start=1):
            try:
                columns = self.columns_of(item, number)
                found = schema_of(columns)
                if found != self.schema:
                    raise BadBatchError(
                        f"batch {number} has columns {_describe(found)}, unlike the first batch's {_describe(self.schema)}"
                    )
                yield Batch(self._ids_of(columns, number), columns)
            except BadBatchError as error:
                yield InvalidChunk(f"epoch {epoch + 1}: {error}")

    def columns_of(self, item, number: int) -> dict[str, torch.Tensor]:
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
        if self.id_bound is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.id_bound):
            raise BadBatchError(
                f"id column {self.id_column!r} of batch {number} holds ids {int(ids.min())} to {int(ids.max())}, "
                f"but the table has rows 0 to {self.id_bound - 1}: its ids must index the table's rows"
            )
        return ids.long()


class UserContext:
    """Chunks of a user's own batches: moved to the model's device, scored by `score_fn` at `precision`."""

    def __init__(self, model: torch.nn.Module, device: torch.device, score_fn: LossFunction, precision: str):
        # Scoring uses the bare module: a DDP wrapper's forward would be a collective
        # (buffer broadcast) that ranks with nothing to score would not join.
        self.scoring_model = bare_module(model)
        self.device, self.score_fn, self.precision = device, score_fn, precision

    def sample_ids(self, chunk: Batch | InvalidChunk) -> torch.Tensor:
        return _valid(chunk).sample_ids

    def load(self, chunk: Batch | InvalidChunk) -> Batch:
        return on_device(_valid(chunk), self.device)

    def score(self, batch: Batch) -> torch.Tensor:
        if not len(batch):  # a rank whose data ran out still joins the round
            return torch.zeros(0, device=self.device)
        self.scoring_model.eval()
        with torch.inference_mode(), autocast(self.precision, self.device):
            return called(self.score_fn, self.scoring_model, batch, "selection")[0]


class InvalidChunk:
    """A source batch that failed its checks: it raises when a strategy uses it, inside the
    round, so the error reaches every rank through the round's exchange."""

    device = torch.device("cpu")

    def __init__(self, message: str):
        self.message = message

    def __len__(self) -> int:
        return 0

    def __getitem__(self, index) -> InvalidChunk:
        return self


def _valid(chunk: Batch | InvalidChunk) -> Batch:
    if isinstance(chunk, InvalidChunk):
        raise BadBatchError(chunk.message)
    return chunk


def on_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(batch.sample_ids.to(device), {name: column.to(device) for name, column in batch.columns.items()})


def _rechunk(items: Iterator[Batch | InvalidChunk], size: int) -> Iterator[Batch | InvalidChunk]:
    """Selection chunks of exactly `size` examples (the last may be smaller) from batches of any size."""
    pending: list[Batch] = []
    held = 0
    for item in items:
        if isinstance(item, InvalidChunk):
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


def _describe(schema: ColumnSchema) -> str:
    return "{" + ", ".join(f"{name}: {str(dtype).replace('torch.', '')}{list(shape)}" for name, (dtype, shape) in schema.items()) + "}"
