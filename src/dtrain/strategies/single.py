"""`single`: one process, one device; the reference every other strategy must match."""

from __future__ import annotations

from dtrain.strategies.base import Strategy, register


@register
class Single(Strategy):
    """Train on one device exactly as a plain PyTorch loop would."""

    name = "single"
    order = 0
