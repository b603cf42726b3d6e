"""Stale-SB(n): selection passes every n-th epoch, recorded losses reused in between."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.selection import Selector
from raysb.core.transfer import to_device
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies.base import ChunkContext
from raysb.training.selection.strategies.sb import SBStrategy


class StaleSBStrategy(SBStrategy):
    """Stale-SB(n): selection passes every n-th epoch, recorded losses reused in between.

    In the epochs between selection passes, examples are chosen from their
    recorded loss before any data is loaded, so only kept examples are
    gathered and augmented. An example that was never scored (it joined after
    the last selection pass) is scored now rather than guessed.

    `record_training_losses`: every trained example's training loss replaces its
    recorded one, so the kept (hard) examples' scores follow training between passes.
    """

    name = "stale-sb"

    def __init__(
        self, selector: Selector, staleness: int, table: LossTable, first_epoch: int = 0,
        record_training_losses: bool = False,
    ):
        super().__init__(selector)
        if staleness < 1:
            raise ValueError(f"staleness n must be >= 1, got {staleness}")
        self.staleness = staleness
        self.table = table
        self.first_epoch = first_epoch
        self.record_training_losses = record_training_losses

    def is_selection_epoch(self, epoch: int) -> bool:
        return (epoch - self.first_epoch) % self.staleness == 0

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.is_selection_epoch(epoch)

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        self.table.epoch = epoch
        ids = ctx.sample_ids(chunk)
        if self.is_selection_epoch(epoch):
            losses = None
        else:
            losses = self.table.lookup(ids)
            if bool(torch.isnan(losses).any()):  # on the host: no wait for the device
                losses = None  # an unscored example: score the chunk like a selection pass
            else:
                losses = to_device(losses, self.selector.generator.device)
        if losses is None:
            batch = ctx.load(chunk)
            losses = ctx.score(batch)
            self.table.record(ids, losses)
            return self._keep(batch, losses)
        # Reusing epochs-old losses is the method here, not a delay to correct:
        # weighting them by fresh probabilities made seed 0 end at 59.4% (19.6% when
        # only its selection epochs are corrected; BENCHMARKS.md, "Stability").
        # Recorded losses were checked finite when they were scored, here or on their rank.
        keep = self.selector.keep_mask(losses, ids, checked=True)
        return ctx.load(chunk[keep.to(chunk.device)])

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor) -> None:
        if self.record_training_losses:
            self.table.record(batch.sample_ids, losses)

    def loss_table(self) -> LossTable:
        return self.table

    def state_dict(self) -> dict:
        return {**super().state_dict(), "table": self.table.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.table.load_state_dict(state["table"])
