"""Selective-Backprop: every example scored every epoch, kept with probability CDF_R(loss) ** beta."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.selection import Selector
from raysb.training.selection.strategies.base import ChunkContext, Strategy


class SBStrategy(Strategy):
    """Score every example each epoch; keep it with probability CDF_R(loss) ** beta."""

    name = "sb"

    def __init__(self, selector: Selector):
        self.selector = selector

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        batch = ctx.load(chunk)
        return self._keep(batch, ctx.score(batch))

    def _keep(self, batch: Batch, losses: torch.Tensor) -> Batch:
        """The kept part of `batch`, carrying the probabilities it was kept with."""
        # The round checked these losses finite when it scored them.
        keep, probabilities = self.selector.decide(losses, batch.sample_ids, checked=True)
        batch.keep_probabilities = probabilities.to(batch.device)
        return batch.take(keep)

    def scores_whole_chunks(self, epoch: int) -> bool:
        return True

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.selector.load_state_dict(state["selector"])
