"""The rules of the options that lay out a mesh: hsdp's shard groups, and the degrees,
pipeline shape and data-parallel mode of pipeline, tensor and hybrid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.command_names import DP_MODES, SCHEDULES
from dtrain.config_rules.choices import one_of
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config

MODEL_PARALLEL = ("pipeline", "tensor", "hybrid")
"""The strategies that read --pp, --tp, --dp, --dp-mode and the pipeline's shape."""


def pipeline_flags(config: Config) -> list[str]:
    """The flags `config` gives that shape a pipeline (its micro-batches, stages and
    schedule), which a layout of one stage cannot honour."""
    return [
        flag
        for flag, value in (
            ("--microbatches", config.microbatches),
            ("--virtual-stages", config.virtual_stages),
            ("--split-points", config.split_points),
            ("--schedule", None if config.schedule == "1f1b" else config.schedule),
        )
        if value is not None and value != []  # an empty --split-points splits nothing
    ]


def check(config: Config) -> None:
    """Raise ConfigError for a mesh option its strategy does not lay out, or a value no
    layout can take (layouts that depend on the number of processes are checked by the
    strategy's spec before launch)."""
    if config.shard_size is not None and config.strategy != "hsdp":
        raise ConfigError(
            f"--shard-size sets the shard groups of --strategy hsdp, which --strategy "
            f"{config.strategy} does not use; use --strategy hsdp, or drop --shard-size."
        )
    degrees = [("--pp", config.pp), ("--tp", config.tp), ("--dp", config.dp)]
    given = [flag for flag, value in degrees if value is not None] + pipeline_flags(config)
    if config.dp_mode != "ddp":
        given.append("--dp-mode")
    if given and config.strategy not in MODEL_PARALLEL:
        raise ConfigError(
            f"{', '.join(given)} shape model parallelism, which --strategy "
            f"{config.strategy} does not do; use --strategy pipeline, tensor or hybrid, "
            f"or drop {', '.join(given)}."
        )
    for flag, value in degrees:
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}.")
    one_of("--schedule", config.schedule, SCHEDULES)
    one_of("--dp-mode", config.dp_mode, DP_MODES)
    if config.microbatches is not None and config.microbatches < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {config.microbatches}.")
    if config.virtual_stages is not None:
        if config.schedule != "interleaved":
            raise ConfigError(
                "--virtual-stages places several stages on each pipeline rank, which only "
                "--schedule interleaved runs; add it, or drop --virtual-stages."
            )
        if config.virtual_stages < 2:
            raise ConfigError(f"--virtual-stages must be at least 2, got {config.virtual_stages}.")
