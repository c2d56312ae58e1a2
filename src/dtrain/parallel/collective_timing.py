"""Collectives inside a forward or backward, marked for the step's breakdown.

A strategy's own collectives that run inside the model's forward or backward (context
parallelism's gathers, expert parallelism's all-to-alls) would count as compute; wrapped
in `timed`, they tell the strategy's handover when they start and end, and the breakdown
counts them as communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol


class CollectiveTiming(Protocol):
    """Whom a strategy's collectives tell when they start and end (its handover)."""

    collective_started: Callable[[], None]
    collective_ended: Callable[[], None]


@contextlib.contextmanager
def timed(timing: CollectiveTiming | None) -> Iterator[None]:
    """The block's time counts as communication in the step's breakdown."""
    if timing is None:
        yield
        return
    timing.collective_started()
    try:
        yield
    finally:
        timing.collective_ended()
