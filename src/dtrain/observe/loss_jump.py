"""A loss that jumps up while training: the sign of a learning rate too high for the batch.

Synchronous SGD with a learning rate a step too large does not settle: the loss leaps
above where it already was, falls back, leaps again, and may never get below its start.
From the losses read at the log interval (one value per read, already on the host), the
largest rise above an earlier read is compared with the first read: a rise of at least
`JUMP_SHARE` of it, to above the first read, is named. The minibatch noise of a healthy
run, even near a small final loss, stays far below that. A resumed run starts from a loss
already small, whose noise is large beside it: it is not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

JUMP_SHARE = 0.5
"""A rise above an earlier read of at least this share of the first read is named."""

MIN_READS = 4
"""Fewer reads than this say nothing about a trend."""


@dataclass(frozen=True)
class Jump:
    """The largest rise of the loss: from `low` at step `low_step` to `high` at step
    `high_step`, the first read being `first`."""

    low_step: int
    low: float
    high_step: int
    high: float
    first: float

    def message(self, advice: str) -> str:
        """What the run says about it: the figures, then `advice`."""
        return (
            f"The loss jumped from {self.low:.4g} at step {self.low_step} to {self.high:.4g} "
            f"at step {self.high_step} (it started at {self.first:.4g}): the learning rate "
            f"is likely too high for this batch. {advice}"
        )


def largest_jump(reads: list[tuple[int, float]]) -> Jump | None:
    """The largest rise of the loss in `reads` ((step, loss) in step order) above an
    earlier read, if it is at least `JUMP_SHARE` of the first read and ends above the first
    read; None otherwise."""
    if len(reads) < MIN_READS or reads[0][1] <= 0:
        return None
    first = reads[0][1]
    lowest = reads[0]
    best: Jump | None = None
    for step, loss in reads[1:]:
        rise = loss - lowest[1]
        big = rise >= JUMP_SHARE * first and loss > first
        if big and (best is None or rise > best.high - best.low):
            best = Jump(lowest[0], lowest[1], step, loss, first)
        if loss < lowest[1]:
            lowest = (step, loss)
    return best
