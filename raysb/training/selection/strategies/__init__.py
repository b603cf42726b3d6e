"""Which examples of each selection chunk get a backward pass: one strategy a file, built by name here.

A strategy is a decision: a chunk's ids and the scores it asks for in, the examples to train on
and their loss weights out, or the whole epoch's at once where that needs no scores
(raysb.training.selection.strategies.base). Its card (raysb.core.strategy_table, or a
user's own `package.module:CARD`) names its class, which builds it for a run.
"""

from __future__ import annotations

import torch

from raysb.core.imports import import_from_working_directory
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_card import StrategyCard
from raysb.core.strategy_table import hand_over_card, strategy_card
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies.base import ChunkContext, Decision, Scores, Strategy
from raysb.training.selection.strategies.free_sb import FreeSBStrategy
from raysb.training.selection.strategies.infobatch import InfoBatchStrategy
from raysb.training.selection.strategies.kath18 import Kath18Strategy
from raysb.training.selection.strategies.rho_loss import RhoLossStrategy
from raysb.training.selection.strategies.sb import SBStrategy
from raysb.training.selection.strategies.stale_sb import StaleSBStrategy
from raysb.training.selection.strategies.traditional import Traditional
from raysb.training.selection.strategies.uniform import UniformStrategy

__all__ = [
    "ChunkContext", "Decision", "FreeSBStrategy", "InfoBatchStrategy", "Kath18Strategy", "LossTable", "RhoLossStrategy",
    "SBStrategy", "Scores", "StaleSBStrategy", "Strategy", "Traditional", "UniformStrategy", "build_strategy",
    "hand_over_strategy", "strategy_class",
]


# Users' own strategy classes a Ray Train driver sent to this worker, by their cards' implementation.
_HANDED_OVER: dict[str, type[Strategy]] = {}


def hand_over_strategy(name: str, card: StrategyCard, implementation: type[Strategy]) -> None:
    """Build strategy `name` from `card` and `implementation` from now on in this process, without
    importing their module: a Ray Train worker starts where the driver's working directory is not
    on its path (raysb.distributed.launch sends them)."""
    hand_over_card(name, card)
    _HANDED_OVER[card.implementation] = implementation


def strategy_class(card: StrategyCard) -> type[Strategy]:
    """The Strategy subclass `card.implementation` names."""
    if card.implementation in _HANDED_OVER:
        return _HANDED_OVER[card.implementation]
    module_name, _, attribute = card.implementation.partition(":")
    found = getattr(import_from_working_directory(module_name), attribute, None)
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise TypeError(f"strategy {card.name}: {card.implementation} is not a Strategy subclass")
    return found


def build_strategy(
    spec: SelectionSpec,
    *,
    history=None,
    sample_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> Strategy:
    """The strategy `spec.strategy` names; `history` is a shared CDF_R (raysb.training.selection.merged_histogram).

    Loss tables (Stale-SB's, free-sb's, InfoBatch's) cover `sample_ids` when the training set is
    known, or grow as examples are first recorded.
    """
    return strategy_class(strategy_card(spec.strategy)).build(
        spec, history=history, sample_ids=sample_ids, device=device
    )
