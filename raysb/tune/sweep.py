"""Sweep files: which trials a `raysb tune` run holds, parsed and checked before Ray starts.

A sweep is a set of `raysb train` configs: `train` keys shared by every trial,
crossed with `grid` (each value a list), crossed with each entry of
`variants` (a strategy and its own settings, list values crossed too). The
split into variants is what lets one sweep hold Traditional (no selectivity),
SB over selectivities and Stale-SB over staleness: a plain cross product would
pair staleness with strategies that reject it. A variant of `strategy: all` is one
variant per built-in strategy, each given the variant's keys it reads, so a sweep of
every strategy holds a new one without an edit.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysb.config import ConfigError, TrainConfig, merge_overrides
from raysb.core.strategy_table import STRATEGIES

SEARCHES = ("grid", "optuna")
SCHEDULERS = ("none", "asha")
RESOURCE_KEYS = ("workers", "cpus_per_worker", "gpus_per_worker")
# Set by the sweep for every trial, so a sweep file may not set them itself.
MANAGED_KEYS = ("out", "time_budget", "resume", "address", "storage_path", *RESOURCE_KEYS)
# The keys some strategies read and others refuse (a card's settings and options).
SELECTION_KEYS = frozenset().union(*(card.settings | set(card.options) for card in STRATEGIES.values()))
EVERY_STRATEGY = "all"
TOP_LEVEL_KEYS = (
    "name", "description", "train", "grid", "variants", "ranges", "budget_s", "resources",
    "max_concurrent_trials", "search", "scheduler", "num_samples",
)


@dataclass
class Sweep:
    name: str
    source: str
    train: dict[str, Any]
    grid: dict[str, list]
    variants: list[dict[str, Any]]
    budget_s: float
    resources: dict[str, Any] = field(default_factory=lambda: {"workers": None, "cpus_per_worker": 1.0})
    max_concurrent_trials: int = 1
    search: str = "grid"
    scheduler: str = "none"
    num_samples: int = 1
    # optuna only: continuous ranges [low, high] searched within every variant
    ranges: dict[str, list[float]] = field(default_factory=dict)
    description: str = ""


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    text = path.read_text()
    try:
        values = yaml.safe_load(text) or {}
        lines = _key_lines(yaml.compose(text))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of sweep keys, got {type(values).__name__}")
    return parse_sweep(values, str(path), lines)


def parse_sweep(values: dict[str, Any], source: str, lines: dict[str, int] | None = None) -> Sweep:
    """Validate a sweep given as a dict; `lines` maps dotted key paths to file lines for errors."""
    lines = lines or {}

    def where(key: str) -> str:
        return f"{source}, line {lines[key]}" if key in lines else source

    train_keys = {f for f in TrainConfig.__dataclass_fields__}
    for key in values:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown sweep key {key!r} ({where(key)}); valid keys: {', '.join(TOP_LEVEL_KEYS)}")

    def check_train_keys(mapping: Any, prefix: str) -> dict:
        if not isinstance(mapping, dict):
            raise ConfigError(f"{prefix} must be a mapping of train config keys ({where(prefix)})")
        for key in mapping:
            dotted = f"{prefix}.{key}"
            if key not in train_keys:
                raise ConfigError(f"unknown train config key {key!r} in {prefix} ({where(dotted)})")
            if key in MANAGED_KEYS:
                raise ConfigError(
                    f"{key!r} in {prefix} ({where(dotted)}) is set by the sweep for each trial; "
                    "use budget_s and resources instead"
                )
        return dict(mapping)

    train = check_train_keys(values.get("train") or {}, "train")
    grid = check_train_keys(values.get("grid") or {}, "grid")
    for key, options in grid.items():
        if not isinstance(options, list) or not options:
            raise ConfigError(f"grid.{key} must be a non-empty list of values ({where(f'grid.{key}')})")
    raw_variants = values.get("variants") or [{}]
    if not isinstance(raw_variants, list):
        raise ConfigError(f"variants must be a list of mappings ({where('variants')})")
    variants = [each for i, v in enumerate(raw_variants) for each in _each_strategy(check_train_keys(v, f"variants[{i}]"))]
    for i, variant in enumerate(variants):
        for key, options in variant.items():
            if isinstance(options, list) and not options and key != "lr_milestones":
                raise ConfigError(f"variants[{i}].{key} is an empty list: the search space would be empty")

    budget = values.get("budget_s")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not math.isfinite(budget) or budget <= 0:
        raise ConfigError(f"budget_s must be a number of seconds > 0, got {budget!r} ({where('budget_s')})")
    resources = dict(values.get("resources") or {})
    unknown = sorted(set(resources) - set(RESOURCE_KEYS))
    if unknown:
        raise ConfigError(f"unknown resources key(s) {unknown} ({where('resources')}); valid: {', '.join(RESOURCE_KEYS)}")
    resources.setdefault("workers", None)
    resources.setdefault("cpus_per_worker", 1.0)
    resources.setdefault("gpus_per_worker", 0.0)
    concurrency = values.get("max_concurrent_trials", 1)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"max_concurrent_trials must be an integer >= 1, got {concurrency!r}")
    search, scheduler = values.get("search", "grid"), values.get("scheduler", "none")
    if search not in SEARCHES:
        raise ConfigError(f"unknown search {search!r} ({where('search')}); choose one of {', '.join(SEARCHES)}")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler {scheduler!r} ({where('scheduler')}); choose one of {', '.join(SCHEDULERS)}")
    ranges = dict(values.get("ranges") or {})
    if ranges and search != "optuna":
        raise ConfigError(f"ranges ({where('ranges')}) need search: optuna; a grid takes lists of values")
    for key, bounds in ranges.items():
        if key not in train_keys or not (isinstance(bounds, list) and len(bounds) == 2 and bounds[0] < bounds[1]):
            raise ConfigError(f"ranges.{key} must be a train key with [low, high], low < high ({where(f'ranges.{key}')})")
    num_samples = values.get("num_samples", 1)
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ConfigError(f"num_samples must be an integer >= 1, got {num_samples!r}")
    name = str(values.get("name") or Path(source).stem)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"sweep name {name!r} may hold only letters, digits, '.', '_' and '-'")

    sweep = Sweep(
        name=name,
        source=source,
        train=train,
        grid=grid,
        variants=variants,
        budget_s=float(budget),
        resources=resources,
        max_concurrent_trials=concurrency,
        search=search,
        scheduler=scheduler,
        num_samples=num_samples,
        ranges=ranges,
        description=str(values.get("description") or ""),
    )
    for trial in expand_trials(sweep):  # every trial must be a valid train config before anything runs
        try:
            trial_config(sweep, trial, out="unused")
        except ConfigError as error:
            raise ConfigError(f"{source}: trial {trial_name(trial)}: {error}") from None
    return sweep


def _each_strategy(variant: dict[str, Any]) -> list[dict[str, Any]]:
    """`variant` itself, or where it names strategy `all`, one variant per built-in strategy in the
    table's order, each with the variant's keys that strategy reads."""
    if variant.get("strategy") != EVERY_STRATEGY:
        return [variant]
    return [{"strategy": name, **{key: value for key, value in variant.items()
                                  if key != "strategy" and (key not in SELECTION_KEYS or card.reads(key))}}
            for name, card in STRATEGIES.items()]


def expand_trials(sweep: Sweep) -> list[dict[str, Any]]:
    """The grid's trials: each variant's list values crossed with `grid`, in file order."""
    trials = []
    for variant in sweep.variants:
        axes = {**sweep.grid, **{k: v for k, v in variant.items() if isinstance(v, list) and k != "lr_milestones"}}
        fixed = {k: v for k, v in variant.items() if k not in axes}
        keys = list(axes)
        for combination in itertools.product(*(axes[k] for k in keys)):
            trials.append({**fixed, **dict(zip(keys, combination))})
    return trials


def trial_name(overrides: dict[str, Any]) -> str:
    """A readable, file-safe, unique-per-settings name, strategy first."""
    parts = [str(overrides.get("strategy", "trial"))]
    parts += [f"{key}={_short(value)}" for key, value in sorted(overrides.items()) if key != "strategy"]
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", "_".join(parts))


def trial_config(sweep: Sweep, overrides: dict[str, Any], out: str, address: str | None = None) -> TrainConfig:
    values = {
        **merge_overrides(sweep.train, overrides),
        **sweep.resources,
        "time_budget": sweep.budget_s,
        "out": out,
        "address": address,
    }
    return TrainConfig.from_dict(values, source=sweep.source)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "-".join(_short(v) for v in value)
    return str(value)


def _key_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Dotted key path -> 1-based line, for every mapping key in the document."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.update(_key_lines(item, f"{prefix}[{index}]"))
    return lines
