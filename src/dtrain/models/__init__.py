"""Bundled models, by name for `dtrain demo --model NAME`."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.digits import DigitsCNN, DigitsMLP

MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": DigitsMLP,
    "cnn": DigitsCNN,
}


def build(name: str) -> nn.Module:
    """A fresh instance of the bundled model `name`."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ConfigError(
            f"Unknown model '{name}'. Bundled models: {', '.join(MODELS)}; pick one with --model."
        ) from None
