"""RHO-LOSS (Mindermann et al., 2022): the examples of each presample whose loss the model can still
reduce, by the authors' rule (OATML/RHO-Loss, src/curricula/selection_methods.py)."""

from __future__ import annotations

import torch

from raysb.core.sample_index import SampleIndex
from raysb.core.transfer import to_device, to_host
from raysb.training.selection.strategies.base import Decision, Scores, Strategy


def selected_count(presample: int, selectivity: float) -> int:
    """How many of a presample of `presample` examples are kept: the authors' selected_batch_size,
    max(1, int(n_B * percent_train))."""
    return max(1, int(presample * selectivity))


def top_reducible(losses: torch.Tensor, irreducible: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the `count` largest reducible losses, `losses` - `irreducible`, ascending: the
    authors' top_x_indices(reducible_loss, count, largest=True), in the order a Decision lists them."""
    reducible = losses - irreducible
    return torch.sort(torch.argsort(reducible, descending=True)[:count]).values


class RhoLossStrategy(Strategy):
    """Each round reads a presample of B = b / s examples (its card's chunk_size), scores all of them
    with a selection forward, and keeps the max(1, int(B s)) whose reducible loss is largest: the loss
    minus the example's irreducible loss, the loss a model trained only on held-out data gives it. A
    mislabelled or unlearnable example has a high irreducible loss too, so it stops being chosen.

    The irreducible losses arrive once, before the first round (`use_irreducible_losses`), from a
    model of the run's own kind trained on the run's held-out split (raysb.training.irreducible_loss).
    """

    name = "rho-loss"

    def __init__(self, selectivity: float, irreducible_epochs: int):
        self.selectivity = selectivity
        self.epochs = irreducible_epochs
        self.index: SampleIndex | None = None
        self.irreducible: torch.Tensor | None = None

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> RhoLossStrategy:
        return cls(spec.selectivity, spec.options["irreducible_epochs"])

    def irreducible_epochs(self) -> int:
        return 0 if self.irreducible is not None else self.epochs

    def use_irreducible_losses(self, sample_ids: torch.Tensor, losses: torch.Tensor) -> None:
        sample_ids, losses = to_host(sample_ids), to_host(losses).float()
        self.index = SampleIndex(sample_ids)
        # Held in the index's sorted order, so a lookup is one gather.
        self.irreducible = losses[self.index.rows]

    def wants_scores(self, epoch: int, ids: torch.Tensor) -> Scores:
        return Scores.ALL

    def decide(self, epoch: int, ids: torch.Tensor, scores: torch.Tensor | None) -> Decision:
        if self.irreducible is None:
            raise RuntimeError("rho-loss decides on reducible losses: give it the irreducible ones first "
                               "(use_irreducible_losses)")
        # Chosen where the scores are: no round waits for the device.
        irreducible = to_device(self.irreducible[self.index.slots(ids.cpu())], scores.device)
        return Decision(top_reducible(scores, irreducible, selected_count(len(ids), self.selectivity)))

    def state_dict(self) -> dict:
        if self.irreducible is None:
            return {}
        return {"sample_ids": self.index.ids.clone(), "irreducible": self.irreducible.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.use_irreducible_losses(state["sample_ids"], state["irreducible"])
