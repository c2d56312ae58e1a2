"""A progress bar for the main rank: loss, samples/s and ETA; silent on other ranks."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

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


PLAIN_EVERY_S = 30.0
"""Seconds between the plain progress lines written where no terminal shows a bar."""

POSTFIX_EVERY_S = 0.5
"""Seconds between updates of the bar's loss and samples/s (its redraw interval)."""


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
    finish: Callable[[], object] | None = None,
    stream: TextIO | None = None,
) -> Iterator[T]:
    """Yield `items`, timing them into `throughput`; show progress when `enabled`.

    On a terminal (or in a notebook) the progress is a bar redrawn in place; elsewhere (a
    log file, a pipe) it is a plain line every PLAIN_EVERY_S seconds and one at the end,
    so that files get whole lines, not a bar's carriage-return redraws.

    Args:
        items: the batches.
        total: how many will be yielded (for the ETA); None if unknown (a stream).
        samples_per_item: global samples per batch.
        throughput: accumulates samples and seconds.
        loss: returns the latest loss to show, or None.
        desc: label on the left of the bar.
        enabled: show progress (main rank only).
        waited: told (start, end) of each wait for the next item (``time.perf_counter``).
        finish: called on every rank once every item was yielded, before the progress
            ends (the Engine reads the last losses there, so the last loss shown is the
            last step's).
        stream: where progress goes (default: standard error).
    """
    stream = sys.stderr if stream is None else stream
    live = enabled and _redraws(stream)
    bar = tqdm(
        total=total,
        desc=desc,
        disable=not live,
        file=stream,
        leave=True,
        dynamic_ncols=True,
        unit="step",
        mininterval=POSTFIX_EVERY_S,
    )
    epoch_samples, epoch_start = 0, time.perf_counter()
    start = last_line = last_postfix = epoch_start
    steps = 0

    def shown(separator: str = " ") -> str:
        value = loss()
        rate = epoch_samples / max(time.perf_counter() - epoch_start, 1e-9)
        parts = [f"loss={value:.4f}"] if value is not None else []
        return separator.join([*parts, f"{rate:,.0f} samples/s"])

    def line() -> None:
        nonlocal last_line
        last_line = time.perf_counter()
        count = f"{steps}/{total}" if total is not None else f"{steps}"
        print(f"{desc}: {count} steps, {shown(', ')}", file=stream, flush=True)

    def done() -> None:
        nonlocal epoch_samples, start, steps, last_postfix
        now = time.perf_counter()
        throughput.seconds += now - start
        throughput.samples += samples_per_item
        epoch_samples += samples_per_item
        steps += 1
        start = now
        if live:
            if now - last_postfix >= POSTFIX_EVERY_S:  # not a string per step
                last_postfix = now
                bar.set_postfix_str(shown(), refresh=False)
            bar.update(1)
        elif enabled and now - last_line >= PLAIN_EVERY_S:
            line()

    try:
        for item in _timed(items, waited):
            try:
                yield item
            except GeneratorExit:
                done()  # the loop broke out after using this item (e.g. --steps reached)
                raise
            done()
        if finish is not None:
            finish()
        if live:
            bar.set_postfix_str(shown(), refresh=False)
    finally:
        bar.close()
        if enabled and not live and steps:
            line()


def _redraws(stream: TextIO) -> bool:
    """Whether `stream` shows a bar redrawn in place: a terminal, or a notebook's output
    (ipykernel's streams are no terminal, but their cells handle carriage returns)."""
    if type(stream).__module__.startswith("ipykernel"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


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
