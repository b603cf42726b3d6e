"""A config key, declared once: a field of its section (raysb.core.settings) whose metadata says what
the flat record users write calls it and how its value is checked. raysb.config derives the record's
keys (`record_keys`) and builds every section from the record (`section_from_record`) out of
these declarations alone, so a new key is one field in its section. Pure Python.

A section's field is one of three:
- `key(default)`: a key whose home is this section;
- `copy_of(name)`: another section's key, which this section's readers read too;
- `derived()`: a value the config resolves from its keys (the selection spec, the run's record).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from raysb.core.errors import ConfigError, check_choice

_DECLARED = "raysb.config_key"

# A check of a key's value: check(name, value) raises a ConfigError naming the key.
Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Declared:
    """What one field of a section is to the flat record: a key whose home this section is (`home`), a
    copy of another section's key, or neither (a `derived` value)."""

    home: bool = False
    derived: bool = False
    # The record's name for the key it holds, where it is not the field's.
    name: str | None = None
    check: Check | None = None

    def record_name(self, section_field: dataclasses.Field) -> str:
        return self.name or section_field.name


def key(default: Any = MISSING, *, name: str | None = None, check: Check | None = None,
        factory: Callable[[], Any] | None = None) -> Any:
    """A config key whose home is this section: its `default` (or `factory` for a mutable one), its name
    in the flat record where the section calls it otherwise (`name`), and its `check`, called for every
    value but a None that the key's type allows."""
    return dataclasses.field(default=default, default_factory=MISSING if factory is None else factory,
                             metadata={_DECLARED: Declared(home=True, name=name, check=check)})


def copy_of(name: str) -> Any:
    """The value of config key `name`, declared in another section."""
    return dataclasses.field(metadata={_DECLARED: Declared(name=name)})


def derived(**field_options) -> Any:
    """A value the config resolves from its keys (raysb.config.TrainConfig.derived_values names it)."""
    return dataclasses.field(metadata={_DECLARED: Declared(derived=True)}, **field_options)


def must(test: Callable[[Any], bool], expectation: str) -> Check:
    """A check that `test(value)` holds; the error says the key must be `expectation`."""
    def check(name: str, value: Any) -> None:
        if not test(value):
            raise ConfigError(f"{name} must be {expectation}, got {value!r}")
    return check


def one_of(choices: tuple[str, ...]) -> Check:
    return lambda name, value: check_choice(name, value, choices)


def each_one_of(choices: tuple[str, ...]) -> Check:
    """For a list key: every item is one of `choices`."""
    def check(name: str, values: Any) -> None:
        for value in values:
            check_choice(name, value, choices)
    return check


@dataclass(frozen=True)
class RecordKey:
    """One key of the flat record, as its home section declares it."""

    name: str
    # The record's annotation ("int | None"); a section's tuple is a list in the record, as YAML writes it.
    kind: str
    field: dataclasses.Field
    check: Check | None

    def checked(self, value: Any) -> None:
        if self.check is not None and not (value is None and self.kind.endswith("| None")):
            self.check(self.name, value)


def declared(section_field: dataclasses.Field) -> Declared:
    return section_field.metadata[_DECLARED]


def record_keys(section: type) -> list[RecordKey]:
    """Every key `section` is the home of, in its order."""
    keys = []
    for each in dataclasses.fields(section):
        declaration = declared(each)
        if not declaration.home:
            continue
        kind = "list" if each.type == "tuple" else each.type
        default = dict(default=each.default) if each.default is not MISSING else dict(
            default_factory=list if kind == "list" else each.default_factory)
        keys.append(RecordKey(declaration.record_name(each), kind, dataclasses.field(**default), declaration.check))
    return keys


def section_from_record(section: type, record: Mapping[str, Any], derived_values: Mapping[str, Any]) -> Any:
    """`section` built from the flat record's values and the config's derived ones."""
    values = {}
    for each in dataclasses.fields(section):
        declaration = declared(each)
        value = derived_values[each.name] if declaration.derived else record[declaration.record_name(each)]
        # The section holds its own copy of a mutable value; a list as the tuple the section declares.
        values[each.name] = tuple(value) if each.type == "tuple" else dict(value) if each.type == "dict" else value
    return section(**values)


def section_types(settings: type) -> dict[str, type]:
    """The sections of `settings` (raysb.core.settings.Settings), by field name, in order."""
    hints = typing.get_type_hints(settings)
    return {each.name: hints[each.name] for each in dataclasses.fields(settings)}
