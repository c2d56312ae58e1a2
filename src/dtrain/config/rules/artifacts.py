"""The rules of the options that say what a run writes: logs, metrics, the trace and
checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.command_names import CHECKPOINT_FORMATS, LOGGERS
from dtrain.config.rules.choices import at_least, one_of
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config


def check(config: Config) -> None:
    """Raise ConfigError for an output the run could not write as asked."""
    at_least("--log-every", config.log_every)
    step_window(config.trace_steps)
    _check_paths(config)
    unknown = sorted(set(config.logger or ()) - set(LOGGERS))
    if unknown:
        raise ConfigError(
            f"Unknown --logger {', '.join(unknown)}; choose from {', '.join(LOGGERS)} "
            "(comma-separated for both)."
        )
    one_of("--checkpoint-format", config.checkpoint_format, CHECKPOINT_FORMATS)
    if config.async_checkpoint and config.checkpoint_format != "sharded":
        raise ConfigError(
            "--async-checkpoint writes sharded checkpoints in the background; add "
            "--checkpoint-format sharded, or drop --async-checkpoint."
        )


def _check_paths(config: Config) -> None:
    """An empty path would quietly fall back to the default (--out) or to the current
    directory; refuse it by name."""
    for flag, value, example in (
        ("--out", config.out, "runs/exp1"),
        ("--metrics-json", config.metrics_json, "runs/exp1/metrics.json"),
        ("--trace", config.trace, "runs/exp1/trace.json"),
    ):
        if value is not None and not value.strip():
            raise ConfigError(
                f"{flag} names no path (it is {value!r}); give one such as {example}, or "
                f"drop {flag}."
            )


def step_window(text: str) -> tuple[int, int]:
    """(A, B) of ``--trace-steps A:B``: optimizer steps A+1 to B, counted from 1 as the
    progress bar and the trace's events count them; a ConfigError otherwise."""
    first, colon, last = text.partition(":")
    try:
        window = int(first), int(last)
    except ValueError:
        window = (-1, -1)
    if not colon or window[0] < 0 or window[1] <= window[0]:
        raise ConfigError(
            f"--trace-steps must be A:B with 0 <= A < B (steps A+1 to B), got '{text}'; for "
            "example --trace-steps 10:30."
        )
    return window
