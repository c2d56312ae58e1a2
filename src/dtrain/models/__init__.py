"""Bundled models, by name for `dtrain demo --model NAME [--model-size SIZE]`.

A foundation: it imports the leaves and `dtrain.datasets` (a recipe names its data).
"""

from __future__ import annotations

from dataclasses import replace

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


def check_experts_flags(name: str, experts: int, top_k: int) -> None:
    """Refuse --experts and --top-k that the bundled model `name` cannot take (only gpt
    has experts; top-k between 1 and the experts)."""
    if experts and name != "gpt":
        raise ConfigError(f"--experts applies to --model gpt only, not '{name}'.")
    if experts < 0:
        raise ConfigError(f"--experts must be 0 (a dense MLP) or more, got {experts}.")
    if experts and not 1 <= top_k <= experts:
        raise ConfigError(
            f"--top-k {top_k} routes each token to that many of the {experts} experts; pick "
            "a top-k between 1 and --experts."
        )


def build(name: str, size: str | None = None, experts: int = 0, top_k: int = 2) -> nn.Module:
    """A fresh instance of the bundled model `name` (gpt: of `size`, default tiny; with
    `experts`, each block's MLP a mixture of that many experts, `top_k` per token)."""
    check_size(name, size)
    check_experts_flags(name, experts, top_k)
    if name == "gpt":
        return GPT(replace(SIZES[size or "tiny"], experts=experts, top_k=top_k))
    if name == "cnn":
        return DigitsCNN()
    if name == "mlp":
        return DigitsMLP()
    raise ConfigError(
        f"Unknown model '{name}'. Bundled models: {', '.join(MODELS)}; pick one with --model."
    )
