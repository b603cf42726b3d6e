"""Selective-Backprop for any training loop: one process, or every rank of a Ray Train job.

    sb = SelectiveBackprop(per_example_loss, batch_size=64, selectivity=0.33)
    for epoch in range(epochs):
        for batch in sb.batches(model, loader):   # exactly 64 kept examples on every rank
            loss = sb.loss(model, batch)          # their mean loss, weighted where selection needs it
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ray.train.report(sb.metrics())

`per_example_loss(model, batch)` returns one loss per example of `batch`, which reads
like the dict of tensors the data gave (`batch["label"]`). It is called without
autograd in eval mode to score examples, and in train mode by `loss`. The source is
any iterable of dict batches: a Ray Data shard's `iter_torch_batches`, a DataLoader,
a list. Its batches are cut into selection chunks; each chunk is scored, ranked
against CDF_R and its kept examples queue until b are waiting
(raysb.training.selection.rounds: one round per chunk).

On Ray Train ranks, or any launcher's (torch.distributed initialized), the ranks rank
losses against one shared CDF_R (a loss histogram merged in every round,
raysb.training.selection.merged_histogram) and exchange kept examples, all their columns, after
every chunk, so that every rank takes the same number of steps of
exactly b and no kept example is lost (raysb.training.selection.exchange). A bad batch or loss
on one rank stops every rank at the same round with the same error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from raysb.core.batch_former import Batch
from raysb.core.errors import BadBatchError
from raysb.core.keep_rule import LossHistory
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_options import OPTION_KEYS
from raysb.core.strategy_table import strategy_card
from raysb.training.collective import Collective, found_collective
from raysb.training.selection.exchange import Carried, LockstepExchange
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.precision import autocast, resolve_precision
from raysb.training.selection.counts import metrics_row
from raysb.training.selection.loss_reads import LossFunction
from raysb.training.selection.rounds import RoundObserver, SelectionRounds
from raysb.training.selection.sources import ChunkLookahead, ChunkRounds
from raysb.training.selection.strategies import build_strategy
from raysb.training.timing import PhaseTimer
from raysb.training.user_batches import UserBatches, UserContext, on_device

__all__ = ["SelectiveBackprop"]


class SelectiveBackprop:
    def __init__(
        self,
        loss_fn: LossFunction,
        batch_size: int,
        *,
        selectivity: float | None = None,
        beta: float | None = None,
        strategy: str = "sb",
        strategy_options: Mapping[str, Any] | None = None,
        selection_batch_size: int | None = None,
        history_size: int = 1024,
        keep_floor: float = 0.0,
        staleness_correction: bool | str = "auto",
        id_column: str | None = None,
        columns: Iterable[str] | None = None,
        seed: int = 0,
        score_fn: LossFunction | None = None,
        precision: str = "fp32",
        collective: Collective | None = None,
        history: LossHistory | None = None,
        table: Mapping[str, torch.Tensor] | None = None,
        **strategy_settings: Any,
    ):
        """Set up selection for your loop; the parameters after `batch_size` are keywords.

        Args:
            loss_fn: `loss_fn(model, batch)` -> a tensor of one loss per example of `batch`.
            batch_size: b, the examples of every training step on every rank.
            selectivity: the expected kept fraction s (default 1/3); or give `beta` (s = 1 / (beta + 1)).
            beta: CDF_R's exponent, instead of `selectivity`.
            strategy: "sb", "stale-sb" (selection passes every `staleness`-th epoch, default 3,
                recorded losses reused in between; needs `id_column`), "free-sb" (no selection
                forward: each example's score is its loss in the last training step it was in; needs
                `id_column`), "traditional", "kath18", or your own as "package.module:CARD"
                (raysb.StrategyCard).
            strategy_options: the strategy's own options by name (its card's `options`; others are
                refused).
            selection_batch_size: examples scored per selection round (default b). Larger rounds cost
                less bookkeeping; their scores then feed several steps.
            history_size: R, the losses CDF_R ranks against.
            keep_floor: the least keep probability.
            staleness_correction: weight kept examples by their keep probability now over the one
                they were kept with (True, False, or "auto": where scores feed later steps, a
                selection batch > b or ranks that score a few batches between exchanges).
            id_column: a column of stable integer example ids; needed by stale-sb and free-sb.
            columns: the columns to use, by name: batches missing one are an error, others are
                dropped. Tuple batches (a DataLoader over a TensorDataset) are named by position.
            seed: seeds selection's random draws (keep decisions, ties, Kath18's sampling).
            score_fn: `score_fn(model, batch)` -> the per-example losses selection ranks, if not
                loss_fn's (a cheaper proxy: a smaller model, downsampled inputs). Called like loss_fn
                for scoring: eval mode, no autograd, on the bare module.
            precision: the autocast of scoring and of `loss`'s forward: "fp32" (none: your own
                autocast context around `loss` still applies), "bf16", "fp16" (scale the loss with
                your torch.amp.GradScaler), or "auto" (bf16 on a GPU that has it, else fp32).
            collective: the ranks' collectives (found where torch.distributed runs); give one to
                replace raysb's.
            history: the CDF_R to rank against (on several ranks, one they share); give one to
                replace raysb's.
            table: the whole data by column, in memory on every rank, its rows indexed by the ids of
                `id_column`: kept examples then cross ranks as ids alone (40 bytes each), and each
                rank reads their columns from its own table, instead of receiving them.
            **strategy_settings: a built-in strategy's options as keywords, named as its config keys
                (its card's `options`, raysb.core.strategy_table; docs/guides/command-line.md):
                `staleness=2` for stale-sb, `selection_weights="unbiased"` for free-sb. One the
                strategy does not read is refused.
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        card = strategy_card(strategy)
        unknown = sorted(set(strategy_settings) - set(OPTION_KEYS) - set(card.options))
        if unknown:
            raise TypeError(f"SelectiveBackprop got an unexpected keyword argument {', '.join(map(repr, unknown))}")
        if card.own_loop_refusal is not None:
            raise ValueError(f"strategy {strategy} {card.own_loop_refusal}")
        if card.needs_sample_ids and id_column is None:
            raise ValueError(f"strategy {strategy} reuses each example's last loss: name its id column (id_column=...)")
        if table is not None and id_column is None:
            raise ValueError("a table's rows are found by id: name the id column that indexes them (id_column=...)")
        self.table = None if table is None else _checked_table(table)
        self.collective = collective if collective is not None else found_collective()
        lockstep = self.collective.world_size > 1 or collective is not None
        spec = SelectionSpec.for_user(
            strategy, batch_size, selectivity=selectivity, beta=beta, selection_batch_size=selection_batch_size,
            history_size=history_size, keep_floor=keep_floor, staleness_correction=staleness_correction, seed=seed,
            lockstep=lockstep, options=strategy_options, option_keys=strategy_settings,
        )
        if spec.holdout_share > 0:
            raise ValueError(f"strategy {strategy} holds out {spec.holdout_share:g} of the training data, which "
                             f"raysb's trainer splits off and your loop does not: use raysb train --strategy {strategy}")
        if history is None and self.collective.world_size > 1 and card.shared_cdf:
            history = MergedLossHistogram(history_size, getattr(self.collective, "device", torch.device("cpu")),
                                          self.collective.world_size, self.collective.rank)
        # With a table, ids index its rows: loss tables cover them from the start (no host read to grow).
        rows = None if self.table is None else torch.arange(len(next(iter(self.table.values()))))
        self.rounds = SelectionRounds(
            spec, build_strategy(spec, history=history, sample_ids=rows), loss_fn, self.collective,
            PhaseTimer(torch.device("cpu")),
        )
        self.source = UserBatches(
            self.collective, columns, id_column, None if self.table is None else len(next(iter(self.table.values())))
        )
        self.score_fn = score_fn or loss_fn
        self.precision = precision
        # Resolved where the model's device is known (`batches`); an unknown name fails here, not mid-epoch.
        self.resolved_precision = resolve_precision(precision, torch.device("cpu"))
        # Where kept examples from other ranks go: the device of the model training now.
        self.device = torch.device("cpu")

    @property
    def batch_size(self) -> int:
        return self.rounds.batch_size

    @property
    def chunk_size(self) -> int:
        """Examples scored per selection round."""
        return self.rounds.chunk_size

    def batches(
        self,
        model: torch.nn.Module,
        source: Iterable,
        *,
        select: bool = True,
        should_stop: Callable[[], bool] | None = None,
        selectivity: float | None = None,
        selection_strength: float | None = None,
    ) -> Iterator[Batch]:
        """One epoch of training batches of exactly b from `source` (this rank's data).

        `select=False` trains on every example (plain SGD epochs, e.g. the first).
        `selectivity`: the kept fraction from this epoch on, for a schedule of your own, e.g.
        `raysb.scheduled_selectivity("lr", 1/3, lr / peak_lr)`: rising to 1 as the lr decays. Give
        the same on every rank (it depends only on your schedule's position, which they share).
        `selection_strength`: how strongly the keep rule prefers high scores from this epoch on, 1
        (SB's rule) to 0 (a uniform draw of the same kept fraction), e.g.
        `raysb.scheduled_strength("lr", lr / peak_lr)`: fading to uniform as the lr decays.
        `should_stop()` is asked by rank 0 every round; once it says so, every rank ends
        the epoch at the same exchange (the round's, or within the few rounds ranks score
        between exchanges) and `stop_requested` is set.
        Train on each batch with `loss` before asking for the next.
        """
        self.device = device = _device_of(model)
        self.resolved_precision = resolve_precision(self.precision, device)
        epoch = self.rounds.epochs_started
        if selectivity is not None:
            self.rounds.strategy.set_selectivity(epoch, selectivity)
        if selection_strength is not None:
            if not 0 <= selection_strength <= 1:
                raise ValueError(f"selection_strength must be in [0, 1], got {selection_strength}")
            self.rounds.strategy.set_selection_strength(epoch, selection_strength)
        items = iter(source)
        with self.rounds.timer.phase("data"):
            first = next(items, None)
        if self.source.schema is None:
            self._agree_columns(first)
        raw = itertools.chain([] if first is None else [first], items)
        upcoming = ChunkLookahead(self.source.chunks(raw, epoch, self.chunk_size), self.source.empty_chunk,
                                  self.rounds.timer)
        context = UserContext(model, device, self.score_fn, self.resolved_precision)
        yield from self.rounds.epoch(epoch, ChunkRounds(upcoming), context, select=select,
                                     observer=_StopWhen(should_stop))

    @property
    def stop_requested(self) -> bool:
        """Whether `should_stop` ended the last epoch early (on every rank alike)."""
        return self.rounds.stop_requested

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The loss to backpropagate for `batch`: its examples' mean loss, weighted where
        selection asks for it (Kath18 reweighting, the staleness correction).

        Checked on every rank before it returns: if any rank's loss is not finite, or its
        loss function failed, every rank raises the same error here, before backward.
        """
        if not isinstance(batch, Batch):
            raise TypeError(
                f"sb.loss takes the batches sb.batches(model, source) yields, not a {type(batch).__name__}: "
                "train on `for batch in sb.batches(model, source)`"
            )
        with autocast(self.resolved_precision, self.device):
            return self.rounds.loss(model, batch)

    def metrics(self) -> dict[str, float]:
        """This rank's counts and time split, for `ray.train.report` (steps are equal on every rank):
        the run's cumulative counts and this epoch's loss, kept fraction and steps; on lockstep
        ranks also what the exchange and the shared CDF_R's merge cost (ms and KB per step)."""
        row = metrics_row(self.rounds.progress_counts(), self.rounds.timer.breakdown())
        # Your loop's backward and optimizer step are not timed here: they count as time_other_s.
        del row["time_backward_s"]
        return {
            "epochs": self.rounds.epochs_started,
            **row,
            "unused_kept_examples": self.rounds.queued(),
            "wall_s": self.rounds.timer.training_seconds(),
            # On lockstep ranks: what the exchange and the shared CDF_R's merge cost a step.
            **(self.rounds.exchange.costs(row["optimizer_steps"]) if isinstance(self.rounds.exchange, LockstepExchange)
               else {}),
        }

    def state_dict(self) -> dict:
        """This rank's selection state, at an epoch boundary; save one per rank.

        Loaded into a SelectiveBackprop built the same way on the same rank, the next
        epoch selects and batches exactly as this run's would have.
        """
        return {**self.rounds.state_dict(), "schema": self.source.schema, "next_sample_id": self.source.next_sample_id}

    def load_state_dict(self, state: dict) -> None:
        # The columns every rank agreed on come back with the state: no rank asks again.
        self.source.schema = state["schema"]
        if self.rounds.exchange is None and self.source.schema is not None:
            self._exchange_columns()
        self.rounds.load_state_dict(state)
        self.source.next_sample_id = int(state["next_sample_id"])

    def _agree_columns(self, first) -> None:
        """The columns every rank's batches must have: rank 0's first batch's (one collective, once)."""
        mine = self.source.schema_of_first(first)
        needs_exchange = self.rounds.exchange is None
        agreed = self.collective.broadcast_object(mine) if needs_exchange else mine
        if not isinstance(agreed, dict):
            where = "" if self.collective.world_size == 1 else "rank 0: "
            raise BadBatchError(f"{where}{agreed or 'the data source gave no batches'}")
        self.source.schema = agreed
        if needs_exchange:
            self._exchange_columns()

    def _exchange_columns(self) -> None:
        """Lockstep ranks send kept examples' ids, and with no table all their columns too; they
        train where the model is."""
        if self.table is not None:
            missing = sorted(set(self.source.schema) - set(self.table))
            if missing:
                raise BadBatchError(
                    f"the table has no column {', '.join(map(repr, missing))} that the batches have "
                    f"(it has: {', '.join(self.table)})"
                )
            names = list(self.source.schema)
            self.rounds.use_lockstep(
                load_ids=lambda ids: on_device(Batch(ids, _rows(self.table, names, ids)), self.device)
            )
            return
        self.rounds.use_lockstep(carried=Carried(
            self.source.schema,
            columns_of=lambda kept: kept.columns,
            load=lambda ids, columns: on_device(Batch(ids, columns), self.device),
        ))


class _StopWhen(RoundObserver):
    def __init__(self, should_stop: Callable[[], bool] | None):
        self.asked = should_stop

    def should_stop(self, epoch: int, round_index: int) -> bool:
        return self.asked is not None and bool(self.asked())


def _checked_table(table: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(table, Mapping) or not table:
        raise TypeError(f"table must be a dict of column name -> tensor, got {type(table).__name__}")
    rows = {name: column.shape[0] if isinstance(column, torch.Tensor) and column.dim() else None
            for name, column in table.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise ValueError(f"table columns must be tensors of one length (rows per column: {rows})")
    return dict(table)


def _rows(table: dict[str, torch.Tensor], names: list[str], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `ids` of `table`'s columns `names` (every id was checked against the table as its batch came in)."""
    return {name: table[name][ids.to(table[name].device)] for name in names}


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


