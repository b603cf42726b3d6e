"""The run configuration: one flat, validated record shared by the CLI, YAML files and Tune.

Every key is declared once, in its section (raysb.core.settings: its name, type, default and check),
and a built-in strategy's options on its card (raysb.core.strategy_options): `TrainConfig`'s fields are
derived from those declarations, and `settings()` builds the sections back from its values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Any

import yaml

from raysb.core.config_keys import record_keys, section_from_record, section_types
from raysb.core.errors import ConfigError
from raysb.core.selectivity import resolve_beta, selectivity_from_beta
from raysb.core.settings import (  # noqa: F401 (the choices are read from here too, as they always were)
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    SELECTION_BATCHNORMS,
    SELECTION_COMPILE_MODES,
    SELECTION_PRECISIONS,
    SelectionSettings,
    Settings,
)
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_card import StrategyOption
from raysb.core.strategy_options import OPTION_KEYS, only_applies, resolved_options
from raysb.core.strategy_table import STRATEGIES, strategy_card

# Keys earlier versions took, with why they are gone (a run made with one cannot be resumed).
_MERGED_EVERY_ROUND = (
    "is gone: ranks now merge the shared CDF_R in every round's exchange (docs/guides/ray-cluster.md, \"How it works\"); "
    "remove it (a distributed run made by an older raysb cannot be resumed)"
)
RETIRED_KEYS = {"cdf_sync_interval": _MERGED_EVERY_ROUND, "cdf_lag": _MERGED_EVERY_ROUND}

# The sections by name, in order; every key each declares a home for.
SECTIONS = section_types(Settings)
_KEYS = [key for section in SECTIONS.values() for key in record_keys(section)]


def _record_fields() -> list[tuple[str, str, dataclasses.Field]]:
    """The flat record's fields: each section's keys, the selection section's followed by the built-in
    strategies' options, each a key of its own name (None, not given, until the config resolves it)."""
    fields = []
    for section in SECTIONS.values():
        fields += [(key.name, key.kind, key.field) for key in record_keys(section)]
        if section is SelectionSettings:
            fields += [(name, option.kind, dataclasses.field(default=None)) for name, option in OPTION_KEYS.items()]
    return fields


