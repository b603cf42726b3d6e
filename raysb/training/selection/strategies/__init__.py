"""Which examples of each selection chunk get a backward pass: one strategy a file, built by name here.

A strategy sees the epoch one chunk at a time and returns the examples to queue for
training (raysb.training.selection.strategies.base); raysb.config.STRATEGIES names the
same strategies (what a config knows of each), STRATEGY_BUILDERS builds them.
"""

from __future__ import annotations

from typing import Callable

import torch

from raysb.core.selection import Selector
from raysb.core.spec import SelectionSpec
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies.base import ChunkContext, Strategy
from raysb.training.selection.strategies.free_sb import FreeSBStrategy
from raysb.training.selection.strategies.infobatch import InfoBatchStrategy
from raysb.training.selection.strategies.kath18 import Kath18Strategy
from raysb.training.selection.strategies.sb import SBStrategy
from raysb.training.selection.strategies.stale_sb import StaleSBStrategy
from raysb.training.selection.strategies.traditional import Traditional
from raysb.training.selection.strategies.uniform import UniformStrategy

__all__ = [
    "ChunkContext", "FreeSBStrategy", "InfoBatchStrategy", "Kath18Strategy", "LossTable", "SBStrategy",
    "STRATEGY_BUILDERS", "StaleSBStrategy", "Strategy", "Traditional", "UniformStrategy", "build_strategy",
]


def _selector(spec: SelectionSpec, history, device) -> Selector:
    return Selector(beta=spec.beta, history_size=spec.history_size, seed=spec.seed, device=device, history=history,
                    keep_floor=spec.keep_floor)


def _fixed_count(spec: SelectionSpec, device) -> bool:
    """Whether SB keeps a fixed count of each chunk: `kept_per_chunk` auto means on a GPU, where
    reading a random count every round would stop the host from queuing ahead."""
    return spec.kept_per_chunk == "fixed" or (spec.kept_per_chunk == "auto" and torch.device(device).type == "cuda")


def _table(spec: SelectionSpec, sample_ids, distribution: bool = False) -> LossTable:
    """A loss table over the training set's ids (or growing), on the host, shared by lockstep ranks."""
    return LossTable(sample_ids, shared=spec.lockstep, distribution=distribution)


def _free_sb(spec: SelectionSpec, sample_ids, device) -> FreeSBStrategy:
    # Ranked against the table's own recorded scores, not a window of recent losses (or the
    # ranks' merged one): the table is the same on every rank after each exchange.
    # Decided on the host, where the table is: no round waits for the device.
    return FreeSBStrategy(_table(spec, sample_ids, distribution=True), spec.beta, spec.seed, spec.keep_floor,
                          spec.score_refresh_epochs, weighted=spec.selection_weights == "unbiased")


# The strategy registry: raysb.config.STRATEGIES names the same strategies (what a config
# knows of each); these build them. Each builder takes (spec, shared CDF_R or None,
# the training set's sample ids or None, device).
STRATEGY_BUILDERS: dict[str, Callable[..., Strategy]] = {
    "traditional": lambda spec, history, sample_ids, device: Traditional(),
    "sb": lambda spec, history, sample_ids, device: SBStrategy(
        _selector(spec, history, device), _fixed_count(spec, device)
    ),
    "stale-sb": lambda spec, history, sample_ids, device: StaleSBStrategy(
        _selector(spec, history, device), spec.staleness, _table(spec, sample_ids, distribution=True),
        first_epoch=spec.first_epoch, record_training_losses=spec.training_loss_refresh,
        fixed_count=_fixed_count(spec, device), scored_priming=spec.scored_priming,
    ),
    "kath18": lambda spec, history, sample_ids, device: Kath18Strategy(
        spec.batch_size, spec.selectivity, spec.seed, spec.kath18_tau_threshold, spec.kath18_reweight, device
    ),
    "uniform": lambda spec, history, sample_ids, device: UniformStrategy(sample_ids, spec.selectivity, spec.seed),
    "free-sb": lambda spec, history, sample_ids, device: _free_sb(spec, sample_ids, device),
    "infobatch": lambda spec, history, sample_ids, device: InfoBatchStrategy(
        _table(spec, sample_ids), spec.infobatch_prune_ratio, spec.infobatch_delta, spec.seed
    ),
}


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
    if spec.strategy not in STRATEGY_BUILDERS:
        raise ValueError(f"unknown strategy {spec.strategy!r}; choose one of {', '.join(STRATEGY_BUILDERS)}")
    return STRATEGY_BUILDERS[spec.strategy](spec, history, sample_ids, device)
