"""Bundled models, by name for `dtrain demo --model NAME [--model-size SIZE]`."""

from __future__ import annotations

from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.digits import DigitsCNN, DigitsMLP
from dtrain.models.gpt import GPT, SIZES
from dtrain.names import MODELS


def build(name: str, size: str | None = None) -> nn.Module:
    """A fresh instance of the bundled model `name` (gpt: of `size`, default tiny)."""
    if name == "gpt":
        size = size or "tiny"
        if size not in SIZES:
            raise ConfigError(
                f"Unknown --model-size '{size}' for gpt; choose one of {', '.join(SIZES)}."
            )
        return GPT(SIZES[size])
    if size is not None:
        raise ConfigError(f"--model-size applies to --model gpt only, not '{name}'.")
    if name == "cnn":
        return DigitsCNN()
    if name == "mlp":
        return DigitsMLP()
    raise ConfigError(
        f"Unknown model '{name}'. Bundled models: {', '.join(MODELS)}; pick one with --model."
    )
