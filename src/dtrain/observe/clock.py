"""Time stamps that never make the host wait for the device.

On the CPU a mark is ``time.perf_counter()``. On a GPU it is a CUDA event recorded on the
current stream: recording costs microseconds and does not synchronise; the events are
turned into seconds later, at a point where the host waits for the device anyway (a loss
read, the end of the run). Both clocks count seconds from their origin, the moment the
ranks were aligned, so marks of different ranks share one time line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

Mark = Any
"""A float (host seconds) or a ``torch.cuda.Event``."""


class HostClock:
    """Marks from ``time.perf_counter``, in seconds since `origin`."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def restart(self) -> None:
        """Put the origin at now (after the ranks met at a barrier)."""
        self.origin = time.perf_counter()

    def mark(self, again: Mark | None = None) -> Mark:
        """A mark for now (`again` is for the CUDA clock's reuse of an event)."""
        return time.perf_counter()

    def reader(self, last: Mark) -> Callable[[Mark], float]:
        """A function that turns a mark recorded no later than `last` into seconds since
        the origin."""
        origin = self.origin
        return lambda mark: mark - origin


class CudaClock(HostClock):
    """Marks from CUDA events on the current stream of `device`, resolved lazily."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.restart()

    def restart(self) -> None:
        """Record the origin event and note the host time it stands for: waits once for the
        device, at setup, so host-measured spans (the data wait) can join the time line."""
        self._origin_event = torch.cuda.Event(enable_timing=True)
        self._origin_event.record()
        self._origin_event.synchronize()
        self.origin = time.perf_counter()

    def mark(self, again: Mark | None = None) -> Mark:
        """Record an event now; `again` re-records that event instead of a new one (the
        last record wins), for a mark that moves, such as "the last gradient is ready"."""
        event = again if again is not None else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reader(self, last: Mark) -> Callable[[Mark], float]:
        """As the host clock's; waits once for `last`, which callers ask for only once it
        is known to be done."""
        last.synchronize()
        origin = self._origin_event
        return lambda mark: origin.elapsed_time(mark) / 1000.0


def clock_for(device: torch.device) -> HostClock:
    """The clock for work on `device`: CUDA events on a GPU, the host clock otherwise."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
