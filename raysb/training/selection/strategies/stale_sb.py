"""Stale-SB(n): selection passes every n-th epoch, recorded losses reused in between."""

from __future__ import annotations

import torch

from raysb.core.batch_former import Batch
from raysb.core.keep_rule import Selector
from raysb.core.label_doubt import ClassLogits
from raysb.training.selection.label_doubt import LabelDoubt, split_keep
from raysb.training.selection.loss_table import LossTable, RecordedLosses
from raysb.training.selection.strategies.base import Decision, Scores
from raysb.training.selection.strategies.sb import SBStrategy, cdf_selector, fixed_count

# Added to the run's selection seed to seed the selector that ranks recorded losses between
# passes: its own random stream, so its draws move none of the selection passes'. Any offset far
# above the seeds runs use (0, 1, 2, ...) keeps it apart from every other run's selection stream;
# this value is the one stale-sb's results were measured with, and changing it changes them.
RECORDED_SELECTOR_SEED_OFFSET = 1_000_003


class StaleSBStrategy(SBStrategy):
    """Stale-SB(n): selection passes every n-th epoch, recorded losses reused in between.

    In the epochs between selection passes, examples are chosen from their recorded loss
    before any data is loaded, so only kept examples are gathered and augmented. The keep
    rule then ranks a recorded loss among every example's recorded loss as they stood when
    the epoch began (raysb.training.selection.loss_table.RecordedLosses), on the host where
    the table is: no such round waits for the device. An example that was never scored (it
    joined after the last selection pass) is scored now rather than guessed.

    `record_training_losses`: every trained example's training loss replaces its recorded
    one, so the kept (hard) examples' scores follow training between passes.
    `scored_priming`: the first pass (epoch `first_epoch`) trains on every example after scoring
    and recording it, as the authors' code primes (angelajiang/SelectiveBackprop).
    `label_doubt`: as free-sb's (raysb.training.selection.label_doubt), from the margins of the training
    forwards, which the table records whether or not their losses replace the recorded ones: in a
    selection pass the doubted are drawn at the uniform rate and CDF_R gets only the others' losses;
    between passes the others are ranked against the others' recorded losses.
    """

    name = "stale-sb"

    def __init__(
        self, selector: Selector, staleness: int, table: LossTable, first_epoch: int = 0,
        record_training_losses: bool = False, fixed_count: bool = False, scored_priming: bool = False,
        label_doubt: str = "off",
    ):
        super().__init__(selector, fixed_count)
        self.staleness = staleness
        self.table = table
        self.first_epoch = first_epoch
        self.record_training_losses = record_training_losses
        self.scored_priming = scored_priming
        self.recorded_losses = RecordedLosses(table)
        # On the host, where the recorded losses are.
        self.recorded = Selector(
            beta=selector.beta, seed=selector.initial_seed + RECORDED_SELECTOR_SEED_OFFSET,
            history=self.recorded_losses, keep_floor=selector.keep_floor,
        )
        self.doubt = LabelDoubt(table, label_doubt)
        self._epoch: int | None = None

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> StaleSBStrategy:
        options = spec.options
        # The authors' schedule primes with a scored epoch, the pass at `first_epoch`, and refreshes.
        authors = options["stale_sb_schedule"] == "authors"
        return cls(
            cdf_selector(spec, history, device), options["staleness"],
            LossTable.for_run(spec, sample_ids, distribution=True, margins=options["label_doubt"] != "off"),
            first_epoch=spec.first_epoch, record_training_losses=options["training_loss_refresh"] or authors,
            fixed_count=fixed_count(spec, device), scored_priming=authors, label_doubt=options["label_doubt"],
        )

    def is_selection_epoch(self, epoch: int) -> bool:
        return (epoch - self.first_epoch) % self.staleness == 0

    def scores_whole_chunks(self, epoch: int) -> bool:
        return self.is_selection_epoch(epoch)

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores | torch.Tensor:
        """A selection pass scores every example; between passes, a chunk with an example never
        scored is scored whole rather than guessed."""
        self._start(epoch)
        if self.is_selection_epoch(epoch):
            return Scores.ALL
        # On the host: no wait for the device.
        return Scores.ALL if bool(torch.isnan(self.table.lookup(ids)).any()) else Scores.NONE

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        if scores is None:
            return self._keep_recorded(self.table.lookup(ids), ids)
        self.table.record(ids, scores)
        if self.scored_priming and epoch == self.first_epoch:
            return Decision()
        doubted = self.doubt.doubted(ids)
        if doubted is None:
            return self._keep(ids, scores)
        # The doubted examples' draws come from the host's stream, which no selection pass otherwise uses.
        kept, probabilities = split_keep(self.selector, scores, ids, doubted, fixed_count=self.fixed_count,
                                         generator=self.recorded.generator)
        return Decision(kept, self._weights(ids, kept), keep_probabilities=probabilities)

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        """Between passes, where every example has a recorded loss (one never scored needs a forward)."""
        return not self.is_selection_epoch(epoch) and not bool(torch.isnan(self.table.lookup(ids)).any())

    def _start(self, epoch: int) -> None:
        """As `epoch` begins: its doubted examples, and, between passes, its recorded losses ranked among
        every example's (the doubted ones' left out) as they stand then."""
        self.table.epoch = epoch
        if epoch != self._epoch:
            self._epoch = epoch
            doubting = self.doubt.start(epoch)
            if not self.is_selection_epoch(epoch):
                self.recorded_losses.freeze(without_suspects=doubting)

    def _keep_recorded(self, losses: torch.Tensor, ids: torch.Tensor) -> Decision:
        """The examples of `ids` kept by their recorded `losses`, ranked among the epoch's starting ones."""
        # Reusing epochs-old losses is the method here, not a delay to correct: weighting
        # them by fresh probabilities made it worse (BENCHMARKS.md, "Stability: label
        # noise, large selection batches, stale scores").
        self.recorded.observer = self.selector.observer  # the trace, set after construction
        kept, _ = split_keep(self.recorded, losses, ids, self.doubt.doubted(ids))
        return Decision(kept, self._weights(ids, kept))

    def _weights(self, ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor | None:
        """The kept examples' loss weights where label doubt silences any of them, where `kept` is."""
        weights = self.doubt.weights(ids, None)
        return None if weights is None else weights.to(kept.device)[kept]

    def set_selectivity(self, epoch: int, selectivity: float) -> None:
        super().set_selectivity(epoch, selectivity)
        self.recorded.beta = self.selector.beta

    def set_selection_strength(self, epoch: int, strength: float) -> None:
        super().set_selection_strength(epoch, strength)
        self.recorded.strength = strength

    def observe_training_losses(self, batch: Batch, losses: torch.Tensor, logits: ClassLogits | None = None) -> None:
        if self.record_training_losses:
            self.table.record(batch.sample_ids, losses, logits)
        elif logits is not None and self.table.tracks_margins:
            self.table.record(batch.sample_ids, None, logits)  # the margins alone: the scores stay the pass's

    def label_doubt_row(self) -> dict:
        return self.doubt.row()

    def loss_table(self) -> LossTable:
        return self.table

    def state_dict(self) -> dict:
        return {**super().state_dict(), "table": self.table.state_dict(), "recorded": self.recorded.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.table.load_state_dict(state["table"])
        self.recorded.load_state_dict(state["recorded"])
        self._epoch = None
