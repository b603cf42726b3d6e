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
its rank owns (id mod ranks), receives and applies only their records (`records_by_owner`, sent
in one all-to-all), and reads the whole set's
distribution and mean from every rank's, summed as each epoch starts (`share_summary`): at
1B examples a replicated table's records cost every rank minutes an epoch (BENCHMARKS.md,
"The loss table at 1M to 1B examples"). The same sum carries what label doubt reads of the whole
set: the suspects' loss counts and the counts of the labels' measure.

With `distribution=True` the table also counts its recorded losses into loss-histogram bins
(raysb.core.histogram), kept up to date as records replace each other: the CDF of the whole
data set's recorded losses, which free scores are ranked against.

With `margins=True` it also keeps, for every example a training forward recorded, the running
margin of its label (raysb.core.label_doubt), how many trainings made it, the label the model
predicted at the last and the label it was given: what tells a wrong label from a hard one,
carried with the losses.
"""

from __future__ import annotations

import zlib

import torch

from raysb.core.histogram import LOSS_BINS, bin_indices, bin_values, histogram_ranks
from raysb.core.label_doubt import (
    ClassLogits, logit_margins, recent_wrong_counts, recent_wrong_share, running_margin, share_of, silenced, suspected,
)
from raysb.core.sample_index import SampleIndex
from raysb.core.spec import SelectionSpec
from raysb.core.transfer import to_device, to_host


class _MarginColumn:
    """A LossTable's margin column (MARGIN_COLUMNS, named as the attribute), read with every margin
    recorded since the last read folded in (LossTable._settled)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, table, owner=None):
        return self if table is None else table._settled()[self.name]


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
        # The margin columns (MARGIN_COLUMNS) as last settled, and the margin records applied since: a
        # step's records wait as a reference, and are folded in whole when a column is read (an
        # epoch's start, an evaluation, a checkpoint), which costs a step next to nothing.
        self._margin_columns = dict(zip(MARGIN_COLUMNS, _empty_margins(ids.numel())))
        self._unsettled: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.counts = torch.zeros(LOSS_BINS, dtype=torch.int64)
        # The epoch records made now are stamped with (set by the strategy as an epoch starts).
        self.epoch = 0
        # Records not yet written: where they were made, until a flush (one process) or the next
        # exchange (lockstep ranks) takes them. Each is (ids, losses, what gives their margin rows):
        # a forward's ClassLogits, rows already made (a checkpoint's), or None (losses alone).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, ClassLogits | torch.Tensor | None]] = []
        # Sharded: (this rank, ranks), and every rank's summary (SUMMARY_PARTS) as summed at the last
        # `share_summary`, with the epoch its label measure counts.
        self.owner: tuple[int, int] | None = None
        self._summary: torch.Tensor | None = None
        self._summary_epoch: int | None = None

    def shard(self, rank: int, world_size: int) -> None:
        """Hold only the examples whose id is `rank` mod `world_size` from now on (a fresh table)."""
        if not self.fixed:
            raise ValueError("a sharded loss table needs the training set's sample ids in advance")
        if self.losses.isnan().logical_not().any() or self._pending:
            raise ValueError("a loss table is sharded before anything is recorded in it")
        ids = self.index.ids
        self.__init__(ids[owning_ranks(ids, world_size) == rank], shared=self.shared,
                      distribution=self.tracks_distribution, margins=self.tracks_margins)
        self.owner = (rank, world_size)

    @property
    def sharded(self) -> bool:
        return self.owner is not None

    def owns(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Which of `sample_ids` this table holds a loss for (every one, unless sharded)."""
        if self.owner is None:
            return torch.ones(sample_ids.shape, dtype=torch.bool)
        rank, world_size = self.owner
        return owning_ranks(sample_ids.cpu(), world_size) == rank

    def share_summary(self, collective) -> None:
        """Sum every rank's summary (one all-reduce; lockstep ranks call it together as an epoch starts,
        after the exchange of the last epoch's records): its recorded-loss counts, its suspects' counts,
        loss sum and count, and the counts of the label measure over the records of the epoch they were
        stamped with (`recent_wrong_share`), which a sharded table reads until the next."""
        scored = self.losses[~torch.isnan(self.losses)].double()
        wrong, judged = recent_wrong_counts(self.margins, self.trainings, self.recorded_epoch, self.epoch)
        local = torch.cat([self.counts.double(), self.counts_of(self.suspects()).double(),
                           torch.tensor([float(scored.sum()), scored.numel(), wrong, judged], dtype=torch.float64)])
        self._summary = collective.all_sum(local)
        self._summary_epoch = self.epoch

    def _shared(self, part: str) -> torch.Tensor:
        """`part` (SUMMARY_PARTS) of the summary every rank's table shared last."""
        if self._summary is None:
            raise RuntimeError("a sharded loss table's distribution is read after share_summary")
        return self._summary[SUMMARY_PARTS[part]]

    def distribution_counts(self) -> torch.Tensor:
        """How many recorded losses fall in each histogram bin, over the whole training set."""
        if self.owner is None:
            return self.counts
        return self._shared("counts").round().long()

    def suspect_counts(self) -> torch.Tensor:
        """How many of the suspects' recorded losses fall in each histogram bin, over the whole training set."""
        if self.owner is None:
            return self.counts_of(self.suspects())
        return self._shared("suspect_counts").round().long()

    def recent_wrong_share(self, epoch: int) -> float | None:
        """The labels' measure over the whole training set (raysb.core.label_doubt.recent_wrong_share) for
        the examples trained in `epoch`; a sharded table's, as its last `share_summary` counted it."""
        if self.owner is None:
            return recent_wrong_share(self.margins, self.trainings, self.recorded_epoch, epoch)
        if epoch > self._summary_epoch:
            # Nothing is stamped later than the stamp the summary counted (an epoch that trained on
            # everything, a primed one, leaves the stamp where it was): as a replicated table finds, none.
            return None
        if epoch < self._summary_epoch:
            raise RuntimeError(f"a sharded loss table's summary counted epoch {self._summary_epoch}'s labels, "
                               f"not epoch {epoch}'s")
        wrong, judged = (int(count) for count in self._shared("label_measure").round().tolist())
        return share_of(wrong, judged)

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
        ids = torch.cat([to_device(ids, device) for ids, _, _ in pending])
        losses = torch.cat([to_device(losses, device).float() for _, losses, _ in pending])
        return ids, torch.cat([losses.unsqueeze(0), _margin_rows(pending, device)])

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
        all_slots = self._slots_to_write(sample_ids)
        if self.tracks_margins:
            self._unsettled.append((all_slots, records[1:]))
        losses = records[0].float()
        if self.tracks_margins:  # a record of a margin alone (NaN loss) leaves its example's loss as it was
            has_loss = ~torch.isnan(losses)
            all_slots, losses = all_slots[has_loss], losses[has_loss]
        slots, losses = _last_of_each(all_slots, losses)
        before = self.losses[slots]
        self.losses[slots] = losses
        self.recorded_epoch[slots] = self.epoch
        if self.tracks_distribution:
            # Each written example's count moves from its old loss's bin to its new one.
            self.counts.index_add_(0, bin_indices(before), -(~torch.isnan(before)).long())
            self.counts.index_add_(0, bin_indices(losses), torch.ones_like(slots))

    # Each a column over the table's examples, in `index.ids` order, read settled (_MarginColumn).
    margins = _MarginColumn()  # the running margin (NaN: never trained with one)
    trainings = _MarginColumn()  # how many trainings with a margin
    predicted = _MarginColumn()  # the label the model gave at the last training (-1: none)
    labels = _MarginColumn()  # the label it was trained with (-1: none recorded)

    def _settled(self) -> dict[str, torch.Tensor]:
        """The margin columns with every margin applied since the last read folded in: each moves its
        example's running margin, in record order (an example trained twice since, takes both)."""
        if not self._unsettled:
            return self._margin_columns
        slots = torch.cat([slots for slots, _ in self._unsettled])
        records = torch.cat([records for _, records in self._unsettled], dim=1)
        self._unsettled = []
        has_margin = ~torch.isnan(records[0])
        slots, records = slots[has_margin], records[:, has_margin]
        columns = self._margin_columns
        while slots.numel():
            first, later = _first_of_each(slots)
            at = slots[first]
            columns["margins"][at] = running_margin(columns["margins"][at], columns["trainings"][at], records[0, first])
            columns["trainings"][at] += 1
            columns["predicted"][at] = records[1, first].long()
            columns["labels"][at] = records[2, first].long()
            slots, records = slots[later], records[:, later]
        return columns

    def _slots_to_write(self, sample_ids: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return self.index.slots(sample_ids, checked=False)
        slots, held = self.index.find(sample_ids)
        if bool(held.all()):
            return slots
        self._grow(sample_ids[~held])
        return self.index.slots(sample_ids, checked=False)

    def _grow(self, new_ids: torch.Tensor) -> None:
        old_ids = self.index.ids
        old = {name: getattr(self, name) for name in COLUMNS}
        self.index = SampleIndex(torch.cat([old_ids, torch.unique(new_ids)]))
        size = self.index.ids.numel()
        self.losses = torch.full((size,), float("nan"))
        self.recorded_epoch = torch.full((size,), -1, dtype=torch.int32)
        self._margin_columns = dict(zip(MARGIN_COLUMNS, _empty_margins(size)))
        slots = self.index.slots(old_ids, checked=False)
        for name, column in old.items():
            getattr(self, name)[slots] = column

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
        total, count = self._shared("loss_sum_and_count").tolist()
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
        self._pending = [(ids, records[0], records[1:])] if ids.numel() else []
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
        if "margins" not in state:  # a checkpoint from before margins were kept: none recorded yet
            state = {**state, **dict(zip(MARGIN_COLUMNS, _empty_margins(self.index.ids.numel())))}
        self.losses = state["losses"].cpu().clone()
        self.recorded_epoch = state["recorded_epoch"].cpu().clone()
        self._margin_columns = {name: state[name].cpu().clone() for name in MARGIN_COLUMNS}
        self._unsettled = []
        self.epoch = int(state["epoch"])
        ids, records = state["unshared"]
        if records.dim() == 1:  # losses alone, from before margins were recorded
            records = _loss_records(records)
        self._pending = [(ids, records[0], records[1:])] if ids.numel() else []
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
# What a sharded table's ranks sum as an epoch starts (LossTable.share_summary), where it lies in the sum: the
# recorded losses' bin counts, the suspects' bin counts, the loss sum and count, and the label measure's
# confidently wrong and judged counts.
SUMMARY_PARTS = {"counts": slice(0, LOSS_BINS), "suspect_counts": slice(LOSS_BINS, 2 * LOSS_BINS),
                 "loss_sum_and_count": slice(2 * LOSS_BINS, 2 * LOSS_BINS + 2),
                 "label_measure": slice(2 * LOSS_BINS + 2, 2 * LOSS_BINS + 4)}
MARGIN_COLUMNS = ("margins", "trainings", "predicted", "labels")
# The per-example columns a table keeps, in its checkpoint under these names.
COLUMNS = ("losses", "recorded_epoch", *MARGIN_COLUMNS)


def owning_ranks(sample_ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank whose sharded table holds each example: its id mod the ranks."""
    return sample_ids.remainder(world_size)


def records_by_owner(sample_ids: torch.Tensor, records: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`take_unshared`'s records split by the rank whose sharded table owns each (id mod ranks), in
    record order within each: a host row of bytes per record, its id (int64) and then its record rows
    (float32, as `apply` reads them)."""
    ids, values = to_host(sample_ids).long(), to_host(records).float()
    owners = owning_ranks(ids, world_size).int()
    order = torch.sort(owners, stable=True).indices
    rows = torch.cat([ids[order].unsqueeze(1).view(torch.uint8), values[:, order].T.contiguous().view(torch.uint8)],
                     dim=1)
    return list(rows.split(torch.bincount(owners, minlength=world_size).tolist()))


def records_of_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`records_by_owner`'s rows back as (ids, records), what `LossTable.apply` takes."""
    return rows[:, :8].contiguous().view(torch.int64).reshape(-1), rows[:, 8:].contiguous().view(torch.float32).T


def _loss_records(losses: torch.Tensor) -> torch.Tensor:
    """Records of losses alone: no margin (NaN) and no labels (-1), as a selection forward's loss or a
    loss function without logits gives."""
    return torch.cat([losses.float().unsqueeze(0), _unknown_rows(losses.numel(), losses.device)])


def _unknown_rows(count: int, device: torch.device) -> torch.Tensor:
    """The margin rows of `count` records without logits: margin NaN, predicted and given label -1."""
    rows = torch.full((RECORD_ROWS - 1, count), -1.0, device=device)
    rows[0] = float("nan")
    return rows


def _margin_rows(pending: list, device: torch.device) -> torch.Tensor:
    """The margin, predicted-label and given-label rows of `LossTable._pending`'s records, in order: the
    margins of every forward that left its logits computed in one go, as the records are written."""
    forwards = [rows for _, _, rows in pending if isinstance(rows, ClassLogits)]
    computed = iter(())
    if forwards:
        margins = logit_margins(torch.cat([to_device(forward.logits, device) for forward in forwards]),
                                torch.cat([to_device(forward.labels, device) for forward in forwards]))
        rows = torch.stack([margins.margins, margins.predicted.float(), margins.labels.float()])
        if len(forwards) == len(pending):
            return rows
        computed = iter(rows.split([forward.labels.numel() for forward in forwards], dim=1))
    return torch.cat([next(computed) if isinstance(rows, ClassLogits)
                      else _unknown_rows(losses.numel(), device) if rows is None else to_device(rows, device)
                      for _, losses, rows in pending], dim=1)


def _empty_margins(size: int) -> tuple[torch.Tensor, ...]:
    """Running margins (NaN: never trained with one), training counts, predicted and given labels (-1)."""
    return (torch.full((size,), float("nan")), torch.zeros(size, dtype=torch.int32),
            torch.full((size,), -1, dtype=torch.int64), torch.full((size,), -1, dtype=torch.int64))


def _each_once(slots: torch.Tensor) -> bool:
    """Whether no slot of a nonempty `slots` repeats, as in most records, told without a sort. Only where the
    slots span little more than their count (an epoch's records at once): counting a round's few records in a
    large table would cost the table's size each time, so those take the sort (False)."""
    return int(slots.max()) < 4 * slots.numel() and int(torch.bincount(slots).max()) == 1


def _first_of_each(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each slot's first occurrence in `slots`, and of the rest, both in order."""
    if _each_once(slots):
        return torch.arange(slots.numel()), torch.empty(0, dtype=torch.int64)
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return order[first].sort().values, order[~first].sort().values


def _last_of_each(slots: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`slots` without repeats, each with the value of its last occurrence (a batch that spans an
    epoch's end can hold an example twice)."""
    if not slots.numel() or _each_once(slots):
        return slots, values
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return ordered[last], values[order][last]
