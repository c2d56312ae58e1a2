"""The refusal every concern gives an option set to none of its choices."""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.errors import ConfigError


def one_of(flag: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError naming `flag`'s choices unless `value` is one of them."""
    if value not in choices:
        raise ConfigError(f"Unknown {flag} '{value}'; choose one of {', '.join(choices)}.")
