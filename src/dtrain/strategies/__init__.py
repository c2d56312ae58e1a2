"""Strategies, one module each, registered by name for `--strategy`."""

from dtrain.strategies import ddp, fsdp, local_sgd, model_parallel, ps, single, towers, zero1
from dtrain.strategies.base import Strategy, available, lookup, register

__all__ = [
    "Strategy",
    "available",
    "lookup",
    "register",
    "ddp",
    "fsdp",
    "local_sgd",
    "model_parallel",
    "ps",
    "single",
    "towers",
    "zero1",
]
