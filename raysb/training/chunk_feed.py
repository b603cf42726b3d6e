"""What the selection rounds reach of raysb's image data on one rank: the chunks of an epoch, their
ids, their examples loaded and augmented, and their selection losses.

`ChunkFeed` is the engine's `ChunkContext` (raysb.training.selection.strategies.base): it owns the
rank's shard (raysb.data.shards), the augmentation, the generators that order and augment each
epoch, the selection forward and, where scoring runs ahead, the pipeline.
"""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.data import BatchTransform
from raysb.data.shards import MemoryShard, RawExamples, StreamShard
from raysb.training.selection.exchange import Carried
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.pipeline import PipelinedSelection
from raysb.training.selection.counts import Counters
from raysb.training.selection.sources import ChunkLookahead, ChunkRounds, StreamedPlan, WholeEpoch
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.timing import PhaseTimer


class ChunkFeed:
    def __init__(self, shard: MemoryShard | StreamShard, transform: BatchTransform, seed: int, device: torch.device,
                 scorer: SelectionScorer, scoring_model: torch.nn.Module, timer: PhaseTimer, counters: Counters,
                 pipeline: PipelinedSelection | None = None):
        """`seed` seeds the data order and augmentation. `scorer` runs the selection forward on
        `scoring_model` (the bare module: no DDP hooks, no collectives), or `pipeline` ahead of
        training; both follow the training weights by the optimizer steps in `counters`."""
        self.shard, self.transform, self.device = shard, transform, device
        self.scorer, self.scoring_model, self.pipeline = scorer, scoring_model, pipeline
        self.timer, self.counters = timer, counters
        # A chunk's stable ids are the shard's (ChunkContext.sample_ids), with no call in between.
        self.sample_ids = shard.sample_ids
        # Data order and augmentation draw from CPU generators so a seed gives
        # the same run on CPU and GPU; the draws are moved to the device.
        self.order_generator = torch.Generator().manual_seed(seed)
        self.augment_generator = torch.Generator().manual_seed(seed + 1)

    # -- ChunkContext: how strategies reach data and the model --------------------
    def load(self, chunk, raw: RawExamples | None = None) -> Batch:
        """`chunk`'s examples (or `raw`, examples read already) augmented into training inputs on this
        rank's device, or as the pipeline loaded them ahead."""
        if raw is None:
            if self.pipeline is not None:
                submitted = self.pipeline.batch_for(chunk)
                if submitted is not None:
                    return submitted
            raw = self.shard.raw(chunk)
        with self.timer.phase("data"):
            raw = raw.to(self.device)
            inputs = self.transform(raw.images, self.augment_generator, train=True)
            # Only streamed shards send kept examples' images to other ranks.
            columns = {"inputs": inputs, "labels": raw.labels}
            if self.shard.carries_examples:
                columns["images"] = raw.images
            return Batch(raw.sample_ids, columns)

    def score(self, batch: Batch) -> torch.Tensor:
        """Selection forward: eval mode so BatchNorm statistics are not moved by scoring."""
        losses = None
        if self.pipeline is not None:
            losses = self.pipeline.losses_for(batch, self.counters.optimizer_steps)
        if losses is None:
            columns = batch.columns
            losses = self.scorer(columns["inputs"], columns["labels"], self.counters.optimizer_steps)
        return losses

    def load_ids(self, sample_ids: torch.Tensor) -> Batch:
        """Gather examples by stable id (lockstep ranks train on ids other ranks kept)."""
        return self.load(None, self.shard.raw_by_ids(sample_ids))

    def carried(self) -> Carried | None:
        """How kept examples travel between lockstep ranks where they cannot be gathered by id (streamed
        shards): as labels and uint8 images. None where they are gathered by id."""
        if not self.shard.carries_examples:
            return None
        return Carried(
            schema={"labels": (torch.int64, ()), "images": (torch.uint8, self.shard.image_shape)},
            columns_of=lambda kept: {"labels": kept["labels"], "images": kept["images"]},
            load=lambda ids, columns: self.load(None, RawExamples(ids, columns["images"], columns["labels"])),
        )

    # -- an epoch's source of kept examples -------------------------------------------
    def source(self, plans, chunk_size: int, table: LossTable | None, planned: bool, scoring_ahead: bool,
               select: bool) -> ChunkRounds | WholeEpoch | StreamedPlan:
        """Where `SelectionRounds.epoch` takes this rank's kept examples from: the epoch decided whole as
        it starts (`planned`) where `plans(ids)` agrees, else a round a chunk of `chunk_size`.
        `table`: the strategy's loss table, whose owned examples alone are this rank's where it is
        sharded (it alone holds their scores; the others reach it by the exchange). A streamed epoch
        decided as it starts reads only the rows it keeps; one that does not `select` reads them all."""
        with self.timer.phase("data"):
            if planned and self.shard.carries_examples:
                # Asked of every id, before any draw: an epoch that is not planned draws as it always has.
                if select and plans(self.shard.all_sample_ids):
                    return StreamedPlan(self.shard, self.shard.epoch_seed(self.order_generator), chunk_size,
                                        self.timer)
                chunks = self.shard.epoch_chunks(chunk_size, self.order_generator)
            elif planned:
                if table is not None and table.sharded:
                    order = self.shard.owned_order(self.order_generator, table.owns)
                else:
                    order = self.shard.epoch_order(self.order_generator)
                if plans(self.shard.sample_ids(order)):
                    return WholeEpoch(order, self.shard.device)
                chunks = iter(order.split(chunk_size))
            else:
                chunks = self.shard.epoch_chunks(chunk_size, self.order_generator)
            submit = self._submit if scoring_ahead else None
            return ChunkRounds(ChunkLookahead(chunks, self.shard.empty_chunk, self.timer, submit,
                                              self.pipeline.depth if scoring_ahead else 1))

    def _submit(self, chunk) -> None:
        """A chunk to the pipeline's scorer, whose model copy is first brought up to date."""
        self.pipeline.sync(self.scoring_model, self.counters.optimizer_steps)
        self.pipeline.submit(chunk, self.load(chunk))

    def read_counts(self) -> dict[str, float]:
        """What this rank's streamed epochs read so far (raysb.data.shards.StreamShard.read_counts); none in memory."""
        return self.shard.read_counts() if self.shard.carries_examples else {}

    def state_dict(self) -> dict:
        state = {"order_generator": self.order_generator.get_state(),
                 "augment_generator": self.augment_generator.get_state()}
        if self.shard.carries_examples:
            state["reads"] = self.shard.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.order_generator.set_state(state["order_generator"])
        self.augment_generator.set_state(state["augment_generator"])
        if "reads" in state:  # absent from checkpoints made before streamed reads were counted
            self.shard.load_state_dict(state["reads"])
