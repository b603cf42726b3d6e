"""Stable sample ids -> rows, for tables keyed by id (stale losses, lockstep gathers)."""

from __future__ import annotations

import torch


class SampleIndex:
    def __init__(self, sample_ids: torch.Tensor):
        self.ids, self.rows = torch.sort(sample_ids)

    def slots(self, sample_ids: torch.Tensor, checked: bool = True) -> torch.Tensor:
        """Position of each id in sorted order; KeyError for an id the index does not hold.

        `checked=False` skips that check (and its two host syncs) for ids known to be held.
        """
        sample_ids = sample_ids.to(self.ids.device).contiguous()
        slots = torch.searchsorted(self.ids, sample_ids)
        if not checked:
            return slots
        if bool((slots >= self.ids.numel()).any()) or not bool(
            (self.ids[slots.clamp_max(self.ids.numel() - 1)] == sample_ids).all()
        ):
            raise KeyError("sample ids outside the training set")
        return slots

    def holds(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Whether the index holds each id (a bool mask on the index's device)."""
        sample_ids = sample_ids.to(self.ids.device).contiguous()
        if not self.ids.numel():
            return torch.zeros(sample_ids.shape, dtype=torch.bool, device=self.ids.device)
        slots = torch.searchsorted(self.ids, sample_ids).clamp_max(self.ids.numel() - 1)
        return self.ids[slots] == sample_ids

    def rows_of(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Row of each id in the tensor the index was built from."""
        return self.rows[self.slots(sample_ids)]
