"""The rules of the options that shape each step's arithmetic: precision, activation
checkpointing, gradient accumulation, clipping and the seed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.command_names import ACTIVATION_CHECKPOINTING, PRECISIONS
from dtrain.config.rules.choices import at_least, one_of
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config


def check(config: Config) -> None:
    """Raise ConfigError for a value no step can compute with."""
    at_least("--grad-accumulation", config.grad_accumulation)
    one_of("--precision", config.precision, PRECISIONS)
    one_of("--activation-checkpointing", config.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    if config.seed is not None and not 0 <= config.seed < 2**64:
        raise ConfigError(
            f"--seed must lie in [0, 2**64), the seeds torch accepts, got {config.seed}; "
            "pick a seed such as 0."
        )
    if config.clip_grad_norm is not None and not config.clip_grad_norm > 0:
        raise ConfigError(
            f"--clip-grad-norm must be positive, got {config.clip_grad_norm}; use a bound such "
            "as 1.0, or drop the flag to train without clipping."
        )
