"""The rules of the options for slow links between machines: --hierarchical,
--grad-compression (its parser too) and local SGD's syncs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dtrain.command_names import OUTER_OPTIMIZERS
from dtrain.config.rules.choices import given, one_of
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config

GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
"""The kinds of --grad-compression (powersgd takes an optional :RANK)."""
COMPRESSES_CAST = ("ddp", "zero1", "hsdp")
"""The strategies whose gradient exchange fp16 and bf16 compress."""
COMPRESSES_POWERSGD = ("ddp", "zero1")
"""The strategies whose gradient exchange PowerSGD compresses: DDP's, through its hook."""


def grad_compression(text: str) -> tuple[str, int]:
    """(kind, PowerSGD rank) of ``--grad-compression``: ``powersgd:4`` is ("powersgd", 4),
    ``powersgd`` rank 1, the others rank 0 (unused); a ConfigError listing the choices."""
    kind, colon, rank = text.partition(":")
    if kind not in GRAD_COMPRESSIONS or (colon and kind != "powersgd"):
        raise ConfigError(
            f"Unknown --grad-compression '{text}'; choose one of none, fp16, bf16, powersgd or "
            "powersgd:RANK (for example powersgd:4)."
        )
    if kind != "powersgd":
        return kind, 0
    if not colon:
        return kind, 1
    if not (rank.isascii() and rank.isdigit()) or int(rank) < 1:
        raise ConfigError(
            f"--grad-compression powersgd:RANK needs a whole RANK of at least 1, got '{rank}'; "
            "for example powersgd:4 (powersgd alone is rank 1)."
        )
    return kind, int(rank)


def training_of(strategy: str, setting: str) -> str:
    """How faithfully `strategy` with --grad-compression `setting` trains `single`'s
    model: "exact" (the same, up to float rounding); "rounded" (each gradient is cast to
    16 bits for its reduction: the same training within the format's rounding, as the
    cast keeps each gradient's direction); "approximate" (PowerSGD's low-rank factors,
    local SGD's and DiLoCo's replicas that drift apart between syncs: the loss can
    differ). The planner ranks by it and the diagnosis words its advice by it."""
    if strategy == "local-sgd":
        return "approximate"
    kind, _ = grad_compression(setting)
    if kind == "none":
        return "exact"
    return "approximate" if kind == "powersgd" else "rounded"


def check(config: Config) -> None:
    """Raise ConfigError for a slow-link option its strategy does not run, or a value
    outside its range (which strategies compress is checked across concerns)."""
    grad_compression(config.grad_compression)
    if config.hierarchical and config.strategy != "ddp":
        raise ConfigError(
            f"--hierarchical arranges ddp's gradient all-reduce by machine, which "
            f"--strategy {config.strategy} does not run; use --strategy ddp (or hsdp, which "
            "shards inside a machine and replicates across), or drop --hierarchical."
        )
    _check_local_sgd(config)


def _check_local_sgd(config: Config) -> None:
    flags = given(config, "sync_every", "outer_optimizer", "outer_lr", "outer_momentum")
    if flags and config.strategy != "local-sgd":
        raise ConfigError(
            f"{', '.join(flags)}: options of the syncs of --strategy local-sgd, which "
            f"--strategy {config.strategy} does not run; use --strategy local-sgd, or drop "
            f"{', '.join(flags)}."
        )
    if config.sync_every is not None and config.sync_every < 1:
        raise ConfigError(
            f"--sync-every must be at least 1 (optimizer steps between two syncs), got "
            f"{config.sync_every}."
        )
    one_of("--outer-optimizer", config.outer_optimizer, OUTER_OPTIMIZERS)
    outer = given(config, "outer_lr", "outer_momentum")
    if outer and config.outer_optimizer == "none":
        raise ConfigError(
            f"{', '.join(outer)}: options of DiLoCo's outer optimizer, which plain "
            "averaging (--outer-optimizer none) does not have; add --outer-optimizer sgd "
            f"or nesterov, or drop {', '.join(outer)}."
        )
    if config.outer_lr is not None and not 0 < config.outer_lr < math.inf:  # false for nan
        raise ConfigError(
            f"--outer-lr must be a positive number, got {config.outer_lr}; DiLoCo uses 0.7 "
            "with nesterov, and 1.0 with sgd equals plain averaging."
        )
    if config.outer_momentum is not None and not 0 <= config.outer_momentum < 1:
        raise ConfigError(
            f"--outer-momentum must lie in [0, 1), got {config.outer_momentum}; DiLoCo uses 0.9."
        )
    if config.outer_optimizer == "nesterov" and config.outer_momentum == 0:
        raise ConfigError(
            "--outer-optimizer nesterov needs a momentum above 0; drop --outer-momentum 0 "
            "(default 0.9), or use --outer-optimizer sgd."
        )
