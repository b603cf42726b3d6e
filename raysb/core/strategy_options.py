"""A strategy's options for a run, resolved in one place for `raysb train` and `SelectiveBackprop`:
its card's defaults, under those given with `strategy_options`, under a built-in's options given as
config keys of their own names (`infobatch_prune_ratio: 0.3`). Pure Python.

A built-in strategy's options are config keys (`OPTION_KEYS`): raysb.config derives the flat record's
fields for them from the cards, so a new option on a built-in's card is a config key, checked and read
by its class, with no change outside its row and its class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raysb.core.errors import ConfigError, check_choice
from raysb.core.strategy_card import StrategyOption
from raysb.core.strategy_table import STRATEGIES, strategies_reading, strategy_card


def _option_keys() -> dict[str, StrategyOption]:
    keys: dict[str, StrategyOption] = {}
    for card in STRATEGIES.values():
        for name, option in card.options.items():
            if not isinstance(option, StrategyOption):
                raise TypeError(f"strategy {card.name}: declare option {name} as a StrategyOption (a config key "
                                "needs its type)")
            first = keys.setdefault(name, option)
            # One key for every card that has the option: it must read as one type everywhere.
            if (first.kind, first.value_elsewhere()) != (option.kind, option.value_elsewhere()):
                raise TypeError(f"option {name} of strategy {card.name} differs in its type or its value elsewhere "
                                f"from the other strategies' option {name}")
    return keys


# The built-in strategies' options, each a config key of its own name.
OPTION_KEYS: dict[str, StrategyOption] = _option_keys()


def only_applies(key: str, kind: str, value: Any, strategy: str) -> str:
    """Why config key `key` (annotated `kind`) set to `value` is refused for `strategy`, which does not read it."""
    # As users say it: "selection_weights unbiased", "kath18_reweight", "staleness=3".
    if kind == "str":
        shown = f"{key} {value}"
    else:
        shown = key if kind == "bool" or kind.endswith("| None") else f"{key}={value}"
    return f"{shown} only applies to strategy {' or '.join(strategies_reading(key))}, not {strategy}"


def resolved_options(
    strategy: str, options: Mapping[str, Any] | None, keys: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`strategy`'s options: its card's defaults, under `options` (strategy_options: a name its card does
    not declare is refused, listing the ones it does), under `keys` (built-in options given as config
    keys, OPTION_KEYS: None where not given; one its card does not have is refused, naming the
    strategies that read it, unless it holds the value runs without it record)."""
    card = strategy_card(strategy)
    options = dict(options or {})
    declared = card.option_defaults()
    unknown = sorted(set(options) - set(declared))
    if unknown:
        listed = f"its options are {', '.join(sorted(declared))}" if declared else "it has no options"
        raise ConfigError(f"strategy_options {', '.join(unknown)}: not an option of strategy {strategy} ({listed})")
    given = {}
    for name, value in (keys or {}).items():
        if value is None:
            continue
        if name in declared:
            given[name] = value
        elif value != OPTION_KEYS[name].value_elsewhere():
            raise ConfigError(only_applies(name, OPTION_KEYS[name].kind, value, strategy))
    for name in sorted(set(given) & set(options)):
        if given[name] != options[name]:
            raise ConfigError(f"{name} is given twice, as {given[name]!r} and as strategy_options.{name} "
                              f"{options[name]!r}: give it once")
    resolved = {**declared, **options, **given}
    for name, option in card.options.items():
        if isinstance(option, StrategyOption) and option.choices:
            check_choice(name, resolved[name], option.choices)
    return resolved
