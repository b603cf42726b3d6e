"""Each example's last recorded loss, keyed by stable sample id: what stale and free scores read.

The table lives on the host, where the strategies that read it decide (a chunk's positions
and ids are host tensors): a decision from recorded losses never waits for the GPU. Records
(a training step's losses, a selection forward's) wait where they were made until `flush`,
which the selection rounds call where they read the training losses anyway (every 16 steps
on a GPU, raysb.training.selection.rounds): recording adds no host sync.

A table built over a known training set needs no search for new ids. One built empty (a
user's own data, ids not known in advance) grows as ids are first recorded.

On lockstep ranks every rank holds the same table: a record waits until the next exchange
carries it to every rank (`take_unshared`), and every rank then applies all ranks' records
in rank order (`apply`), its own included. A sharded table (`shard`) holds only the examples
its rank owns, and reads the whole set's distribution and mean from every rank's, summed as each
epoch starts (raysb.training.selection.shard_summary).

With `distribution=True` the table also counts its recorded losses into loss-histogram bins
(raysb.core.histogram), kept up to date as records replace each other: the CDF of the whole
data set's recorded losses, which free scores are ranked against.

With `margins=True` it also keeps, for every example a training forward recorded, the running
margin of its label (raysb.core.label_doubt), how many trainings made it, the label the model
predicted at the last and the label it was given: what tells a wrong label from a hard one,
carried with the losses (raysb.training.selection.margin_columns).
"""

from __future__ import annotations

import zlib

import torch

from raysb.core.histogram import LOSS_BINS, bin_indices, bin_values, histogram_ranks
from raysb.core.label_doubt import ClassLogits, logit_margins, recent_wrong_share, silenced, suspected
from raysb.core.sample_index import SampleIndex, last_of_each
from raysb.core.spec import SelectionSpec
from raysb.core.transfer import to_device, to_host
from raysb.training.selection.margin_columns import MARGIN_COLUMNS, MarginColumn, MarginColumns
from raysb.training.selection.shard_summary import ShardSummary, owning_ranks


