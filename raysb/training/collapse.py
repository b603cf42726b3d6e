"""Spotting a model that has collapsed to chance, so no budget is spent on it."""

from __future__ import annotations

from dataclasses import dataclass, field

# Within this of chance counts as chance: a collapsed model predicting one class
# scores exactly chance on a balanced test set, a barely alive one a point better.
CHANCE_MARGIN = 0.02


@dataclass
class CollapseGuard:
    """Counts consecutive evaluations at chance; `patience` of them in a row is a collapse.

    Chance, not a training-loss plateau, is the signal: Selective-Backprop's
    training loss is measured on the hardest examples and sits near ln(K) under
    label noise while the model is fine.
    """

    num_classes: int
    patience: int = 3
    at_chance_epochs: list[int] = field(default_factory=list)

    @property
    def chance_error(self) -> float:
        return 1.0 - 1.0 / self.num_classes

    def update(self, epoch: int, test_error: float) -> str | None:
        """Record an evaluation (1-based epoch); returns why the run collapsed, or None."""
        if test_error < self.chance_error - CHANCE_MARGIN:
            self.at_chance_epochs.clear()
            return None
        self.at_chance_epochs.append(epoch)
        if self.patience == 0 or len(self.at_chance_epochs) < self.patience:
            return None
        first, last = self.at_chance_epochs[0], self.at_chance_epochs[-1]
        return (
            f"the model collapsed: test error {test_error:.1%} is at chance ({self.chance_error:.1%}) "
            f"for {len(self.at_chance_epochs)} evaluations in a row (epochs {first}-{last}); "
            "try a lower --lr, a longer --lr-warmup-epochs, --prime-epochs 1, or a higher --selectivity"
        )
