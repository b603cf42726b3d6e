"""A strategy defined outside raysb, as a user would: its class and its card, in one module,
named `halving_strategy:HALVING` wherever a strategy name goes (tests/test_strategy_cards.py).
It has an option of its own, which the card declares and checks and the class reads."""

import torch

from raysb import Decision, Strategy, StrategyCard


class Halving(Strategy):
    """Every other example of each chunk, from its `start`-th: no scores, half the data."""

    name = "halving"

    def __init__(self, start: int):
        self.start = start

    @classmethod
    def build(cls, spec, *, history, sample_ids, device) -> "Halving":
        return cls(spec.options["start"])

    def decide(self, epoch, ids, scores):
        return Decision(torch.arange(self.start, len(ids), 2))


def _check(spec) -> None:
    if spec.options["start"] not in (0, 1):
        raise ValueError(f"halving's start must be 0 or 1, got {spec.options['start']!r}")


HALVING = StrategyCard(
    "halving", "every other example of each chunk", "halving_strategy:Halving",
    scored_share=lambda staleness: 0.0, kept_share=lambda selectivity: 0.5,
    chunk_kept_share=lambda spec: 0.5, colour="tab:olive", options={"start": 0}, check=_check,
)
