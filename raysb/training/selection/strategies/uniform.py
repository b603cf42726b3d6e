"""RS2: a fresh uniform random subset each epoch, the baseline a scoring forward must beat."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_host
from raysb.training.selection.strategies.base import ChunkContext, Strategy


class UniformStrategy(Strategy):
    """RS2 (Okanovic et al., 2023): each epoch trains on a fresh uniform random subset of
    round(s * N) examples, drawn without replacement across epochs until every example has
    been used, then from a new permutation. No scoring forward at all: the baseline that SB's
    scoring must beat.

    Epoch e's subset is slice [e*k, (e+1)*k) of an endless stream of seeded permutations
    of the training set's ids, a pure function of (seed, epoch): every rank agrees on it
    without talking, and a resumed run draws exactly what it would have.
    """

    name = "uniform"

    def __init__(self, sample_ids: torch.Tensor | None, selectivity: float, seed: int):
        if sample_ids is None:
            raise ValueError("strategy uniform draws from the whole training set: it needs the set's sample ids")
        self.ids = to_host(sample_ids)
        self.per_epoch = max(1, round(selectivity * self.ids.numel()))
        self.seed = seed
        self._epoch, self._chosen = None, None

    def epoch_subset(self, epoch: int) -> torch.Tensor:
        """The ids epoch `epoch` trains on."""
        total = self.ids.numel()
        start, stop = epoch * self.per_epoch, (epoch + 1) * self.per_epoch
        parts = []
        for cycle in range(start // total, (stop - 1) // total + 1):
            order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + cycle))
            begin, end = max(start - cycle * total, 0), min(stop - cycle * total, total)
            parts.append(self.ids[order[begin:end]])
        return torch.cat(parts)

    def choose(self, epoch: int, chunk, ctx: ChunkContext) -> Batch:
        if epoch != self._epoch:
            self._epoch, self._chosen = epoch, SampleIndex(self.epoch_subset(epoch))
        # On the host, where a memory shard's ids and positions are: no round waits on the device.
        _, chosen = self._chosen.find(ctx.sample_ids(chunk).cpu())
        return ctx.load(chunk[chosen.to(chunk.device)])
