"""The rules of the parameter-server options (--strategy ps): servers, update mode,
staleness and backup workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.command_names import PS_MODES
from dtrain.config.rules.choices import given
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config


def check(config: Config) -> None:
    """Raise ConfigError for parameter-server options outside --strategy ps, or that
    contradict one another."""
    flags = given(config, "servers", "ps_mode", "staleness", "backup_workers", "staleness_lr")
    if flags and config.strategy != "ps":
        raise ConfigError(
            f"{', '.join(flags)} configure parameter servers, which --strategy "
            f"{config.strategy} does not use; use --strategy ps, or drop {', '.join(flags)}."
        )
    if config.ps_mode not in PS_MODES:
        raise ConfigError(
            f"--ps-mode must be one of {', '.join(PS_MODES)}, got {config.ps_mode!r}."
        )
    if config.staleness is not None and config.ps_mode != "ssp":
        raise ConfigError(
            f"--staleness bounds how far workers drift apart in --ps-mode ssp, but the mode "
            f"is {config.ps_mode}; add --ps-mode ssp, or drop --staleness."
        )
    if config.staleness is not None and config.staleness < 0:
        raise ConfigError(f"--staleness must be >= 0, got {config.staleness}.")
    if config.backup_workers and config.ps_mode != "sync":
        raise ConfigError(
            "--backup-workers applies to --ps-mode sync (a round takes the first "
            "gradients); drop it, or use --ps-mode sync."
        )
    if config.servers < 1:
        raise ConfigError(
            f"--strategy ps needs at least one server, got --servers {config.servers}; use "
            "--servers 1 or more."
        )
    if config.staleness_lr and config.ps_mode == "sync":
        raise ConfigError(
            "--staleness-aware-lr scales the gradients of --ps-mode async or ssp; sync "
            "gradients are never stale. Drop the flag, or pick async or ssp."
        )
