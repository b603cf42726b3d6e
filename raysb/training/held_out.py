"""The share of the training data a strategy's card holds out of training (its `holdout_share`,
raysb.data.prepare.split_holdout), and the side work the strategy does on it as each epoch ends:
where it watches the held-out loss (free-sb's over-fitting guard), that loss, measured and counted.
RHO-LOSS's irreducible-loss model trains on the same split before the run (raysb.training.irreducible_loss)."""

from __future__ import annotations

from raysb.data import ImageDataset
from raysb.training.evaluation import Evaluation
from raysb.training.selection.rounds import SelectionRounds


class HeldOutSplit:
    def __init__(self, data: ImageDataset, rounds: SelectionRounds, evaluation: Evaluation):
        """`data`: the held-out examples, on the device."""
        self.data, self.rounds, self.evaluation = data, rounds, evaluation

    def after_epoch(self, epoch: int) -> str | None:
        """Where the strategy watches it, the held-out loss at the end of `epoch` and the epoch's mean
        training loss handed to it; a line for the run's console where it acts on them."""
        strategy = self.rounds.strategy
        if not strategy.watches_held_out():
            return None
        counts = self.rounds.progress_counts()
        if not counts["epoch_steps"]:  # an epoch a budget ended before its first step
            return None
        trained_loss = counts["epoch_loss_sum"] / counts["epoch_steps"]
        return strategy.observe_held_out_loss(epoch, self.loss(), trained_loss)

    def loss(self) -> float:
        """The mean loss on the split: a forward the method spends, timed as selection and counted as
        scored work."""
        with self.rounds.timer.phase("selection"):
            self.rounds.counters.side_forward_examples += len(self.data)
            return float(self.evaluation.example_losses(self.data, self.rounds.batch_size).mean())
