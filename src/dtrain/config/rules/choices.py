"""What every concern shares: the flag each option goes by, which options a config sets,
and the refusals of a value outside its choices or below its least."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a Config field: ``--name``, unless the field names its own."""
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")


def given(config: Config, *names: str) -> list[str]:
    """The flags of the options `names` (in that order) that `config` sets away from their
    defaults."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    return [flag_of(fields[n]) for n in names if getattr(config, n) != fields[n].default]


def one_of(flag: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError naming `flag`'s choices unless `value` is one of them."""
    if value not in choices:
        raise ConfigError(f"Unknown {flag} '{value}'; choose one of {', '.join(choices)}.")


def at_least(flag: str, value: float | None, least: int = 1) -> None:
    """Raise ConfigError unless `value` is at least `least` (None, a flag left out, passes)."""
    if value is not None and value < least:
        raise ConfigError(f"{flag} must be at least {least}, got {value}.")
