"""The loss, watched on the device and read back only every few steps.

Reading a CUDA tensor on the host (`.item()`) makes the CPU wait for every kernel queued
before it, so a read per step serialises the host with the device. The watch keeps each
step's loss tensor (detached: no copy, no kernel, no host synchronisation) and reads them
back in one transfer when asked: at the logging interval, before a checkpoint, at the end
of an epoch. The host then finds the first non-finite loss, if any, and the step it
belongs to.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dtrain.errors import NonFiniteLossError


class LossWatch:
    """The losses of the steps since the last read, kept on the device."""

    def __init__(self) -> None:
        self._losses: dict[int, torch.Tensor] = {}
        """The losses since the last read, by optimizer step."""
        self.last: float | None = None
        """The last loss read back (what the progress bar shows)."""
        self.last_step = 0
        """The optimizer step `last` belongs to."""
        self.interval: tuple[float, int] = (math.nan, 0)
        """The mean loss of the global batch over the steps of the last read, and their
        number."""

    @property
    def unread(self) -> bool:
        """True when a loss was recorded since the last read."""
        return bool(self._losses)

    def record(self, loss: torch.Tensor, step: int) -> None:
        """Note `loss` (a scalar tensor) as the loss of optimizer step `step` (1-based; a
        later loss of the same step replaces it); no host synchronisation."""
        self._losses[step] = loss.detach()

    def read(self, group: dist.ProcessGroup | None, distributed: bool) -> float | None:
        """The last loss of the global batch (the mean over `group`'s ranks when
        `distributed`, a collective), read back in one transfer; a NonFiniteLossError on
        every rank of `group` if any of their losses since the last read was NaN or infinite.

        The ranks' losses are summed by one all-reduce (a NaN or an infinity anywhere
        makes its step's sum non-finite on every rank); only then are they gathered, to
        name the rank and the step that went first."""
        if not self._losses:
            return self.last
        losses = torch.stack(list(self._losses.values())).double().reshape(len(self._losses))
        ranks = 1
        if distributed:
            if dist.get_backend(group) == "gloo":
                losses = losses.cpu()  # gloo reduces host tensors; this is the read anyway
            ranks = dist.get_world_size(group)
            mine, losses = losses, losses.clone()
            dist.all_reduce(losses, group=group)
        sums = losses.tolist()
        steps = list(self._losses)
        self.last_step = steps[-1]
        self._losses = {}
        if not all(map(math.isfinite, sums)):
            rows = _gathered(mine, group) if distributed else [sums]
            bad = [
                (steps[slot], rank, value)
                for rank, row in enumerate(rows)
                for slot, value in enumerate(row)
                if not math.isfinite(value)
            ]
            if bad:  # else finite losses whose sum overflowed
                step, rank, value = min(bad, key=lambda b: b[:2])
                if distributed and group is not None:
                    rank = dist.get_global_rank(group, rank)
                raise NonFiniteLossError(step, value, rank if distributed else None)
        # Every rank's share is the same size, so the mean of their means is the loss of the
        # global batch (what `single` shows); ranks holding copies of the loss (tensor,
        # pipeline) are not in `group`: each reads its own.
        self.last = sums[-1] / ranks
        self.interval = (sum(sums) / (ranks * len(sums)), len(sums))
        return self.last


def _gathered(losses: torch.Tensor, group: dist.ProcessGroup | None) -> list[list[float]]:
    """Every rank's `losses` (the same length on each), in rank order."""
    everyone = [torch.empty_like(losses) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, losses, group=group)
    return torch.stack(everyone).tolist()
