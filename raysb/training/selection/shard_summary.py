"""A sharded loss table's part of the whole training set: which examples its rank owns (id mod ranks),
its records sent to their owners, and the summary of every rank's table it reads in place of the whole
set's (raysb.training.selection.loss_table, `LossTable.shard`).

At 1B examples a replicated table's records cost every rank minutes an epoch (BENCHMARKS.md, "The loss
table at 1M to 1B examples"): a sharded table holds only the examples its rank owns, receives and applies
only their records (`records_by_owner`, sent in one all-to-all), and reads the whole set's distribution
and mean from every rank's, summed as each epoch starts (`ShardSummary.share`). The same sum carries what
label doubt reads of the whole set: the suspects' loss counts and the counts of the labels' measure.
"""

from __future__ import annotations

import torch

from raysb.core.histogram import LOSS_BINS
from raysb.core.label_doubt import recent_wrong_counts, share_of
from raysb.core.transfer import to_host

# What a sharded table's ranks sum as an epoch starts (ShardSummary.share), where it lies in the sum: the
# recorded losses' bin counts, the suspects' bin counts, the loss sum and count, and the label measure's
# confidently wrong and judged counts.
SUMMARY_PARTS = {"counts": slice(0, LOSS_BINS), "suspect_counts": slice(LOSS_BINS, 2 * LOSS_BINS),
                 "loss_sum_and_count": slice(2 * LOSS_BINS, 2 * LOSS_BINS + 2),
                 "label_measure": slice(2 * LOSS_BINS + 2, 2 * LOSS_BINS + 4)}


class ShardSummary:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # Every rank's summary (SUMMARY_PARTS) as summed at the last `share`, with the epoch its label
        # measure counts.
        self._summed: torch.Tensor | None = None
        self._epoch: int | None = None

    def owns(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Which of `sample_ids` this rank's table holds."""
        return owning_ranks(sample_ids.cpu(), self.world_size) == self.rank

    def share(self, table, collective) -> None:
        """Sum every rank's `table` summary (one all-reduce; lockstep ranks call it together as an epoch
        starts, after the exchange of the last epoch's records): its recorded-loss counts, its suspects'
        counts, loss sum and count, and the counts of the label measure over the records of the epoch they
        were stamped with (`recent_wrong_share`), which the table reads until the next."""
        scored = table.losses[~torch.isnan(table.losses)].double()
        wrong, judged = recent_wrong_counts(table.margins, table.trainings, table.recorded_epoch, table.epoch)
        local = torch.cat([table.counts.double(), table.counts_of(table.suspects()).double(),
                           torch.tensor([float(scored.sum()), scored.numel(), wrong, judged], dtype=torch.float64)])
        self._summed = collective.all_sum(local)
        self._epoch = table.epoch

    def part(self, name: str) -> torch.Tensor:
        """`name` (SUMMARY_PARTS) of the summary every rank's table shared last."""
        if self._summed is None:
            raise RuntimeError("a sharded loss table's distribution is read after its summary is shared "
                               "(ShardSummary.share)")
        return self._summed[SUMMARY_PARTS[name]]

    def recent_wrong_share(self, epoch: int) -> float | None:
        """The labels' measure over the whole set for the examples trained in `epoch`, as the last `share`
        counted it."""
        if epoch > self._epoch:
            # Nothing is stamped later than the stamp the summary counted (an epoch that trained on
            # everything, a primed one, leaves the stamp where it was): as a replicated table finds, none.
            return None
        if epoch < self._epoch:
            raise RuntimeError(f"a sharded loss table's summary counted epoch {self._epoch}'s labels, "
                               f"not epoch {epoch}'s")
        wrong, judged = (int(count) for count in self.part("label_measure").round().tolist())
        return share_of(wrong, judged)


def owning_ranks(sample_ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank whose sharded table holds each example: its id mod the ranks."""
    return sample_ids.remainder(world_size)


def records_by_owner(sample_ids: torch.Tensor, records: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`LossTable.take_unshared`'s records split by the rank whose sharded table owns each (id mod ranks), in
    record order within each: a host row of bytes per record, its id (int64) and then its record rows
    (float32, as `LossTable.apply` reads them)."""
    ids, values = to_host(sample_ids).long(), to_host(records).float()
    owners = owning_ranks(ids, world_size).int()
    order = torch.sort(owners, stable=True).indices
    rows = torch.cat([ids[order].unsqueeze(1).view(torch.uint8), values[:, order].T.contiguous().view(torch.uint8)],
                     dim=1)
    return list(rows.split(torch.bincount(owners, minlength=world_size).tolist()))


def records_of_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`records_by_owner`'s rows back as (ids, records), what `LossTable.apply` takes."""
    return rows[:, :8].contiguous().view(torch.int64).reshape(-1), rows[:, 8:].contiguous().view(torch.float32).T
