"""A strategy defined outside raysb, as a user would: its class and its card, in one module,
named `halving_strategy:HALVING` wherever a strategy name goes (tests/test_strategy_cards.py)."""

from raysb.core.strategy_card import StrategyCard
from raysb.training.selection.strategies.base import Strategy


class Halving(Strategy):
    """Every other example of each chunk: no scores, half the data."""

    name = "halving"

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> "Halving":
        return cls()

    def kept_batch(self, epoch, chunk, ctx):
        return ctx.load(chunk[::2])


HALVING = StrategyCard(
    "halving", "every other example of each chunk", "halving_strategy:Halving",
    scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: 0.5,
    chunk_kept_share=lambda spec: 0.5, colour="tab:olive",
)
