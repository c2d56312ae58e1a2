"""A loss that jumps up while training: the sign of a learning rate too high for the batch.

Synchronous SGD with a learning rate a step too large does not settle: the loss leaps
above where it already was, falls back, leaps again. The losses read at the log interval
are averaged over windows of at least `WINDOW_STEPS` steps, which smooths the noise of
single batches (large beside a small loss, as in fine-tuning); a window whose mean rises
above the lowest earlier window's by at least `JUMP_SHARE` of the first window's, to above
the first window's, is named. A loss that explodes within the first window (itself the
baseline) is not seen; a run that resumed from a checkpoint is not judged at all (its
loss is already small, and the rise is measured against where it started).
"""

from __future__ import annotations

from dataclasses import dataclass

JUMP_SHARE = 0.5
"""A window's rise above the lowest earlier one of at least this share of the first
window's mean is named."""

WINDOW_STEPS = 10
"""The fewest steps whose losses one window averages."""


@dataclass(frozen=True)
class Jump:
    """The largest rise of the loss: from a window of mean `low` ending at step `low_step`
    to one of mean `high` ending at step `high_step`, the first window's mean being
    `first`."""

    low_step: int
    low: float
    high_step: int
    high: float
    first: float

    def message(self, advice: str) -> str:
        """What the run says about it: the figures, then `advice`."""
        return (
            f"The loss jumped from {self.low:.4g} (mean of the steps up to {self.low_step}) "
            f"to {self.high:.4g} (up to step {self.high_step}); it started at "
            f"{self.first:.4g}: the learning rate may be too high for this batch. {advice}"
        )


class LossCourse:
    """The loss's course over a run, window by window, in constant memory: feed it each
    read's interval (`add`), then ask for the largest jump (`jump`)."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._steps = 0
        self._first: float | None = None
        self._lowest: tuple[int, float] = (0, 0.0)
        self.jump: Jump | None = None
        """The largest jump so far, if any window made one."""

    def add(self, step: int, mean: float, steps: int) -> None:
        """The mean loss `mean` of the `steps` steps up to optimizer step `step`."""
        self._sum += mean * steps
        self._steps += steps
        if self._steps >= WINDOW_STEPS:
            self._window(step, self._sum / self._steps)
            self._sum, self._steps = 0.0, 0

    def _window(self, step: int, mean: float) -> None:
        if self._first is None:
            self._first, self._lowest = mean, (step, mean)
            return
        first, (low_step, low) = self._first, self._lowest
        rise = mean - low
        larger = self.jump is None or rise > self.jump.high - self.jump.low
        if larger and rise >= JUMP_SHARE * first and mean > first > 0:
            self.jump = Jump(low_step, low, step, mean, first)
        if mean < low:
            self._lowest = (step, mean)