@dataclass
class TrainConfig(make_dataclass("TrainConfigRecord", _record_fields(), namespace={"__module__": __name__})):
    """A run's settings as users write them, one flat record of keys; each key's meaning, default and
    check are declared in its section (raysb.core.settings). Made, it holds every value resolved and
    checked; `settings()` hands them out in sections."""

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            setattr(self, spec.name, _of_its_type(spec, getattr(self, spec.name)))
        for key in _KEYS:
            key.checked(getattr(self, key.name))
        self._resolve()
        self._check_across_keys()
        try:  # the selection settings' checks live with them (raysb.core.spec)
            spec = self.selection_spec()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if spec.holdout_share > 0 and self.data_mode != "memory":
            raise ConfigError(f"{self.strategy} holds out {spec.holdout_share:g} of the training data, a split of "
                              "in-memory data: not with data_mode=stream")

    # -- derived values -------------------------------------------------------
    def selection_spec(self) -> SelectionSpec:
        """Every selection setting of this run, resolved (raysb.core.spec)."""
        return SelectionSpec(
            strategy=self.strategy,
            batch_size=self.batch_size,
            beta=self.beta,
            selection_batch_size=self.batch_size if self.selection_batch_size is None else self.selection_batch_size,
            history_size=self.history_size,
            keep_floor=self.keep_floor,
            staleness_correction=self.staleness_correction,
            pipelined=self.pipeline_selection != "inline",
            lockstep=(self.workers or 1) > 1,
            # Streams of a run: data order seed, augmentation seed + 1, selection seed + 2,
            # gradient probes seed + 3, tracked examples seed + 4, the held-out split seed + 5,
            # the label noise seed + 6 (raysb.data.prepare).
            seed=self.seed + 2,
            # Stale-SB's first selection pass comes after the primed (plain-SGD) epochs.
            first_epoch=self.prime_epochs,
            kept_per_chunk=self.kept_per_chunk,
            sharded_table=self.loss_table == "sharded",
            options=resolved_options(self.strategy, self.strategy_options, self._option_keys()),
        )

    def derived_values(self) -> dict[str, Any]:
        """The values of the sections' `derived` fields (raysb.core.config_keys), by field name."""
        spec = self.selection_spec()
        return {
            "spec": spec,
            "runs_scoring_forwards": spec.runs_scoring_forwards,
            "held_out_share": spec.holdout_share,
            "compiles": bool(self.compile_selection) or bool(self.compile_training),
            "selectivity": self.selectivity if "selectivity" in strategy_card(self.strategy).settings else None,
            "record": self.to_dict(),
            "saved": self.saved_values(),
        }

    def settings(self) -> Settings:
        """This run's settings in typed sections (raysb.core.settings), for the parts that run it."""
        record, derived = self.to_dict(), self.derived_values()
        return Settings(**{name: section_from_record(section, record, derived) for name, section in SECTIONS.items()})

    # -- resolution and the checks that read several keys --------------------------
    def _option_keys(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in OPTION_KEYS}

    def _resolve(self) -> None:
        """Each value that depends on others, or on the strategy, made final."""
        if self.epochs is None and self.time_budget is None and self.work_budget is None:
            self.epochs = DEFAULT_EPOCHS  # beside a budget it stays None: the budget alone ends the run
        self._resolve_batch_size()
        if self.lr_schedule_key == "auto":
            self.lr_schedule_key = ("work" if self.work_budget is not None
                                    else "time" if self.time_budget is not None else "epoch")
        try:
            self.beta = resolve_beta(self.beta, self.selectivity)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.selectivity is None:
            self.selectivity = selectivity_from_beta(self.beta)
        self.strategy_options = _options_in_their_kinds(self.strategy, self.strategy_options)
        options = resolved_options(self.strategy, self.strategy_options, self._option_keys())
        for name, option in OPTION_KEYS.items():
            setattr(self, name, options[name] if name in options else option.value_elsewhere())
        self.strategy_options = {name: value for name, value in options.items() if name not in OPTION_KEYS}

    def _resolve_batch_size(self) -> None:
        """Each worker's b. The record keeps global_batch_size as given (None unless given), so a run
        folder's config.yaml reads back to the same b, as those of runs made before the default split."""
        workers = max(1, self.workers or 1)
        if self.global_batch_size is not None:
            if self.global_batch_size % workers:
                raise ConfigError(f"global_batch_size {self.global_batch_size} does not split evenly over {workers} "
                                  f"workers: give a multiple of {workers}, or batch_size (each worker's)")
            self.batch_size = self.global_batch_size // workers
        elif self.batch_size is None:
            self.batch_size = max(1, DEFAULT_BATCH_SIZE // workers)

    def _check_across_keys(self) -> None:
        card = strategy_card(self.strategy)
        if self.lr_schedule_key == "time" and self.time_budget is None:
            raise ConfigError("lr_schedule_key time keys the schedule to the time budget: give a time_budget")
        if self.lr_schedule_key == "work" and self.work_budget is None:
            raise ConfigError("lr_schedule_key work keys the schedule to the work budget: give a work_budget")
        if self.epochs is None:
            self._check_budget_alone()
        if self.lr_schedule in ("step", "accelerated") and not self.lr_milestones:
            raise ConfigError(f"lr_schedule {self.lr_schedule} needs lr_milestones (epochs to decay at)")
        if self.selection_refresh_steps != 1 and self.selection_precision != "int8":
            raise ConfigError(
                f"selection_refresh_steps={self.selection_refresh_steps} only applies to selection_precision int8, "
                f"not {self.selection_precision}"
            )
        if self.selection_strength_schedule != "constant" and not card.reads("selection_strength_schedule"):
            raise ConfigError(only_applies("selection_strength_schedule", "str", self.selection_strength_schedule,
                                           self.strategy))
        if self.kept_fraction_schedule != "constant" and not card.keeps_fraction:
            keeping = [name for name, each in STRATEGIES.items() if each.keeps_fraction]
            raise ConfigError(f"kept_fraction_schedule {self.kept_fraction_schedule} applies to the strategies that keep "
                              f"a fraction ({', '.join(keeping)}), not {self.strategy}")
        if card.selects and self.epochs is not None and self.prime_epochs + self.anneal_epochs >= self.epochs:
            raise ConfigError(
                f"prime_epochs={self.prime_epochs} and anneal_epochs={self.anneal_epochs} train on every example in "
                f"all {self.epochs} epochs: {self.strategy} would never select; give more epochs or fewer of those"
            )
        if self.gpus_per_worker > 0 and self.device == "cpu":
            raise ConfigError("gpus_per_worker > 0 contradicts device=cpu")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out and --overwrite replaces it: give one of them")
        self._check_loss_table(card)
        self._check_streaming()
        if self.pipeline_selection == "actor" and self.workers is None:
            raise ConfigError("pipeline_selection=actor scores on a Ray actor: set workers (0 for Ray Train in this process)")

    def _check_budget_alone(self) -> None:
        """What counts in epochs of the run needs the epochs given where a budget alone would end it."""
        if self.lr_schedule_key in ("epoch", "backprop"):
            raise ConfigError(f"lr_schedule_key {self.lr_schedule_key} decays the lr over the run's epochs, and a "
                              "budget without epochs ends the run with none fixed: give epochs, or leave "
                              "lr_schedule_key auto (the schedule ends at the budget)")
        if self.anneal_epochs:
            raise ConfigError("anneal_epochs counts back from the run's last epoch, and a budget without epochs "
                              "ends the run with none fixed: give epochs, or anneal_share (the last share of the "
                              "budget)")

    def _check_loss_table(self, card) -> None:
        if self.loss_table == "replicated":
            return
        if not card.shardable_table:
            sharding = [name for name, each in STRATEGIES.items() if each.shardable_table]
            raise ConfigError(f"loss_table sharded applies to the strategies that decide every epoch from their loss "
                              f"table as it starts ({', '.join(sharding)}), not {self.strategy}")
        if self.workers is None:
            raise ConfigError("loss_table sharded splits the table between Ray Train workers: set workers")
        # Each rank decides only the examples it owns, so no epoch may look another's up chunk by chunk
        # (nor may a strategy's options: its card checks those, raysb.core.spec).
        chunk_by_chunk = (["data_mode=stream"] if self.data_mode != "memory" else []) + \
            (["plan_epochs=false"] if not self.plan_epochs else [])
        if chunk_by_chunk:
            raise ConfigError(f"loss_table sharded decides every epoch as it starts, which {', '.join(chunk_by_chunk)} "
                              "does not: use loss_table replicated")

    def _check_streaming(self) -> None:
        if self.parquet_columns and self.dataset != "parquet":
            raise ConfigError(f"parquet_columns names the columns of dataset parquet, not of {self.dataset!r}")
        if self.data_mode == "memory":
            return
        if self.dataset != "parquet":
            raise ConfigError(
                f"data_mode=stream reads the raysb Parquet format (dataset=parquet), not {self.dataset!r}; "
                "convert a dataset with raysb.data.write_parquet"
            )
        if self.workers is None:
            raise ConfigError("data_mode=stream runs on Ray Data: set workers (0 for Ray Train in this process)")
        in_memory_only = [
            name for name in ("subset", "test_subset", "image_size") if getattr(self, name) is not None
        ] + (["label_noise"] if self.label_noise > 0 else [])
        if in_memory_only:
            raise ConfigError(f"{', '.join(in_memory_only)} work on in-memory data only, not with data_mode=stream")

    # -- serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def saved_values(self) -> dict[str, Any]:
        """The resolved values as a run keeps them (config.yaml, its checkpoint).

        `resume` and `overwrite` say what one invocation does with its --out, not how the
        run trains: they are saved off, so running them again never replaces a run."""
        return {**self.to_dict(), "resume": False, "overwrite": False}

    def save(self, path: str | Path) -> None:
        """The resolved config as YAML that `raysb train --config` runs again as it ran."""
        write_config(self.saved_values(), path)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "TrainConfig":
        refuse_unknown_keys(values, source)
        return cls(**{key: _coerce(_FIELDS[key], value, source) for key, value in values.items()})

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        return cls.from_dict(merge_overrides(read_config_file(path), overrides or {}), source=str(path))




_FIELDS = {spec.name: spec for spec in dataclasses.fields(TrainConfig)}


class ConfigTypeError(ConfigError, TypeError):
    """A key TrainConfig does not have, or a value of the wrong type: a ConfigError, and the TypeError
    that calling TrainConfig so raised before, so that code catching either still does."""


def refuse_unknown_keys(keys: Iterable[str], source: str) -> None:
    """Refuse keys TrainConfig does not have: a retired one saying why it is gone, any other naming the
    key it is nearest to."""
    keys = set(keys)
    retired = sorted(keys & set(RETIRED_KEYS))
    if retired:
        raise ConfigTypeError(f"{source}: " + "; ".join(f"{key} {RETIRED_KEYS[key]}" for key in retired))
    unknown = sorted(keys - set(_FIELDS))
    if unknown:
        guesses = [difflib.get_close_matches(key, _FIELDS, n=1) for key in unknown]
        named = ", ".join(key + (f" (did you mean {guess[0]}?)" if guess else "") for key, guess in zip(unknown, guesses))
        raise ConfigTypeError(f"unknown key(s) in {source}: {named}")


def _refusing_unknown_keys(generated: Callable) -> Callable:
    """TrainConfig's generated __init__, refusing an unknown key in one line, as a file's is, and values
    without a key's name: given in order, they would fill whichever keys come first."""

    @functools.wraps(generated)
    def __init__(self, *positional, **values) -> None:
        if positional:
            raise ConfigTypeError(f"TrainConfig takes its keys by name (TrainConfig(dataset=..., epochs=...)), "
                                  f"got {len(positional)} value(s) without one")
        refuse_unknown_keys(values, "TrainConfig")
        generated(self, **values)

    return __init__


TrainConfig.__init__ = _refusing_unknown_keys(TrainConfig.__init__)


def write_config(saved_values: dict[str, Any], path: str | Path) -> None:
    """A run's saved values (`TrainConfig.saved_values`) as the YAML file `raysb train --config` reads."""
    Path(path).write_text(yaml.safe_dump(saved_values, sort_keys=False))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The keys a YAML config file sets, as written (unvalidated)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(values).__name__}")
    return values


