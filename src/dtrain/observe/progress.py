"""A progress bar for the main rank: loss, samples/s and ETA; silent on other ranks."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Throughput:
    """Counts samples and the seconds spent producing them (over all ranks)."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0

    @property
    def samples_per_second(self) -> float:
        """Samples per second so far (0 before the first step)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def steady_rate(summary: dict[str, Any]) -> float | None:
    """Samples/s from the end-of-run `summary` (the metrics JSON's ``breakdown`` and
    ``global_batch_size``): the global batch over the median step, mean over ranks; None
    without them. The figure for loops that do not go through `engine.progress`."""
    breakdown, batch = summary.get("breakdown"), summary.get("global_batch_size")
    if not breakdown or not batch:
        return None
    return float(batch) / (sum(rank["step"] for rank in breakdown) / len(breakdown))


def track(
    items: Iterable[T],
    *,
    total: int | None,
    samples_per_item: int,
    throughput: Throughput,
    loss: Callable[[], float | None],
    desc: str,
    enabled: bool,
    waited: Callable[[float, float], None] | None = None,
) -> Iterator[T]:
    """Yield `items`, timing them into `throughput`; draw a bar when `enabled`.

    Args:
        items: the batches.
        total: how many will be yielded (for the ETA); None if unknown (a stream).
        samples_per_item: global samples per batch.
        throughput: accumulates samples and seconds.
        loss: returns the latest loss to show, or None.
        desc: label on the left of the bar.
        enabled: draw the bar (main rank only).
        waited: told (start, end) of each wait for the next item (``time.perf_counter``).
    """
    bar = tqdm(
        total=total,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        leave=True,
        dynamic_ncols=True,
        unit="step",
        mininterval=0.5,
    )
    epoch_samples, epoch_start = 0, time.perf_counter()
    start = epoch_start

    def done() -> None:
        nonlocal epoch_samples, start
        now = time.perf_counter()
        throughput.seconds += now - start
        throughput.samples += samples_per_item
        epoch_samples += samples_per_item
        start = now
        if enabled:
            value = loss()
            rate = epoch_samples / max(now - epoch_start, 1e-9)
            shown = (f"loss={value:.4f} " if value is not None else "") + f"{rate:,.0f} samples/s"
            bar.set_postfix_str(shown, refresh=False)
            bar.update(1)

    try:
        for item in _timed(items, waited):
            try:
                yield item
            except GeneratorExit:
                done()  # the loop broke out after using this item (e.g. --steps reached)
                raise
            done()
    finally:
        bar.close()


def _timed(items: Iterable[T], waited: Callable[[float, float], None] | None) -> Iterator[T]:
    """`items`, telling `waited` how long each one took to arrive."""
    if waited is None:
        yield from items
        return
    iterator = iter(items)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        waited(start, time.perf_counter())
        yield item
