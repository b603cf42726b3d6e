"""SB on free scores: the keep rule of Selective-Backprop, fed by the training forward's own losses."""

from __future__ import annotations

import torch

from raysb.core.keep_rule import Selector, unbiased_weights
from raysb.core.overfit_guard import OverfitGuard
from raysb.core.selectivity import selectivity_from_beta, trained_at_most
from raysb.core.train_cap import TrainCap
from raysb.core.transfer import to_host
from raysb.training.selection.label_doubt import LabelDoubt, split_keep
from raysb.training.selection.loss_table import LossTable, RecordedLosses
from raysb.training.selection.strategies.base import Decision, FreeScores, Scores


class FreeSBStrategy(FreeScores):
    """Keep each example with probability CDF(score) ** beta, where its score is the loss of the
    last training forward it was in: no selection forward at all.

    The CDF ranks a score among the recorded scores of the whole data set as they stood when
    the epoch began (the table's histogram, raysb.training.selection.loss_table.RecordedLosses),
    not among recent losses: a kept example's training loss is a hard example's,
    and ranking stale scores against those made nearly every score look easy (a plain loop
    kept about 6% of the data instead of 33%). Ranked against every example's score, the
    expected kept fraction is 1 / (beta + 1) whatever the scores are. An example never
    trained on is kept, so the first epoch trains on everything.

    `refresh_epochs` K: an example whose score is older than K epochs is scored again by a
    selection forward before the decision (None: never; a training forward is the only source).
    `weighted`: each kept example's loss weighs mean(P) / P (raysb.core.selection.unbiased_weights),
    so a step's gradient estimates the whole chunk's, as InfoBatch's rescaling does.
    `cap`: an example the keep rule keeps more often than the cap allows in its window is not kept
    (raysb.core.train_cap; the kept fraction falls by as many).
    `guard`: reads the held-out loss at each epoch's end and moves selection toward a uniform draw or a
    larger kept fraction when it rises while the trained examples' loss collapses
    (raysb.core.overfit_guard); it composes with the selection schedules, which set the rule it moves.
    `label_doubt`: what the rule does with the examples the model persistently disagrees with as an
    epoch starts (raysb.training.selection.label_doubt; "off": nothing): drawn at the uniform rate s,
    the rest ranked among themselves, some trained with loss weight 0.
    """

    name = "free-sb"

    def __init__(self, table: LossTable, beta: float, seed: int, keep_floor: float = 0.0,
                 refresh_epochs: int | None = None, weighted: bool = False, cap: TrainCap | None = None,
                 guard: OverfitGuard | None = None, label_doubt: str = "off"):
        super().__init__(table)
        self.scores = RecordedLosses(table)
        # Decided on the host, where the table and a chunk's positions are: no round waits for the device.
        self.selector = Selector(beta=beta, seed=seed, history=self.scores, keep_floor=keep_floor)
        self.refresh_epochs = refresh_epochs
        self.weighted = weighted
        self.cap = cap
        self.guard = guard
        self.doubt = LabelDoubt(table, label_doubt)
        # The rule the selection schedules set, before the guard moves it.
        self._selectivity, self._strength = selectivity_from_beta(beta), 1.0
        self._epoch: int | None = None
        # The positions of the chunk being decided whose scores are refreshed.
        self._refreshing = torch.empty(0, dtype=torch.int64)

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> FreeSBStrategy:
        # Ranked against the table's own recorded scores, not a window of recent losses (or the
        # ranks' merged one): the table is the same on every rank after each exchange.
        options = spec.options
        cap = None
        if options["train_cap"] is not None:
            if sample_ids is None:
                raise ValueError("train_cap counts each example's keeps by id over the whole training set: "
                                 "it needs the training set's sample ids in advance")
            window = options["train_cap_window"]
            cap = TrainCap(sample_ids, trained_at_most(options["train_cap"], spec.selectivity, window), window)
        guard = None if options["overfit_guard"] == "off" else OverfitGuard(options["overfit_guard"])
        return cls(LossTable.for_run(spec, sample_ids, distribution=True, margins=True), spec.beta, spec.seed,
                   spec.keep_floor, options["score_refresh_epochs"], weighted=options["selection_weights"] == "unbiased",
                   cap=cap, guard=guard, label_doubt=options["label_doubt"])

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores | torch.Tensor:
        """Where it refreshes, the examples whose score is older than `refresh_epochs`."""
        self._start(epoch)
        if self.refresh_epochs is None:
            return Scores.NONE
        recorded = self.table.epochs_recorded(ids)
        old = (recorded >= 0) & (epoch - recorded > self.refresh_epochs)
        # The one host read a refresh costs a round.
        self._refreshing = old.nonzero().squeeze(1) if bool(old.any()) else old.new_empty(0, dtype=torch.int64)
        return self._refreshing

    def decides_epoch(self, epoch: int, ids: torch.Tensor) -> bool:
        # A refresh scores old examples with a forward of their own, chunk by chunk.
        return self.refresh_epochs is None

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        """Every example against the table as the epoch began (a refreshed one by its fresh score, now
        recorded): the same distribution whether `ids` are a chunk's or the whole epoch's."""
        recorded = self.table.lookup(ids)
        if scores is not None:
            fresh = to_host(scores)
            self.table.record(ids.cpu()[self._refreshing], fresh)
            recorded = recorded.index_put((self._refreshing,), fresh)
        # Never scored: an infinite score ranks above every recorded one, so P = 1.
        unscored = torch.isnan(recorded)
        recorded = torch.where(unscored, torch.full_like(recorded, float("inf")), recorded)
        kept, probabilities = split_keep(self.selector, recorded, ids, self.doubt.doubted(ids))
        if self.cap is not None:
            keep = torch.zeros(ids.numel(), dtype=torch.bool).index_fill_(0, kept, True)
            # The cap bounds the keep rule's choices. An example kept because it has no score yet is not
            # one: counted, the first epoch's keeps filled every window, and at one keep a window free-sb
            # kept nothing for the next W - 1 epochs (BENCHMARKS.md, "Selection that does not over-fit").
            keep &= self.cap.allowed(ids, epoch) | unscored
            self.cap.record(ids.cpu()[keep & ~unscored], epoch)
            kept = keep.nonzero().squeeze(1)
        weights = self.doubt.weights(ids, unbiased_weights(probabilities) if self.weighted else None)
        return Decision(kept, weights[kept] if weights is not None else None)

    def label_doubt_row(self) -> dict:
        return self.doubt.row()

    def watches_held_out(self) -> bool:
        return self.guard is not None

    def observe_held_out_loss(self, epoch: int, loss: float, trained_loss: float) -> str | None:
        if not self.guard.update(loss, trained_loss):
            return None
        # The rule the schedules last set, moved by the guard from the next epoch on.
        self.set_selectivity(epoch + 1, self._selectivity)
        self.set_selection_strength(epoch + 1, self._strength)
        moved = (f"selection strength {self.selector.strength:.3g}" if self.guard.action == "strength"
                 else f"kept fraction {self.guard.selectivity(self._selectivity):.3g}")
        return (f"raysb: overfit_guard: the held-out loss rose to {loss:.4g} (lowest {min(self.guard.held_out):.4g}) "
                f"while the trained examples' fell to {trained_loss:.4g}: {moved} from epoch {epoch + 2}")

    def set_selectivity(self, epoch: int, selectivity: float) -> None:
        self._selectivity = selectivity
        super().set_selectivity(epoch, self.guard.selectivity(selectivity) if self.guard is not None else selectivity)

    def set_selection_strength(self, epoch: int, strength: float) -> None:
        self._strength = strength
        super().set_selection_strength(epoch, self.guard.strength(strength) if self.guard is not None else strength)

    def _start(self, epoch: int) -> None:
        self.table.epoch = epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self.scores.freeze(without_suspects=self.doubt.start(epoch))

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict(), "table": self.table.state_dict(),
                "cap": self.cap.state_dict() if self.cap is not None else None,
                "guard": self.guard.state_dict() if self.guard is not None else None,
                "schedules": (self._selectivity, self._strength), "measured_share": self.doubt.measured_share}

    def load_state_dict(self, state: dict) -> None:
        self.selector.load_state_dict(state["selector"])
        self.table.load_state_dict(state["table"])
        self.doubt.measured_share = state.get("measured_share")  # absent from checkpoints made before auto
        if self.cap is not None:
            self.cap.load_state_dict(state["cap"])
        if self.guard is not None:
            self.guard.load_state_dict(state["guard"])
            self.set_selectivity(0, state["schedules"][0])
            self.set_selection_strength(0, state["schedules"][1])
        self._epoch = None
