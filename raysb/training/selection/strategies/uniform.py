"""RS2: a fresh uniform random subset each epoch, the baseline a scoring forward must beat."""

from __future__ import annotations

import torch

from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_host
from raysb.training.selection.strategies.base import Decision, Strategy

# The stream's cycle c under seed s is seeded with s * CYCLE_SEED_STRIDE + c: a different seed for
# every (s, c) while a run has fewer cycles than this, so no two cycles, of one run or of runs with
# different seeds, draw the same order. Changing it changes every fixed-seed uniform run's subsets.
CYCLE_SEED_STRIDE = 1_000_003


class UniformStrategy(Strategy):
    """RS2 (Okanovic et al., 2023): each epoch trains on a fresh uniform random subset of
    round(s * N) examples, drawn without replacement across epochs until every example has
    been used, then from a new permutation. No scoring forward at all: the baseline that SB's
    scoring must beat.

    Epoch e's subset is slice [e*k, (e+1)*k) of an endless stream of seeded permutations
    of the training set's ids, a pure function of (seed, epoch): every rank agrees on it
    without talking, and a resumed run draws exactly what it would have. Under a kept-fraction
    schedule each epoch's k is set as it starts, and its slice follows the ones before it.
    """

    name = "uniform"

    def __init__(self, sample_ids: torch.Tensor | None, selectivity: float, seed: int):
        if sample_ids is None:
            raise ValueError("strategy uniform draws from the whole training set: it needs the set's sample ids")
        self.ids = to_host(sample_ids)
        self.per_epoch = self._count(selectivity)
        self.seed = seed
        self._epoch, self._chosen = None, None
        # The epochs whose k a schedule set (the others take per_epoch).
        self.counts: dict[int, int] = {}

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> UniformStrategy:
        return cls(sample_ids, spec.selectivity, spec.seed)

    def _count(self, selectivity: float) -> int:
        return max(1, round(selectivity * self.ids.numel()))

    def set_selectivity(self, epoch: int, selectivity: float) -> None:
        self.counts[epoch] = self._count(selectivity)

    def epoch_subset(self, epoch: int) -> torch.Tensor:
        """The ids epoch `epoch` trains on: k distinct ids, slice [start, start + k) of the stream."""
        total = self.ids.numel()
        slices = self._slices(epoch)
        start, stop = slices[epoch]
        parts = []
        for cycle in range(start // total, (stop - 1) // total + 1):
            begin, end = max(start - cycle * total, 0), min(stop - cycle * total, total)
            parts.append(self._order(cycle, slices)[begin:end])
        return self.ids[torch.cat(parts)]

    def _slices(self, epoch: int) -> list[tuple[int, int]]:
        """Each epoch's [start, stop) in the stream, up to `epoch`'s: consecutive, k_e long."""
        slices, start = [], 0
        for each in range(epoch + 1):
            stop = start + self.counts.get(each, self.per_epoch)
            slices.append((start, stop))
            start = stop
        return slices

    def _order(self, cycle: int, slices: list[tuple[int, int]]) -> torch.Tensor:
        """Cycle `cycle` of the stream: a seeded permutation of positions in the training set. Where an
        epoch's slice spans the boundary into it, the ids that epoch took from the cycle before go
        last, so no epoch trains on an id twice and every id still comes once a cycle."""
        total = self.ids.numel()
        order = torch.randperm(total, generator=torch.Generator().manual_seed(self.seed * CYCLE_SEED_STRIDE + cycle))
        boundary = cycle * total
        spanning = next((start for start, stop in slices if start < boundary < stop), None)
        if spanning is None:
            return order
        taken = torch.zeros(total, dtype=torch.bool)
        taken[self._order(cycle - 1, slices)[spanning - boundary + total:]] = True
        return torch.cat([order[~taken[order]], order[taken[order]]])

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        return Decision(self._chosen_mask(epoch, ids).nonzero().squeeze(1))

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        return True

    def _chosen_mask(self, epoch: int, sample_ids: torch.Tensor) -> torch.Tensor:
        """Which of `sample_ids` epoch `epoch` trains on."""
        if epoch != self._epoch:
            self._epoch, self._chosen = epoch, SampleIndex(self.epoch_subset(epoch))
        # On the host, where a memory shard's ids and positions are: no round waits on the device.
        _, chosen = self._chosen.find(sample_ids.cpu())
        return chosen

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {int(epoch): int(count) for epoch, count in state.get("counts", {}).items()}
        self._epoch = None
