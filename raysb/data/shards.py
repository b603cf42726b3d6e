"""Where a rank's training examples come from each epoch, in selection-sized chunks.

- `MemoryShard`: the whole split is a tensor on this rank; a chunk is a tensor
  of row positions, and any example can be gathered by id. Every rank holds
  every example, so lockstep ranks exchange only ids.
- `StreamShard`: the split streams from Parquet through Ray Data; a chunk is
  the decoded examples themselves (`RawExamples`). Other ranks never see them,
  so lockstep ranks exchange the kept examples' bytes (raysb.training.selection.exchange).

The engine and the strategies treat a chunk as opaque: they index it with a
mask or a slice, take its length and ask the shard for its ids and examples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_device, to_host
from raysb.data import ImageDataset
from raysb.data.streaming import StreamedSplit


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
        """This rank's positions in the epoch's random order of all rows (one chunk of the whole epoch)."""
        return self.shard(torch.randperm(self.num_examples, generator=generator))

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

    def __init__(self, split: StreamedSplit, batches: Callable[[int, int], Iterable[dict[str, torch.Tensor]]]):
        """`batches(chunk_size, seed)` iterates this rank's part of one epoch as column dicts."""
        self.split = split
        self.batches = batches
        self.num_examples = len(split)
        self.all_sample_ids = split.sample_ids
        self.num_classes = split.num_classes
        self.image_shape = split.image_shape
        self.mean, self.std = split.mean, split.std

    def epoch_chunks(self, chunk_size: int, generator: torch.Generator) -> Iterator[RawExamples]:
        # The shuffle seed comes from the engine's order generator, which checkpoints restore.
        seed = int(torch.randint(2**31 - 1, (1,), generator=generator))
        for columns in self.batches(chunk_size, seed):
            yield RawExamples(columns["sample_id"].long(), columns["image"], columns["label"].long())

    def empty_chunk(self) -> RawExamples:
        return RawExamples(
            torch.empty(0, dtype=torch.int64),
            torch.empty((0, *self.image_shape), dtype=torch.uint8),
            torch.empty(0, dtype=torch.int64),
        )

    def sample_ids(self, chunk: RawExamples) -> torch.Tensor:
        return chunk.sample_ids

    def raw(self, chunk: RawExamples) -> RawExamples:
        return chunk

    def raw_by_ids(self, sample_ids: torch.Tensor) -> RawExamples:
        raise RuntimeError("a streamed shard holds only the current chunk; lockstep ranks exchange examples")