def coerce_key(key: str, value: Any, source: str) -> Any:
    """`value` (a YAML or command-line scalar) in the type of config key `key`, as TrainConfig would hold it."""
    return _coerce(_FIELDS[key], value, source)


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML) into a dict; `a.b=v` sets key b of dict a."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {assignment!r}")
        value = yaml.safe_load(raw) if raw else None
        head, _, sub = key.partition(".")
        if sub:
            overrides.setdefault(head, {})[sub] = value
        else:
            overrides[head] = value
    return overrides


def merge_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; a dict-valued key (model_options) is merged, not replaced; and an
    override of selectivity or beta replaces both, as they are two names for one setting."""
    merged = dict(values)
    if "selectivity" in overrides or "beta" in overrides:
        merged.pop("selectivity", None)
        merged.pop("beta", None)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _coerce(spec: dataclasses.Field, value: Any, source: str) -> Any:
    """Turn YAML/CLI scalars into the field's type, naming the key when that fails."""
    kind = str(spec.type)
    # YAML's null (`strategy:` with nothing after it) for a key that takes no None: named where it was written.
    if value is None and not kind.endswith("| None") and spec.default is not None:
        raise ConfigTypeError(f"{spec.name} in {source} must be {_in_words(kind)}, got null (leave the key out "
                              "for its default)")
    return _in_kind(kind, value, f"{spec.name} in {source}")


