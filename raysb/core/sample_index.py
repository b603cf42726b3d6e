"""Stable sample ids -> rows, for tables keyed by id (stale losses, lockstep gathers)."""

from __future__ import annotations

import torch

from raysb.core.transfer import to_device


class SampleIndex:
    def __init__(self, sample_ids: torch.Tensor):
        self.ids, self.rows = torch.sort(sample_ids)
        # Ids that run evenly from the first (a data set's 0..N-1, the usual case, or every k-th of them,
        # a sharded loss table's) are found by arithmetic: no search. The search cost a loss table 1 us
        # of its ~1.6 us a record at 10M examples (BENCHMARKS.md, "The loss table at 1M to 1B
        # examples"). Checked on the host only: on a device the check would wait for it.
        self.first, self.stride = None, 1
        if self.ids.device.type == "cpu" and self.ids.numel():
            steps = self.ids.diff()
            stride = int(steps[0]) if steps.numel() else 1
            if stride > 0 and bool((steps == stride).all()):
                self.first, self.stride = int(self.ids[0]), stride

    def find(self, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot of each id in sorted order, whether the index holds it), from one search (none for
        unbroken ids)."""
        sample_ids = to_device(sample_ids, self.ids.device).contiguous()
        if self.first is not None:
            offsets = sample_ids - self.first
            slots = offsets.div(self.stride, rounding_mode="floor") if self.stride > 1 else offsets
            held = (slots >= 0) & (slots < self.ids.numel())
            if self.stride > 1:
                held &= offsets.remainder(self.stride) == 0
            return slots.clamp(0, self.ids.numel() - 1), held
        if not self.ids.numel():
            return torch.zeros_like(sample_ids), torch.zeros(sample_ids.shape, dtype=torch.bool, device=self.ids.device)
        slots = torch.searchsorted(self.ids, sample_ids).clamp_max(self.ids.numel() - 1)
        return slots, self.ids[slots] == sample_ids

    def slots(self, sample_ids: torch.Tensor, checked: bool = True) -> torch.Tensor:
        """Position of each id in sorted order; KeyError for an id the index does not hold.

        `checked=False` skips that check (and its host sync) for ids known to be held.
        """
        if not checked:
            if self.first is not None:
                offsets = to_device(sample_ids, self.ids.device) - self.first
                return offsets.div(self.stride, rounding_mode="floor") if self.stride > 1 else offsets
            return torch.searchsorted(self.ids, to_device(sample_ids, self.ids.device).contiguous())
        slots, held = self.find(sample_ids)
        if not bool(held.all()):
            raise KeyError("sample ids outside the training set")
        return slots

    def rows_of(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Row of each id in the tensor the index was built from."""
        return self.rows[self.slots(sample_ids)]


def each_once(slots: torch.Tensor) -> bool:
    """Whether no slot of a nonempty `slots` repeats, as in most records, told without a sort. Only where the
    slots span little more than their count (an epoch's records at once): counting a round's few records in a
    large table would cost the table's size each time, so those take the sort (False)."""
    return int(slots.max()) < 4 * slots.numel() and int(torch.bincount(slots).max()) == 1


def first_of_each(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each slot's first occurrence in `slots`, and of the rest, both in order."""
    if each_once(slots):
        return torch.arange(slots.numel()), torch.empty(0, dtype=torch.int64)
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return order[first].sort().values, order[~first].sort().values


def last_of_each(slots: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`slots` without repeats, each with the value of its last occurrence (a batch that spans an
    epoch's end can hold an example twice)."""
    if not slots.numel() or each_once(slots):
        return slots, values
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return ordered[last], values[order][last]
