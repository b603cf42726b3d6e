"""raysb: Selective-Backprop training on Ray.

Train with the CLI (`raysb train ...`), with `raysb.train(TrainConfig(...))`,
or add Selective-Backprop to your own loop, in one process or on Ray Train, with
`SelectiveBackprop` (docs/guides/own-loop.md).

The layers, from the bottom up (docs/concepts/architecture.md): `core` (selection
math, pure torch), `data`, `models`, `training` (one process, no Ray),
`distributed` (the Ray layer), `tune`, `analysis` and `bench`.
"""

from typing import TYPE_CHECKING

from raysb.version import __version__

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name loads on first use
    from raysb.api import train
    from raysb.config import ConfigError, TrainConfig
    from raysb.core.errors import BadBatchError, NonFiniteLossError
    from raysb.core.keep_rule import Selector
    from raysb.core.selectivity import scheduled_selectivity, scheduled_strength
    from raysb.core.strategy_card import StrategyCard, StrategyOption
    from raysb.distributed.cluster import ClusterError, check_worker_resources, connect_ray
    from raysb.distributed.console import relayed_console, relayed_log
    from raysb.inference import TrainedModel, load_model
    from raysb.selective_backprop import SelectiveBackprop
    from raysb.training.interrupt import Interrupted
    from raysb.training.loop import RunResult
    from raysb.training.selection.strategies.base import Decision, Scores, Strategy

# Where each public name lives: what a user imports, what `train()` and `SelectiveBackprop`
# raise and return, and what a user's own strategy is made of (docs/reference/index.md). With
# raysb.data's `__all__` they are the public API; everything else in the package is internal and
# may change between versions. They are imported on first use, so that `import raysb` (and
# `raysb.config` under it) costs no torch import, and the selection API does not pull in models,
# data loaders or Ray.
_EXPORTS = {
    "BadBatchError": "raysb.core.errors",
    "ClusterError": "raysb.distributed.cluster",
    "ConfigError": "raysb.config",
    "Decision": "raysb.training.selection.strategies.base",
    "Interrupted": "raysb.training.interrupt",
    "NonFiniteLossError": "raysb.core.errors",
    "RunResult": "raysb.training.loop",
    "Scores": "raysb.training.selection.strategies.base",
    "SelectiveBackprop": "raysb.selective_backprop",
    "Selector": "raysb.core.keep_rule",
    "Strategy": "raysb.training.selection.strategies.base",
    "StrategyCard": "raysb.core.strategy_card",
    "StrategyOption": "raysb.core.strategy_card",
    "TrainConfig": "raysb.config",
    "TrainedModel": "raysb.inference",
    "check_worker_resources": "raysb.distributed.cluster",
    "connect_ray": "raysb.distributed.cluster",
    "load_model": "raysb.inference",
    "relayed_console": "raysb.distributed.console",
    "relayed_log": "raysb.distributed.console",
    "scheduled_selectivity": "raysb.core.selectivity",
    "scheduled_strength": "raysb.core.selectivity",
    "train": "raysb.api",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raysb' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
