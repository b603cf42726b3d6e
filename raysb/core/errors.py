"""raysb's errors: a setting that cannot run (`ConfigError`), and errors that stop a run on
every rank at the same selection round or step.

Lockstep ranks exchange a code and a message for each (raysb.training.selection.exchange),
so a rank that hits one does not leave the others waiting in a collective: every
rank raises the same error, naming the problem and the rank that hit it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    """Refuse a setting `name` whose `value` is none of `choices`, naming them."""
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


class AgreedError(Exception):
    """An error that every rank of a run raises together."""

    code = 0


class NonFiniteLossError(AgreedError, FloatingPointError):
    """A loss was NaN or infinite; training cannot rank or learn from it."""

    code = 1


class BadBatchError(AgreedError, ValueError):
    """A batch, or what a loss function made of it, is not what selection needs."""

    code = 2


AGREED_ERRORS = {kind.code: kind for kind in (NonFiniteLossError, BadBatchError)}
