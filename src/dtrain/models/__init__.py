"""Bundled models, by name for `dtrain demo --model NAME [--model-size SIZE]`.

A foundation: it imports the leaves and `dtrain.datasets` (a recipe names its data).
"""

from __future__ import annotations

from torch import nn

from dtrain.command_names import MODELS
from dtrain.errors import ConfigError
from dtrain.models.digits import DigitsCNN, DigitsMLP
from dtrain.models.gpt import GPT, SIZES


def check_size(name: str, size: str | None) -> None:
    """Refuse a --model-size the bundled model `name` does not have (only gpt has sizes)."""
    if name != "gpt" and size is not None:
        raise ConfigError(f"--model-size applies to --model gpt only, not '{name}'.")
    if name == "gpt" and size is not None and size not in SIZES:
        raise ConfigError(
            f"Unknown --model-size '{size}' for gpt; choose one of {', '.join(SIZES)}."
        )


def build(name: str, size: str | None = None) -> nn.Module:
    """A fresh instance of the bundled model `name` (gpt: of `size`, default tiny)."""
    check_size(name, size)
    if name == "gpt":
        return GPT(SIZES[size or "tiny"])
    if name == "cnn":
        return DigitsCNN()
    if name == "mlp":
        return DigitsMLP()
    raise ConfigError(
        f"Unknown model '{name}'. Bundled models: {', '.join(MODELS)}; pick one with --model."
    )
