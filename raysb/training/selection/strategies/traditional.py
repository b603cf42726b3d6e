"""Traditional SGD: the baseline every strategy is measured against."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.training.selection.strategies.base import ChunkContext, EpochPlan, Strategy


class Traditional(Strategy):
    """Traditional SGD: every example, every epoch."""

    name = "traditional"

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> Traditional:
        return cls()

    def kept_batch(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        return ctx.load(chunk)

    def plans_epoch(self, epoch: int, sample_ids: torch.Tensor) -> bool:
        return True

    def plan_epoch(self, epoch: int, sample_ids: torch.Tensor) -> EpochPlan:
        return EpochPlan(torch.arange(len(sample_ids)))
