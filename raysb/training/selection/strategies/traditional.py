"""Traditional SGD: the baseline every strategy is measured against."""

from __future__ import annotations

import torch

from raysb.training.selection.strategies.base import Decision, Strategy


class Traditional(Strategy):
    """Traditional SGD: every example, every epoch."""

    name = "traditional"

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> Traditional:
        return cls()

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        return Decision()

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        return True
