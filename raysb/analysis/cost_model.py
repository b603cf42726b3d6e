"""The cost model of ../shared/GUIDE.md section 8: epoch time and training time from per-example pass costs."""

from __future__ import annotations

from raysb.core.strategy_table import strategy_card


def cost_model_ratio(
    strategy: str, costs: dict[str, float], selectivity: float, staleness: int, prime_fraction: float = 0.0
) -> float:
    """Predicted epoch time relative to Traditional (F + B), averaged over a run whose
    first `prime_fraction` of epochs are plain SGD (which cost what Traditional's do)."""
    full = costs["F"] + costs["B"]
    card = strategy_card(strategy)
    selecting = (costs["F_sel"] * card.scored_share(staleness) + card.kept_share(selectivity) * full) / full
    return prime_fraction + (1.0 - prime_fraction) * selecting


def modelled_seconds(rows, costs: dict[str, float]):
    """Training time the cost model gives for a run's cumulative example counts:
    F_sel per selection-forward example, F per training-forward example, B per backprop."""
    return (
        costs["F_sel"] * rows["selection_forward_examples"]
        + costs["F"] * rows["train_forward_examples"]
        + costs["B"] * rows["backprop_examples"]
    )
