"""The rules of the options that lay out a mesh: hsdp's shard groups, and the degrees,
pipeline shape and data-parallel mode of pipeline, tensor and hybrid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.command_names import DP_MODES, SCHEDULES
from dtrain.config.rules.choices import at_least, given, one_of
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config

MODEL_PARALLEL = ("pipeline", "tensor", "hybrid")
"""The strategies that read --pp, --tp, --dp, --dp-mode and the pipeline's shape."""
CONTEXT_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tensor", "hybrid")
"""The strategies that cut the sequence over --cp ranks."""
EXPERT_PARALLEL = ("ddp", "zero2", "zero3", "fsdp", "hsdp")
"""The strategies that split mixture-of-experts layers over --ep ranks."""


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
    flags = given(config, "pp", "tp", "dp") + pipeline_flags(config) + given(config, "dp_mode")
    if flags and config.strategy not in MODEL_PARALLEL:
        raise ConfigError(
            f"{', '.join(flags)} shape model parallelism, which --strategy "
            f"{config.strategy} does not do; use --strategy pipeline, tensor or hybrid, "
            f"or drop {', '.join(flags)}."
        )
    for flag, value in (("--pp", config.pp), ("--tp", config.tp), ("--dp", config.dp)):
        at_least(flag, value)
    at_least("--cp", config.cp)
    if config.cp > 1 and (config.strategy or "ddp") not in CONTEXT_PARALLEL:
        raise ConfigError(
            f"--cp {config.cp} cuts each sample's sequence over {config.cp} ranks, which "
            f"--strategy {config.strategy} does not do (context parallelism runs under "
            "ddp, zero1, zero2, zero3, hsdp, tensor and hybrid); use one of those, or drop "
            "--cp."
        )
    if config.cp > 1 and config.compile:
        raise ConfigError(
            "--cp replaces the model's attention for each step with one that gathers the "
            "sequence from the context ranks, which --compile would trace once and keep; "
            "drop --compile with --cp."
        )
    if config.cp > 1 and config.hierarchical:
        raise ConfigError(
            "--hierarchical averages gradients machine by machine over the data-parallel "
            "ranks, but with --cp the context-parallel ranks average theirs too; drop one."
        )
    _check_experts(config)
    one_of("--schedule", config.schedule, SCHEDULES)
    one_of("--dp-mode", config.dp_mode, DP_MODES)
    at_least("--microbatches", config.microbatches)
    if config.virtual_stages is not None:
        if config.schedule != "interleaved":
            raise ConfigError(
                "--virtual-stages places several stages on each pipeline rank, which only "
                "--schedule interleaved runs; add it, or drop --virtual-stages."
            )
        at_least("--virtual-stages", config.virtual_stages, 2)


def _check_experts(config: Config) -> None:
    """--ep under a strategy that splits the experts, without what it cannot run beside."""
    at_least("--ep", config.ep)
    if config.ep == 1:
        return
    if (config.strategy or "ddp") not in EXPERT_PARALLEL:
        raise ConfigError(
            f"--ep {config.ep} splits each mixture-of-experts layer's experts over "
            f"{config.ep} data-parallel ranks, which --strategy {config.strategy} does not "
            "do (expert parallelism runs under ddp, zero2, zero3 and hsdp); use one of "
            "those, or drop --ep."
        )
    for flag, on in (("--cp", config.cp > 1), ("--compile", config.compile)):
        if on:
            raise ConfigError(
                f"--ep with {flag} is not supported yet (the experts' forward sends tokens "
                f"between ranks, which {flag} would change); drop one of them."
            )
