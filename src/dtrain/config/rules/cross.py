"""The rules that tie options of different concerns together: which strategies compress
their gradients and with what, and how many backup workers a job's processes allow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.config.rules.slow_links import COMPRESSES_CAST, COMPRESSES_POWERSGD, grad_compression
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config import Config

POWERSGD_NOT_FSDP = (
    " (hsdp's all-reduce across replicas runs inside FSDP2, which reduces in one dtype and "
    "takes no compression hook: fp16 or bf16 compress it)"
)


def check(config: Config) -> None:
    """Raise ConfigError for options that each concern accepts alone but not together."""
    _check_grad_compression(config)
    if not 0 <= config.backup_workers < config.nproc:
        raise ConfigError(
            f"--backup-workers must lie in [0, --nproc) so every round keeps at least one "
            f"gradient; got {config.backup_workers} with --nproc {config.nproc} workers. Lower "
            "--backup-workers or add workers."
        )


def _check_grad_compression(config: Config) -> None:
    """A --grad-compression under a strategy whose gradient exchange it compresses, with
    the links and the precision it can run with."""
    kind, _ = grad_compression(config.grad_compression)
    if kind == "none":
        return
    flag = f"--grad-compression {config.grad_compression}"
    if config.strategy in ("single", "towers"):
        raise ConfigError(
            f"{flag} compresses the gradients processes send each other, and --strategy "
            f"{config.strategy} runs in one process, which sends none; drop the flag, or use "
            "--strategy ddp with --nproc 2 or more."
        )
    allowed = COMPRESSES_POWERSGD if kind == "powersgd" else COMPRESSES_CAST
    if config.strategy not in allowed:
        why = POWERSGD_NOT_FSDP if config.strategy == "hsdp" else ""
        raise ConfigError(
            f"{flag} compresses the gradient all-reduce of --strategy "
            f"{', '.join(allowed[:-1])} or {allowed[-1]}, not {config.strategy}{why}; use one "
            "of those strategies, or drop the flag."
        )
    if kind == "powersgd" and config.hierarchical:
        raise ConfigError(
            f"{flag} cannot run with --hierarchical: PowerSGD issues its all-reduces "
            "from callbacks, while the hierarchical hook must issue every bucket's reduce "
            "and broadcast inside a machine in bucket order on every rank. Use "
            "--grad-compression fp16 or bf16 with --hierarchical, or drop --hierarchical."
        )
    if kind == "powersgd" and config.precision == "fp16-mixed":
        raise ConfigError(
            f"{flag} keeps each step's approximation error to add to the next step, and "
            "under --precision fp16-mixed a step whose gradients overflow would carry its "
            "inf into every later one (and the loss scale changes the error's units); use "
            "--precision bf16-mixed or fp32 with PowerSGD, or --grad-compression fp16."
        )
