"""The names the command line offers, importable without torch.

`dtrain --help` and every argument error answer from these before anything imports torch
(seconds on a loaded machine). The modules that implement the names use the same
constants; the two lists that live in torch-using code, the strategy registry and the GPT
sizes, are checked against these by tests/test_cli_fast.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtrain.errors import ConfigError

STRATEGIES = (
    "single",
    "towers",
    "ddp",
    "local-sgd",
    "ps",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "pipeline",
    "tensor",
    "hybrid",
)
"""`--strategy` names in listing order, simplest first (`strategies.specs.available()`)."""
STRATEGY_ALIASES = {"fsdp": "zero3"}
"""Other accepted `--strategy` names, and the strategy each one names."""

MODELS = ("cnn", "mlp", "gpt")
"""`dtrain demo --model`: the bundled models."""
GPT_SIZES = ("tiny", "small", "medium", "100m")
"""`dtrain demo --model-size`: the GPT sizes, smallest first (`models.gpt.SIZES`)."""
OPTIMIZERS = ("sgd", "adamw")
"""`dtrain demo --optimizer`."""
LR_RULES = ("none", "linear", "sqrt")
"""`dtrain demo --lr-scaling`: how the learning rate follows the global batch."""

# The values Config accepts for --precision, --activation-checkpointing, --schedule,
# --dp-mode, --ps-mode, --outer-optimizer, --checkpoint-format and --logger.
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DP_MODES = ("ddp", "zero2", "zero3")
PS_MODES = ("sync", "async", "ssp")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov")
CHECKPOINT_FORMATS = ("consolidated", "sharded")
LOGGERS = ("csv", "tensorboard")


def unknown_strategy(name: str, known: Sequence[str] = STRATEGIES) -> str:
    """The message for a `--strategy` name that names no strategy."""
    return (
        f"Unknown strategy '{name}'. Known strategies: {', '.join(known)}. "
        "Pick one with --strategy NAME."
    )


def check_strategy(name: str) -> None:
    """Raise ConfigError listing the strategies if `name` is none of them nor an alias."""
    if name not in STRATEGIES and name not in STRATEGY_ALIASES:
        raise ConfigError(unknown_strategy(name))
