"""The running margins a loss table keeps beside its losses (raysb.core.label_doubt): for every example a
training forward recorded, the running margin of its label, how many trainings made it, the label the
model predicted at the last and the label it was given. What tells a wrong label from a hard one.

A step's margin records wait as they were applied, and are folded in whole when a column is read (an
epoch's start, an evaluation, a checkpoint), which costs a step next to nothing.
"""

from __future__ import annotations

import torch

from raysb.core.label_doubt import running_margin
from raysb.core.sample_index import first_of_each

MARGIN_COLUMNS = ("margins", "trainings", "predicted", "labels")


class MarginColumn:
    """A table's margin column (MARGIN_COLUMNS, named as the attribute), read with every margin
    recorded since the last read folded in (`MarginColumns.settled`)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, table, owner=None):
        return self if table is None else table.margin_columns.settled()[self.name]


class MarginColumns:
    def __init__(self, size: int):
        """Columns over `size` examples: running margins (NaN: never trained with one), training counts,
        predicted and given labels (-1: none)."""
        self.columns = dict(zip(MARGIN_COLUMNS, empty_margins(size)))
        # Margin records applied since the last read, folded in at the next: (the examples' slots, rows of
        # margin, predicted label and given label; a NaN margin is none).
        self.unsettled: list[tuple[torch.Tensor, torch.Tensor]] = []

    def settled(self) -> dict[str, torch.Tensor]:
        """The columns with every margin added since the last read folded in: each moves its example's
        running margin, in record order (an example trained twice since, takes both)."""
        if not self.unsettled:
            return self.columns
        slots = torch.cat([slots for slots, _ in self.unsettled])
        records = torch.cat([records for _, records in self.unsettled], dim=1)
        self.unsettled = []
        has_margin = ~torch.isnan(records[0])
        slots, records = slots[has_margin], records[:, has_margin]
        columns = self.columns
        while slots.numel():
            first, later = first_of_each(slots)
            at = slots[first]
            columns["margins"][at] = running_margin(columns["margins"][at], columns["trainings"][at], records[0, first])
            columns["trainings"][at] += 1
            columns["predicted"][at] = records[1, first].long()
            columns["labels"][at] = records[2, first].long()
            slots, records = slots[later], records[:, later]
        return columns

    def grown(self, size: int, old_slots: torch.Tensor) -> MarginColumns:
        """These columns over `size` examples, the current ones' at `old_slots` (settled first)."""
        grown = MarginColumns(size)
        for name, column in self.settled().items():
            grown.columns[name][old_slots] = column
        return grown

    def load(self, state: dict, size: int) -> None:
        """Columns from a checkpoint (`state`, named as MARGIN_COLUMNS) over `size` examples, nothing left to
        fold in: empty ones from a checkpoint from before margins were kept (none recorded yet)."""
        if "margins" not in state:
            self.columns, self.unsettled = dict(zip(MARGIN_COLUMNS, empty_margins(size))), []
            return
        self.columns = {name: state[name].cpu().clone() for name in MARGIN_COLUMNS}
        self.unsettled = []


def empty_margins(size: int) -> tuple[torch.Tensor, ...]:
    """Running margins (NaN: never trained with one), training counts, predicted and given labels (-1)."""
    return (torch.full((size,), float("nan")), torch.zeros(size, dtype=torch.int32),
            torch.full((size,), -1, dtype=torch.int64), torch.full((size,), -1, dtype=torch.int64))
