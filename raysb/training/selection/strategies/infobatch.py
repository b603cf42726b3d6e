"""InfoBatch (Qin et al., ICLR 2024): prune a random share of the well-learned examples, rescale the rest."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.transfer import to_device
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies.base import ChunkContext, FreeScores


class InfoBatchStrategy(FreeScores):
    """Each example's score is its loss from the last training forward it was in (no selection
    forward). Each epoch, an example whose score is below the mean score of the epoch's start is
    dropped with probability `prune_ratio` r; one kept despite a below-mean score weighs
    1 / (1 - r) in its step's loss, so the gradient's expectation stays the full data's. Every
    example at or above the mean, and every one never trained on, is kept with weight 1. Once
    `delta` of the run is done (epochs, or the time budget when the schedule is keyed to
    time) nothing is pruned: the last 1 - delta anneals on the full data.

    As in NUS-HPC-AI-Lab/InfoBatch, but each below-mean example is dropped by its own draw
    rather than exactly int(r n) of the n below the mean: a rank sees only its shard, and the
    two differ by the draws' spread (about sqrt(r (1 - r) n) examples an epoch). Annealing
    starts at the first epoch at or past delta of the run (InfoBatch's code starts at the first
    one past it, so a run of 8 epochs there never anneals).
    """

    name = "infobatch"

    def __init__(self, table: LossTable, prune_ratio: float, delta: float, seed: int):
        if not 0 < prune_ratio < 1:
            raise ValueError(f"infobatch_prune_ratio must be in (0, 1), got {prune_ratio}")
        if not 0 < delta <= 1:
            raise ValueError(f"infobatch_delta must be in (0, 1], got {delta}")
        super().__init__(table)
        self.prune_ratio = prune_ratio
        self.delta = delta
        # Decided on the host, where the table and a chunk's positions are: no round waits for the device.
        self.generator = torch.Generator().manual_seed(seed)
        self._epoch: int | None = None
        self._threshold: torch.Tensor | None = None
        self._annealing = False

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        self.table.epoch = epoch
        if epoch != self._epoch:
            # Decided as the epoch starts, as InfoBatch decides: the threshold, and whether it anneals.
            self._epoch, self._threshold, self._annealing = epoch, self.table.mean(), ctx.progress() >= self.delta
        if self._annealing:
            return ctx.load(chunk)
        scores = self.table.lookup(ctx.sample_ids(chunk))
        well_learned = scores < self._threshold  # NaN (never trained on, or no threshold yet) is not
        draws = torch.rand(scores.numel(), generator=self.generator)
        kept = (~(well_learned & (draws < self.prune_ratio))).nonzero().squeeze(1)
        batch = ctx.load(chunk[kept.to(chunk.device)])
        weights = torch.where(well_learned[kept], 1.0 / (1.0 - self.prune_ratio), 1.0)
        batch.weights = to_device(weights, batch.device)
        return batch

    def state_dict(self) -> dict:
        # Taken between epochs: the next epoch computes its threshold afresh.
        return {"table": self.table.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.table.load_state_dict(state["table"])
        self.generator.set_state(state["generator"])
        self._epoch = None