class LossTable:
    def __init__(self, sample_ids: torch.Tensor | None = None, *, shared: bool = False, distribution: bool = False,
                 margins: bool = False):
        """`sample_ids`: the training set's ids (None: grow as ids are recorded). `shared`: lockstep
        ranks exchange records before applying them. `distribution`: keep the recorded losses' counts.
        `margins`: keep each trained example's running margin, training count and predicted label."""
        self.fixed = sample_ids is not None
        self.shared = shared
        self.tracks_distribution = distribution
        self.tracks_margins = margins
        ids = torch.empty(0, dtype=torch.int64) if sample_ids is None else to_host(sample_ids)
        self.index = SampleIndex(ids)
        self.losses = torch.full((ids.numel(),), float("nan"))
        # The epoch each loss was recorded in (-1: never), for refreshes of old scores.
        self.recorded_epoch = torch.full((ids.numel(),), -1, dtype=torch.int32)
        self.margin_columns = MarginColumns(ids.numel())
        self.counts = torch.zeros(LOSS_BINS, dtype=torch.int64)
        # The epoch records made now are stamped with (set by the strategy as an epoch starts).
        self.epoch = 0
        # Records not yet written: where they were made, until a flush (one process) or the next
        # exchange (lockstep ranks) takes them. Each is (ids, losses, what gives their margin rows):
        # a forward's ClassLogits, rows already made (a checkpoint's), or None (losses alone).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, ClassLogits | torch.Tensor | None]] = []
        # Sharded: this rank's part of the whole set and what it reads of every rank's (raysb.training.selection
        # .shard_summary); None: the whole set.
        self.owner: ShardSummary | None = None

    def shard(self, rank: int, world_size: int) -> None:
        """Hold only the examples whose id is `rank` mod `world_size` from now on (a fresh table)."""
        if not self.fixed:
            raise ValueError("a sharded loss table needs the training set's sample ids in advance")
        if self.losses.isnan().logical_not().any() or self._pending:
            raise ValueError("a loss table is sharded before anything is recorded in it")
        ids = self.index.ids
        self.__init__(ids[owning_ranks(ids, world_size) == rank], shared=self.shared,
                      distribution=self.tracks_distribution, margins=self.tracks_margins)
        self.owner = ShardSummary(rank, world_size)

    @property
    def sharded(self) -> bool:
        return self.owner is not None

    def owns(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Which of `sample_ids` this table holds a loss for (every one, unless sharded)."""
        if self.owner is None:
            return torch.ones(sample_ids.shape, dtype=torch.bool)
        return self.owner.owns(sample_ids)

    def distribution_counts(self) -> torch.Tensor:
        """How many recorded losses fall in each histogram bin, over the whole training set."""
        if self.owner is None:
            return self.counts
        return self.owner.part("counts").round().long()

    def suspect_counts(self) -> torch.Tensor:
        """How many of the suspects' recorded losses fall in each histogram bin, over the whole training set."""
        if self.owner is None:
            return self.counts_of(self.suspects())
        return self.owner.part("suspect_counts").round().long()

    def recent_wrong_share(self, epoch: int) -> float | None:
        """The labels' measure over the whole training set (raysb.core.label_doubt.recent_wrong_share) for
        the examples trained in `epoch`; a sharded table's, as its last summary counted it."""
        if self.owner is None:
            return recent_wrong_share(self.margins, self.trainings, self.recorded_epoch, epoch)
        return self.owner.recent_wrong_share(epoch)

    @classmethod
    def for_run(cls, spec: SelectionSpec, sample_ids: torch.Tensor | None, distribution: bool = False,
                margins: bool = False) -> LossTable:
        """A strategy's table over the training set's ids (or growing), shared by lockstep ranks."""
        return cls(sample_ids, shared=spec.lockstep, distribution=distribution, margins=margins)

    def record(self, sample_ids: torch.Tensor, losses: torch.Tensor | None, logits: ClassLogits | None = None) -> None:
        """Record `losses` as these examples' last, with the margins of a training forward's `logits`
        where the table keeps them: written at the next `flush`, or on lockstep ranks when the next
        exchange has carried them to every rank. Recording waits for nothing and computes nothing.
        `losses` None: the margins alone, the recorded losses left as they are (Stale-SB's training
        forwards, whose losses do not replace its selection pass's)."""
        if losses is None:
            losses = torch.full(sample_ids.shape, float("nan"), device=logits.logits.device)
        self._pending.append((sample_ids.detach(), losses.detach(), logits if self.tracks_margins else None))

    def flush(self) -> None:
        """One process: write the records made since the last flush, brought to the host in one copy
        (on a GPU, where the caller has just waited for the device). Lockstep ranks' records wait
        for the exchange, which copies them with the round's kept examples."""
        if self.shared or not self._pending:
            return
        ids, records = self.take_unshared()
        copied = to_host(torch.cat([ids.double().unsqueeze(0), records.double()]))  # float64 holds ids up to 2**53
        self.apply(copied[0].long(), copied[1:].float())

    def take_unshared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The records not written yet, as (ids, records) where the first was made, `records` with
        RECORD_ROWS rows (loss, margin, predicted label, given label) and a column an id (the exchange copies them to
        the host with the round's kept examples)."""
        if not self._pending:
            return torch.empty(0, dtype=torch.int64), torch.empty(RECORD_ROWS, 0)
        pending, self._pending = self._pending, []
        device = pending[0][1].device
        # Plain loops (a flush a read, every step on a CPU). The margins of every forward that left its
        # logits are computed in one go, each record's rows then put in its place.
        ids, losses, logits, labels = [], [], [], []
        for record_ids, record_losses, rows in pending:
            ids.append(to_device(record_ids, device))
            losses.append(to_device(record_losses, device).float())
            if isinstance(rows, ClassLogits):
                logits.append(to_device(rows.logits, device))
                labels.append(to_device(rows.labels, device))
        margin_rows = None
        if logits:
            margins = logit_margins(torch.cat(logits), torch.cat(labels))
            margin_rows = torch.stack([margins.margins, margins.predicted.float(), margins.labels.float()])
        if len(logits) < len(pending):
            margin_rows = _rows_in_place(pending, margin_rows, [forward.numel() for forward in labels], device)
        return torch.cat(ids), torch.cat([torch.cat(losses).unsqueeze(0), margin_rows])

    def apply(self, sample_ids: torch.Tensor, records: torch.Tensor) -> None:
        """Write host records (`take_unshared`'s) into the table now (a sharded one: those of the examples
        it owns). An id named twice keeps its last loss, counted once; a margin counts as one training."""
        if records.dim() == 1:
            records = _loss_records(records)
        if self.owner is not None:
            mine = self.owns(sample_ids)
            sample_ids, records = sample_ids[mine], records[:, mine]
        if not sample_ids.numel():
            return
        all_slots = self.index.slots(sample_ids, checked=False) if self.fixed else self._grown_slots(sample_ids)
        if self.tracks_margins:
            self.margin_columns.unsettled.append((all_slots, records[1:]))
        losses = records[0].float()
        if self.tracks_margins:  # a record of a margin alone (NaN loss) leaves its example's loss as it was
            has_loss = ~torch.isnan(losses)
            all_slots, losses = all_slots[has_loss], losses[has_loss]
        slots, losses = last_of_each(all_slots, losses)
        before = self.losses[slots]
        self.losses[slots] = losses
        self.recorded_epoch[slots] = self.epoch
        if self.tracks_distribution:
            # Each written example's count moves from its old loss's bin to its new one.
            self.counts.index_add_(0, bin_indices(before), -(~torch.isnan(before)).long())
            self.counts.index_add_(0, bin_indices(losses), torch.ones_like(slots))

    # Each a column over the table's examples, in `index.ids` order, read settled (_MarginColumn).
    margins = MarginColumn()  # the running margin (NaN: never trained with one)
    trainings = MarginColumn()  # how many trainings with a margin
    predicted = MarginColumn()  # the label the model gave at the last training (-1: none)
    labels = MarginColumn()  # the label it was trained with (-1: none recorded)

    def _grown_slots(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """A growing table's slots of `sample_ids`, the ids it does not hold yet added first."""
        slots, held = self.index.find(sample_ids)
        if bool(held.all()):
            return slots
        self._grow(sample_ids[~held])
        return self.index.slots(sample_ids, checked=False)

    def _grow(self, new_ids: torch.Tensor) -> None:
        old_ids = self.index.ids
        losses, recorded_epoch = self.losses, self.recorded_epoch
        self.index = SampleIndex(torch.cat([old_ids, torch.unique(new_ids)]))
        size = self.index.ids.numel()
        slots = self.index.slots(old_ids, checked=False)
        self.losses = torch.full((size,), float("nan"))
        self.recorded_epoch = torch.full((size,), -1, dtype=torch.int32)
        self.losses[slots], self.recorded_epoch[slots] = losses, recorded_epoch
        self.margin_columns = self.margin_columns.grown(size, slots)

    def lookup(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Recorded losses; NaN where an example was never recorded."""
        return self.gather(self.losses, sample_ids, float("nan"))

    def epochs_recorded(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """The epoch each example's loss was recorded in; -1 where it never was."""
        return self.gather(self.recorded_epoch, sample_ids, -1)

    def gather(self, column: torch.Tensor, sample_ids: torch.Tensor, missing) -> torch.Tensor:
        """`column`'s values (one per example of the table, in `index.ids` order) at `sample_ids`;
        `missing` where the table holds no such example."""
        sample_ids = sample_ids.cpu()
        if self.fixed and self.owner is None:
            return column[self.index.slots(sample_ids, checked=False)]
        if not self.index.ids.numel():
            return torch.full((sample_ids.numel(),), missing, dtype=column.dtype)
        slots, held = self.index.find(sample_ids)
        # A column taken as an epoch began (the doubted) covers only the examples the table held then.
        held &= slots < column.numel()
        values = torch.full((sample_ids.numel(),), missing, dtype=column.dtype)
        values[held] = column[slots[held]]
        return values

    def suspects(self) -> torch.Tensor:
        """Which of the table's examples (in `index.ids` order) the model persistently disagrees with
        (raysb.core.label_doubt.suspected); none where margins are not kept."""
        return suspected(self.margins, self.trainings)

    def silenced_suspects(self) -> torch.Tensor:
        """The suspects label_doubt=tiered trains with loss weight 0 (raysb.core.label_doubt.silenced)."""
        return silenced(self.margins, self.trainings)

    def counts_of(self, mask: torch.Tensor) -> torch.Tensor:
        """The recorded losses of the examples at `mask` (over `index.ids`), counted into histogram bins."""
        losses = self.losses[mask]
        return torch.bincount(bin_indices(losses[~torch.isnan(losses)]), minlength=LOSS_BINS)

    def mean(self) -> torch.Tensor:
        """The mean recorded loss over the whole training set (NaN while nothing is recorded)."""
        if self.owner is None:
            return torch.nanmean(self.losses)
        total, count = self.owner.part("loss_sum_and_count").tolist()
        return torch.tensor(total / count if count else float("nan"), dtype=torch.float32)

    def checksum(self) -> int:
        """CRC-32 of the recorded losses, and of the margins where kept: equal on every lockstep rank (its
        own shard's, if sharded)."""
        checksum = zlib.crc32(self.losses.numpy().tobytes())
        if self.tracks_margins:
            for column in (self.margins, self.trainings, self.predicted, self.labels):
                checksum = zlib.crc32(column.numpy().tobytes(), checksum)
        return checksum

    def state_dict(self) -> dict:
        self.flush()
        ids, records = (to_host(part) for part in self.take_unshared())
        self._pending = _as_pending(ids, records)
        return {"ids": self.index.ids.clone(), **{name: getattr(self, name).clone() for name in COLUMNS},
                "epoch": self.epoch, "unshared": (ids, records)}

    def load_state_dict(self, state: dict) -> None:
        """A table built over a training set takes only a checkpoint of that set; an empty one takes any."""
        if "recorded_epoch" not in state:
            raise ValueError(
                "this checkpoint's loss table was written by a raysb from before 2026-11-26, which kept no record "
                "epochs: start the run afresh (--overwrite), or resume it with the raysb that made it"
            )
        if self.fixed and not torch.equal(state["ids"], self.index.ids):
            raise ValueError("checkpointed loss table covers a different training set")
        self.index = SampleIndex(state["ids"].cpu())
        self.losses = state["losses"].cpu().clone()
        self.recorded_epoch = state["recorded_epoch"].cpu().clone()
        self.margin_columns.load(state, self.index.ids.numel())
        self.epoch = int(state["epoch"])
        self._pending = _as_pending(*state["unshared"])
        if self.tracks_distribution:
            self.counts.zero_()
            scored = self.losses[~torch.isnan(self.losses)]
            self.counts.index_add_(0, bin_indices(scored), torch.ones_like(scored, dtype=torch.int64))


class RecordedLosses:
    """A `LossTable`'s recorded losses as the history a `Selector` ranks against: it ranks a loss
    among every example's recorded one as they stood at the last `freeze` (an epoch's start), and
    learns nothing from the losses it ranks.

    Frozen, each chunk of an epoch is a uniform sample of the losses it is ranked against (an
    example is ranked once an epoch, before its own record changes), so the expected kept share
    is exactly 1 / (beta + 1). Ranked against the live table it drifted up (38.6% at s = 1/3 in
    an epoch of the small CNN): the kept examples' records fall as they are trained on, and the
    chunks still to come rank higher against them.
    """

    def __init__(self, table: LossTable):
        if not table.tracks_distribution:
            raise ValueError("ranking against recorded losses needs a table built with distribution=True")
        self.table = table
        self.frozen = table.counts.clone()

    def freeze(self, without_suspects: bool = False) -> None:
        """Rank against the table's losses as they are now, until the next freeze, less the suspects'
        (LossTable.suspects, over the whole training set) where asked."""
        self.frozen = self.table.distribution_counts().clone()
        if without_suspects:
            self.frozen -= self.table.suspect_counts()

    def extend(self, losses: torch.Tensor) -> None:
        pass  # the table learns from training steps, not from what is ranked

    def ranks(self, losses: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
        return histogram_ranks(self.frozen, losses, tie_break)

    def values(self) -> torch.Tensor:
        return torch.repeat_interleave(bin_values(), self.frozen)

    def __len__(self) -> int:
        return int(self.frozen.sum())

    def state_dict(self) -> dict:
        return {}  # the table is the strategy's state; a restored run freezes it again as its next epoch starts

    def load_state_dict(self, state: dict) -> None:
        pass


RECORD_ROWS = 4  # a record's loss, margin, predicted label and given label
# The per-example columns a table keeps, in its checkpoint under these names.
COLUMNS = ("losses", "recorded_epoch", *MARGIN_COLUMNS)


def _loss_records(losses: torch.Tensor) -> torch.Tensor:
    """Records of losses alone: no margin (NaN) and no labels (-1), as a selection forward's loss or a
    loss function without logits gives."""
    return torch.cat([losses.float().unsqueeze(0), _unknown_rows(losses.numel(), losses.device)])


def _as_pending(ids: torch.Tensor, records: torch.Tensor) -> list:
    """Records taken out (`take_unshared`), or a checkpoint's, pending again: records of losses alone
    (a checkpoint from before margins were recorded) with no margins."""
    if records.dim() == 1:
        records = _loss_records(records)
    return [(ids, records[0], records[1:])] if ids.numel() else []


def _rows_in_place(pending: list, computed: torch.Tensor | None, sizes: list[int], device) -> torch.Tensor:
    """The margin rows of `pending` records of which only some had a forward's logits, each in its place:
    `computed`, the forwards' rows in order (`sizes` columns each); no margin for those with losses alone;
    rows already made as they were."""
    forwards = iter(computed.split(sizes, dim=1) if computed is not None else ())
    parts = []
    for _, losses, rows in pending:
        parts.append(next(forwards) if isinstance(rows, ClassLogits) else
                     _unknown_rows(losses.numel(), device) if rows is None else to_device(rows, device))
    return torch.cat(parts, dim=1)


def _unknown_rows(count: int, device: torch.device) -> torch.Tensor:
    """The margin rows of `count` records without logits: margin NaN, predicted and given label -1."""
    rows = torch.full((RECORD_ROWS - 1, count), -1.0, device=device)
    rows[0] = float("nan")
    return rows