def _in_kind(kind: str, value: Any, named: str) -> Any:
    """`value` in the type `kind` annotates (None as it is); where it cannot be, a ConfigTypeError saying
    what `named` must be."""
    if value is None:
        return None
    try:
        return _as_kind(kind.partition(" | ")[0], value)
    except (TypeError, ValueError, KeyError):
        raise ConfigTypeError(f"{named} must be {_in_words(kind)}, got {value!r}") from None


def _options_in_their_kinds(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """`strategy_options` in the types the strategy's card declares (its StrategyOptions), as the
    built-ins' option keys are; a name the card does not declare is left for resolved_options to refuse."""
    declared = strategy_card(strategy).options
    typed = {}
    for name, value in options.items():
        option = declared.get(name)
        if not isinstance(option, StrategyOption):
            typed[name] = value
            continue
        named = f"strategy_options.{name}"
        if value is None and not option.kind.endswith("| None"):
            raise ConfigTypeError(f"{named} must be {_in_words(option.kind)}, got None")
        typed[name] = _in_kind(option.kind, value, named)
    return typed


# How YAML and the command line spell a switch.
_SWITCH_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _as_kind(base: str, value: Any) -> Any:
    """`value` as a key of type `base` holds it: the spellings of YAML and the command line converted,
    a value of another kind refused (ValueError), so that `true` is no epoch count nor 2 a switch."""
    if base == "bool":
        if isinstance(value, str):
            return _SWITCH_WORDS[value.lower()]
        if isinstance(value, float) or value not in (0, 1):
            raise ValueError(value)
        return bool(value)
    if base in ("int", "float") and isinstance(value, bool):
        raise ValueError(value)
    if base == "int":
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if base == "float":
        return float(value)
    if base == "list":
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if (base == "dict") != isinstance(value, dict) or base == "str" and isinstance(value, list):
        raise ValueError(value)
    return str(value) if base == "str" else value


# The types a value given in Python may have, by the annotation's first word, and the plain Python
# type a number or a tuple is kept as.
_PYTHON_TYPES = {"bool": bool, "int": numbers.Integral, "float": numbers.Real, "str": str, "dict": dict,
                 "list": (list, tuple)}
_KEPT_AS = {"int": int, "float": float, "list": list}


def _of_its_type(spec: dataclasses.Field, value: Any) -> Any:
    """A value as TrainConfig(...) was given it, refused where it is not of its key's type, in one line
    naming the key; NumPy's numbers made Python's (YAML saves no others) and a tuple a list."""
    kind = str(spec.type)
    # A strategy's option key is None until the config resolves it, whatever its type.
    if value is None and (kind.endswith("| None") or spec.default is None):
        return value
    base = kind.partition(" | ")[0]
    if not isinstance(value, _PYTHON_TYPES[base]) or (base in ("int", "float") and isinstance(value, bool)):
        raise ConfigTypeError(f"{spec.name} must be {_in_words(kind)}, got {value!r}")
    return _KEPT_AS[base](value) if base in _KEPT_AS else value


# A field's annotation as a user would say it (the annotation itself read "float | None").
_KINDS_IN_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
                   "dict": "a mapping (key: value, ...)", "list": "a list"}


def _in_words(kind: str) -> str:
    base, _, optional = kind.partition(" | ")
    words = _KINDS_IN_WORDS.get(base, base)
    return f"{words} (or left out)" if optional == "None" else words
