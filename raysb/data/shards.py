"""Where a rank's training examples come from each epoch, in selection-sized chunks.

- `MemoryShard`: the whole split is a tensor on this rank; a chunk is a tensor
  of row positions, and any example can be gathered by id. Every rank holds
  every example, so lockstep ranks exchange only ids.
- `StreamShard`: the split streams from Parquet through Ray Data; a chunk is
  the decoded examples themselves (`RawExamples`). Other ranks never see them,
  so lockstep ranks exchange the kept examples' bytes (raysb.training.selection.exchange).
  An epoch decided as it starts reads only the rows it keeps (`kept_chunks`), of the
  row groups dealt to this rank (`epoch_order`); the shard counts what its reads decode and fetch.

The engine and the strategies treat a chunk as opaque: they index it with a
mask or a slice, take its length and ask the shard for its ids and examples.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from raysb.core.sample_index import SampleIndex
from raysb.core.settings import DataSettings
from raysb.core.transfer import to_device, to_host
from raysb.data import ImageDataset
from raysb.data.streaming import StreamedSplit, inspect_splits, kept_rows, read_bytes

if TYPE_CHECKING:  # it imports Ray Data, which in-memory runs never load
    from raysb.data.row_groups import ReadBytes


@dataclass
class RawExamples:
    """Examples as stored, before augmentation: uint8 images (N, C, H, W), labels, stable ids."""

    sample_ids: torch.Tensor
    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def __getitem__(self, index) -> RawExamples:
        if isinstance(index, torch.Tensor):
            index = index.to(self.device)
        return RawExamples(self.sample_ids[index], self.images[index], self.labels[index])

    @property
    def device(self) -> torch.device:
        return self.images.device

    def to(self, device: torch.device) -> RawExamples:
        return RawExamples(self.sample_ids.to(device), self.images.to(device), self.labels.to(device))


class MemoryShard:
    carries_examples = False

    def __init__(self, data: ImageDataset, shard: Callable[[torch.Tensor], torch.Tensor] = lambda order: order):
        """`shard` picks this rank's part of each epoch's random order of all rows."""
        self.data = data
        self.shard = shard
        self.num_examples = len(data)
        self.all_sample_ids = data.sample_ids
        # Epoch orders are host positions: their ids come from a host copy, so asking a chunk's
        # ids (every round, for the trace and the loss tables) never copies to the device and
        # waits for it; and lockstep ranks find the rows of the ids they train on on the host.
        self._host_sample_ids = to_host(data.sample_ids)
        self.index = SampleIndex(self._host_sample_ids)
        self.num_classes = data.num_classes
        self.image_shape = tuple(data.images.shape[1:])
        self.mean, self.std = data.mean, data.std

    @property
    def device(self) -> torch.device:
        """Where the examples are (a GPU's memory, for small images)."""
        return self.data.images.device

    def epoch_chunks(self, chunk_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
        return iter(self.epoch_order(generator).split(chunk_size))

    def epoch_order(self, generator: torch.Generator) -> torch.Tensor:
        """This rank's positions in the epoch's random order of all rows (one chunk of the whole epoch).
        Pinned where the examples are on a GPU: each chunk's positions then go there without waiting."""
        order = self.shard(torch.randperm(self.num_examples, generator=generator))
        return order.pin_memory() if self.device.type == "cuda" else order

    def owned_order(self, generator: torch.Generator, owns: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The positions of the examples whose ids `owns`, in the epoch's random order of all rows: what
        a rank decides where a sharded loss table holds only its own examples' scores."""
        order = torch.randperm(self.num_examples, generator=generator)
        return order[owns(self._host_sample_ids[order])]

    def empty_chunk(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def sample_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """The ids of `positions`, on the host."""
        return self._host_sample_ids[positions.cpu()]

    def raw(self, positions: torch.Tensor) -> RawExamples:
        positions = to_device(positions, self.data.images.device)
        return RawExamples(self.data.sample_ids[positions], self.data.images[positions], self.data.labels[positions])

    def raw_by_ids(self, sample_ids: torch.Tensor) -> RawExamples:
        return self.raw(self.index.rows_of(sample_ids))


class StreamShard:
    carries_examples = True

    def __init__(self, split: StreamedSplit, batches: Callable[[int, int], Iterable[dict[str, torch.Tensor]]],
                 kept_batches: Callable[[torch.Tensor, int, int], Iterable[dict[str, torch.Tensor]]],
                 read_bytes: ReadBytes, rank: int = 0, world: int = 1):
        """`batches(chunk_size, seed)` iterates this rank's part of one epoch as column dicts;
        `kept_batches(positions, chunk_size, seed)` the rows at `positions` alone (an epoch decided as it
        starts reads only what it keeps: raysb.data.streaming.kept_rows). `read_bytes` prices the reads;
        this is rank `rank` of `world`."""
        self.split = split
        self.batches, self.kept_batches = batches, kept_batches
        self.read_bytes, self.rank, self.world = read_bytes, rank, world
        self.num_examples = len(split)
        self.all_sample_ids = split.sample_ids
        self.positions = SampleIndex(split.sample_ids)
        self.num_classes = split.num_classes
        self.image_shape = split.image_shape
        self.mean, self.std = split.mean, split.std
        # This rank's rows decoded and bytes read (raysb.data.row_groups.ReadBytes) in the run so far.
        self.rows_decoded, self.bytes_read = 0, 0.0

    def epoch_seed(self, generator: torch.Generator) -> int:
        """The epoch's draw from the engine's order generator, which checkpoints restore: every order
        and shuffle of the epoch follows from it."""
        return int(torch.randint(2**31 - 1, (1,), generator=generator))

    def epoch_chunks(self, chunk_size: int, generator: torch.Generator) -> Iterator[RawExamples]:
        return self.stream(chunk_size, self.epoch_seed(generator))

    def stream(self, chunk_size: int, seed: int) -> Iterator[RawExamples]:
        """This rank's part of the whole split, in `batches`' order: every row is read and decoded."""
        for columns in self.batches(chunk_size, seed):
            chunk = _raw(columns)
            self.rows_decoded += len(chunk)
            self.bytes_read += self.read_bytes.of_rows(self.positions.rows_of(chunk.sample_ids))
            yield chunk

    def epoch_order(self, seed: int) -> torch.Tensor:
        """This rank's positions (in file order) in the epoch's random order of all rows: with more
        ranks, those of the row groups dealt to it, in a random order, a run of about an equal share of
        the rows to each rank, so that the ranks' reads fetch each row group at most once between them."""
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(self.num_examples, generator=generator)
        if self.world == 1:
            return order
        rows = self.read_bytes.rows
        dealt = torch.randperm(rows.numel(), generator=generator)
        before = rows[dealt].cumsum(0) - rows[dealt]
        owner = torch.empty_like(dealt)
        owner[dealt] = before * self.world // self.num_examples
        return order[owner[self.read_bytes.groups_of(order)] == self.rank]

    def kept_chunks(self, positions: torch.Tensor, chunk_size: int, seed: int) -> Iterator[RawExamples]:
        """The rows at `positions` alone, in chunks of `chunk_size`: only they are decoded, and only the
        row groups holding them read."""
        if not positions.numel():
            return
        self.bytes_read += self.read_bytes.of_groups(positions)
        for columns in self.kept_batches(positions, chunk_size, seed):
            chunk = _raw(columns)
            self.rows_decoded += len(chunk)
            yield chunk

    def empty_chunk(self) -> RawExamples:
        return RawExamples(
            torch.empty(0, dtype=torch.int64),
            torch.empty((0, *self.image_shape), dtype=torch.uint8),
            torch.empty(0, dtype=torch.int64),
        )

    def sample_ids(self, chunk: RawExamples | torch.Tensor) -> torch.Tensor:
        """The ids of a chunk read, or of rows at positions (an epoch's order)."""
        return chunk.sample_ids if isinstance(chunk, RawExamples) else self.all_sample_ids[chunk]

    def raw(self, chunk: RawExamples) -> RawExamples:
        return chunk

    def raw_by_ids(self, sample_ids: torch.Tensor) -> RawExamples:
        raise RuntimeError("a streamed shard holds only the current chunk; lockstep ranks exchange examples")

    def read_counts(self) -> dict[str, float]:
        """This rank's reads in the run so far (additive over ranks)."""
        return {"stream_rows_decoded": self.rows_decoded, "stream_bytes_read": self.bytes_read}

    def state_dict(self) -> dict:
        return {"rows_decoded": self.rows_decoded, "bytes_read": self.bytes_read}

    def load_state_dict(self, state: dict) -> None:
        self.rows_decoded, self.bytes_read = int(state["rows_decoded"]), float(state["bytes_read"])


def _raw(columns: dict[str, torch.Tensor]) -> RawExamples:
    return RawExamples(columns["sample_id"].long(), columns["image"], columns["label"].long())


def stream_shard(data: DataSettings, epoch_batches: Callable[[int, int], Iterable[dict[str, torch.Tensor]]],
                 rank: int = 0, world: int = 1) -> tuple[StreamShard, StreamedSplit]:
    """Rank `rank` of `world`'s shard of the streamed training split `data` names, and the test split.
    `epoch_batches(chunk_size, seed)`: the rank's part of a whole epoch (a Ray Train worker's dataset
    shard, or in one process the whole split); an epoch decided as it starts reads its kept rows itself."""
    train, test = inspect_splits(data.data_dir, data.parquet_columns)
    # Ray Data hands out read-only NumPy buffers; raysb never writes to a chunk in place.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def kept_batches(positions: torch.Tensor, chunk_size: int, seed: int):
        dataset = kept_rows(train, positions, seed)
        # The same rows in the same order from the same seed: a resumed epoch repeats the unbroken one's.
        dataset.context.execution_options.preserve_order = True
        return dataset.iter_torch_batches(batch_size=chunk_size, local_shuffle_buffer_size=data.stream_shuffle_buffer,
                                          local_shuffle_seed=seed)

    return StreamShard(train, epoch_batches, kept_batches, read_bytes(train), rank, world), test
