"""Label doubt in a strategy that ranks recorded losses (free-sb, Stale-SB): which examples it doubts as
an epoch starts, how it draws them, and which of them train with loss weight 0.

A mislabelled example's loss stays high, so SB's rule would choose it above all. Doubted (the model
persistently disagrees with its label, raysb.core.label_doubt.suspected), it is drawn at the uniform
rate s instead, and the rest are ranked against the rest's losses alone: a CDF that still held the
suspects' high losses would rank every other example low and keep too few. A drawn suspect trains with
loss weight 0 ("probe": every one; "tiered": those the model is confident are wrong, once trained four
times, raysb.core.label_doubt.silenced; "uniform": none), so that its training forward keeps its margin
current while the backward learns nothing from its label: a hard example whose label is right leaves
the suspects as the model learns its class from the others, and a wrong label is not memorised over a
long run. "auto" measures the labels once, as the first epoch after one that trained examples a second
time starts, and keeps its choice (raysb.core.label_doubt.automatic_rule): tiered where they look noisy,
off where they look clean, uniform before the measure. Measured again in each later epoch, the share was
biased by the rule itself: with doubt off, free-sb trains the hardest examples, and on clean labels the
share of the last epoch's that looked wrong went 7.1%, 14.0%, 5.3%, 10.8% in epochs 3-6, the rule
flipping with it (full Fashion-MNIST).
"""

from __future__ import annotations

import torch

from raysb.core.keep_rule import Selector
from raysb.core.label_doubt import automatic_rule
from raysb.core.selectivity import selectivity_from_beta
from raysb.training.selection.loss_table import LossTable


class LabelDoubt:
    """`setting`: the label_doubt option ("off", "uniform", "probe", "tiered", "auto") over `table`'s
    margins. `rule` is the one the current epoch applies."""

    def __init__(self, table: LossTable, setting: str):
        if setting != "off" and not table.tracks_margins:
            raise ValueError("label_doubt reads the loss table's margins: build it with margins=True")
        self.table = table
        self.setting = setting
        self.rule = setting
        # auto's measure of the labels, taken once, as the first epoch after one that trained examples a
        # second time began (raysb.core.label_doubt.recent_wrong_share); None until then.
        self.measured_share: float | None = None
        # Over the table's examples: those doubted as the epoch began, and those of them that train with
        # loss weight 0 (None: the rule doubts nothing, or trains every doubted example).
        self._doubted: torch.Tensor | None = None
        self._silenced: torch.Tensor | None = None

    def start(self, epoch: int) -> bool:
        """Choose `epoch`'s rule and take its doubted examples from the table as the epoch starts, the
        same on every rank and after a resume; whether it doubts any (the CDF then ranks the rest)."""
        self.rule = self.setting
        if self.setting == "auto":
            if self.measured_share is None and epoch > 0:
                self.measured_share = self.table.recent_wrong_share(epoch - 1)
            self.rule = automatic_rule(self.measured_share)
        if self.rule == "off":
            self._doubted = self._silenced = None
            return False
        self._doubted = self.table.suspects()
        self._silenced = (self._doubted if self.rule == "probe" else
                          self.table.silenced_suspects() if self.rule == "tiered" else None)
        return True

    def doubted(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which of `ids` the epoch doubts; None where it doubts none of them."""
        return self._among(self._doubted, ids)

    def silenced(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which of `ids` train with loss weight 0; None where none of them do."""
        return self._among(self._silenced, ids)

    def _among(self, marked: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
        if marked is None:
            return None
        among = self.table.gather(marked, ids, False)
        return among if bool(among.any()) else None

    def weights(self, ids: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor | None:
        """`weights` (None: 1 each) over `ids`, 0 where an example is silenced."""
        silenced = self.silenced(ids)
        if silenced is None:
            return weights
        return torch.where(silenced, 0.0, 1.0 if weights is None else weights)

    def row(self) -> dict:
        """The epoch's metrics: the rule it applied, and auto's measure."""
        if self.setting == "off":
            return {}
        if self.setting != "auto":
            return {"label_doubt_rule": self.rule}
        return {"label_doubt_rule": self.rule, "label_doubt_share": self.measured_share}


def split_keep(
    selector: Selector, losses: torch.Tensor, ids: torch.Tensor, doubted: torch.Tensor | None, *,
    fixed_count: bool = False, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SB's rule (`Selector.kept_positions`) for the trusted examples, ranked against a history that gets
    no doubted example's loss, and a uniform draw of s for the `doubted` ones (a host mask), drawn from
    `generator` (on the host; None: the selector's own): the kept positions, ascending, and every
    example's keep probability, where `losses` are. Losses must be finite."""
    if doubted is None:
        return selector.kept_positions(losses, ids, fixed_count=fixed_count)
    device = losses.device
    trusted_at = (~doubted).nonzero().squeeze(1)
    doubted_at = doubted.nonzero().squeeze(1)
    rate = selectivity_from_beta(selector.beta)
    probabilities = torch.full((ids.numel(),), rate, device=device)
    kept = torch.empty(0, dtype=torch.int64, device=device)
    if trusted_at.numel():
        trusted_at = trusted_at.to(device)
        kept, probabilities[trusted_at] = selector.kept_positions(losses[trusted_at], ids[trusted_at.cpu()],
                                                                  fixed_count=fixed_count)
        kept = trusted_at[kept]
    draws = torch.rand(doubted_at.numel(), generator=generator or selector.generator)
    drawn = doubted_at[draws < rate].to(device)
    return torch.cat([kept, drawn]).sort().values, probabilities
