"""Strategies, one module each, registered by name for `--strategy`."""

from dtrain.strategies import ddp, ps, single, towers
from dtrain.strategies.base import Strategy, available, lookup, register

__all__ = ["Strategy", "available", "lookup", "register", "ddp", "ps", "single", "towers"]
