"""The run configuration: one flat, validated record shared by the CLI, YAML files and Tune.

Every key is declared once, in its section (raysb.core.settings: its name, type, default and check),
and a built-in strategy's options on its card (raysb.core.strategy_options): `TrainConfig`'s fields are
derived from those declarations, and `settings()` builds the sections back from its values.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Any

import yaml

from raysb.core.config_keys import record_keys, section_from_record, section_types
from raysb.core.errors import ConfigError
from raysb.core.selectivity import resolve_beta, selectivity_from_beta
from raysb.core.settings import (  # noqa: F401 (the choices are read from here too, as they always were)
    SELECTION_BATCHNORMS,
    SELECTION_COMPILE_MODES,
    SELECTION_PRECISIONS,
    SelectionSettings,
    Settings,
)
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_options import OPTION_KEYS, only_applies, resolved_options
from raysb.core.strategy_table import STRATEGIES, strategy_card

# Keys earlier versions took, with why they are gone (a run made with one cannot be resumed).
_MERGED_EVERY_ROUND = (
    "is gone: ranks now merge the shared CDF_R in every round's exchange (README, \"How it works\"); "
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
        for key in _KEYS:
            key.checked(getattr(self, key.name))
        self._resolve()
        self._check_across_keys()
        try:  # the selection settings' checks live with them (raysb.core.spec)
            self.selection_spec()
        except ValueError as error:
            raise ConfigError(str(error)) from None

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
            # gradient probes seed + 3, tracked examples seed + 4.
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
            "compiles": self.compile_selection or bool(self.compile_training),
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
        if self.lr_schedule_key == "auto":
            self.lr_schedule_key = ("work" if self.work_budget is not None
                                    else "time" if self.time_budget is not None else "epoch")
        try:
            self.beta = resolve_beta(self.beta, self.selectivity)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.selectivity is None:
            self.selectivity = selectivity_from_beta(self.beta)
        options = resolved_options(self.strategy, self.strategy_options, self._option_keys())
        for name, option in OPTION_KEYS.items():
            setattr(self, name, options[name] if name in options else option.value_elsewhere())
        self.strategy_options = {name: value for name, value in options.items() if name not in OPTION_KEYS}

    def _check_across_keys(self) -> None:
        card = strategy_card(self.strategy)
        if self.lr_schedule_key == "time" and self.time_budget is None:
            raise ConfigError("lr_schedule_key time keys the schedule to the time budget: give a time_budget")
        if self.lr_schedule_key == "work" and self.work_budget is None:
            raise ConfigError("lr_schedule_key work keys the schedule to the work budget: give a work_budget")
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
        if card.selects and self.prime_epochs + self.anneal_epochs >= self.epochs:
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
            name for name in ("subset", "test_subset") if getattr(self, name) is not None
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
        known = {f.name: f for f in dataclasses.fields(cls)}
        retired = sorted(set(values) & set(RETIRED_KEYS))
        if retired:
            raise ConfigError(f"{source}: " + "; ".join(f"{key} {RETIRED_KEYS[key]}" for key in retired))
        unknown = sorted(set(values) - set(known))
        if unknown:
            guesses = [difflib.get_close_matches(key, known, n=1) for key in unknown]
            named = ", ".join(key + (f" (did you mean {guess[0]}?)" if guess else "") for key, guess in zip(unknown, guesses))
            raise ConfigError(f"unknown key(s) in {source}: {named}")
        try:
            return cls(**{k: _coerce(known[k], v, source) for k, v in values.items()})
        except TypeError as error:
            raise ConfigError(f"bad value in {source}: {error}") from None

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        return cls.from_dict(merge_overrides(read_config_file(path), overrides or {}), source=str(path))




_FIELDS = {spec.name: spec for spec in dataclasses.fields(TrainConfig)}


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
    if value is None:
        return None
    kind = str(spec.type)
    try:
        if kind.startswith("bool"):
            if isinstance(value, str):
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return lowered in ("true", "1", "yes")
            return bool(value)
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind == "dict" and not isinstance(value, dict):
            raise ValueError(value)
        if kind == "list":
            return list(value) if isinstance(value, (list, tuple)) else [value]
        if kind.startswith("str"):
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{spec.name} in {source} must be {_in_words(kind)}, got {value!r}") from None
    return value


# A field's annotation as a user would say it (the annotation itself read "float | None").
_KINDS_IN_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
                   "dict": "a mapping (key: value, ...)", "list": "a list"}


def _in_words(kind: str) -> str:
    base, _, optional = kind.partition(" | ")
    words = _KINDS_IN_WORDS.get(base, base)
    return f"{words} (or left out)" if optional == "None" else words
