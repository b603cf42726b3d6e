"""`search: optuna`: a multi-objective Optuna search over a sweep's variants (optional dependency).

The search space is the sweep itself, asked of Optuna define-by-run: first
which variant (strategy), then a value for each of its list-valued keys, then
any `ranges` that apply to that strategy. Trials minimise both final test
error and training wall-clock, so Optuna's study converges on the same
time-vs-error frontier that `raysb pareto` draws.
"""

from __future__ import annotations

from typing import Any

from raysb.config import ConfigError, TrainConfig
from raysb.core.strategy_table import strategy_card
from raysb.tune.sweep import SELECTION_KEYS, Sweep, trial_name

INT_KEYS = {name for name, spec in TrainConfig.__dataclass_fields__.items() if str(spec.type).startswith("int")}


def optuna_search(sweep: Sweep):
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise ConfigError(
            f"{sweep.source}: search: optuna needs the optuna package; pip install 'raysb[optuna]'"
        ) from None
    return OptunaSearch(
        space=SweepSpace(sweep), metric=["test_error", "wall_s"], mode=["min", "min"], seed=0
    )


class SweepSpace:
    """The define-by-run space; a class, not a closure, because Tune pickles its searcher state."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.drawn = 0

    def __call__(self, trial) -> dict[str, Any]:
        sweep = self.sweep
        index = trial.suggest_categorical("variant", list(range(len(sweep.variants))))
        overrides: dict[str, Any] = {}
        for key, value in {**sweep.grid, **sweep.variants[index]}.items():
            if isinstance(value, list) and key != "lr_milestones":
                # Optuna's choices must be scalars; a choice of lists is a choice of positions.
                position = trial.suggest_categorical(f"{index}.{key}", list(range(len(value))))
                overrides[key] = value[position]
            else:
                overrides[key] = value
        strategy = overrides.get("strategy", sweep.train.get("strategy", "sb"))
        for key, (low, high) in sweep.ranges.items():
            # A range over selection keys the strategy ignores or rejects is not searched there.
            if key in overrides or (key in SELECTION_KEYS and not strategy_card(strategy).reads(key)):
                continue
            if key in INT_KEYS:
                overrides[key] = trial.suggest_int(f"{index}.{key}", int(low), int(high))
            else:
                overrides[key] = trial.suggest_float(f"{index}.{key}", low, high, log=key == "lr")
        # Optuna may draw the same settings twice; the number keeps trial folders apart.
        self.drawn += 1
        return {"trial": {"name": f"{self.drawn:03d}-{trial_name(overrides)}", "overrides": overrides}}
