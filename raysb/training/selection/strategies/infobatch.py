"""InfoBatch (Qin et al., ICLR 2024): prune a random share of the well-learned examples, rescale the rest."""

from __future__ import annotations

import torch

from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies.base import Decision, FreeScores


# (e + 1) / E == delta does not anneal; progress is a float sum, a hair off e / E.
_ROUNDING = 1e-9


class InfoBatchStrategy(FreeScores):
    """Each example's score is its loss from the last training forward it was in (no selection
    forward). Each epoch, an example whose score is below the mean score of the epoch's start is
    dropped with probability `prune_ratio` r; one kept despite a below-mean score weighs
    1 / (1 - r) in its step's loss, so the gradient's expectation stays the full data's. Every
    example at or above the mean, and every one never trained on, is kept with weight 1. An
    epoch that ends past `delta` of the run trains on everything (`anneals`): in a run of E
    epochs, epoch e anneals when (e + 1) / E > delta, from epoch floor(delta E) on, as in the
    authors' code (8 epochs at delta 0.875: epoch 7; 5 epochs: epoch 4).

    As in NUS-HPC-AI-Lab/InfoBatch, but each below-mean example is dropped by its own draw
    rather than exactly int(r n) of the n below the mean: a rank sees only its shard, and the
    two differ by the draws' spread (about sqrt(r (1 - r) n) examples an epoch). The authors
    cap the kept share of the below-mean examples at 0.1 (r at most 0.9): r above it is refused.
    """

    name = "infobatch"

    def __init__(self, table: LossTable, prune_ratio: float, delta: float, seed: int):
        super().__init__(table)
        self.prune_ratio = prune_ratio
        self.delta = delta
        # Decided on the host, where the table and a chunk's positions are: no round waits for the device.
        self.generator = torch.Generator().manual_seed(seed)
        self._epoch: int | None = None
        self._threshold: torch.Tensor | None = None

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> InfoBatchStrategy:
        # Its margins estimate the share of wrong labels at no cost (raysb.training.label_suspects).
        return cls(LossTable.for_run(spec, sample_ids, margins=True), spec.options["infobatch_prune_ratio"],
                   spec.options["infobatch_delta"], spec.seed)

    def anneals(self, epoch: int, progress: float) -> bool:
        """Whether `epoch` ends past `delta` of the run. Its end is estimated as its start plus the
        share of the run an epoch has taken so far: exactly (e + 1) / E in a run of E epochs, and
        the same rule under a time or work budget, whose epochs are not known in advance. Epoch 0
        keeps everything in any case (no example has a score yet)."""
        return epoch > 0 and progress * (epoch + 1) / epoch > self.delta + _ROUNDING

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        return True

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        """The kept positions among `ids` (ascending) and their loss weights."""
        self.table.epoch = epoch
        if epoch != self._epoch:
            # Decided as the epoch starts, as InfoBatch decides.
            self._epoch, self._threshold = epoch, self.table.mean()
        recorded = self.table.lookup(ids)
        well_learned = recorded < self._threshold  # NaN (never trained on, or no threshold yet) is not
        draws = torch.rand(recorded.numel(), generator=self.generator)
        kept = (~(well_learned & (draws < self.prune_ratio))).nonzero().squeeze(1)
        return Decision(kept, torch.where(well_learned[kept], 1.0 / (1.0 - self.prune_ratio), 1.0))

    def state_dict(self) -> dict:
        # Taken between epochs: the next epoch computes its threshold afresh.
        return {"table": self.table.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.table.load_state_dict(state["table"])
        self.generator.set_state(state["generator"])
        self._epoch = None
