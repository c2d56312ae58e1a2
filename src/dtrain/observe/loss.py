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
        every rank if any rank's loss since the last read was NaN or infinite."""
        if not self._losses:
            return self.last
        losses = torch.stack(list(self._losses.values())).double().reshape(len(self._losses))
        if distributed:
            if dist.get_backend(group) == "gloo":
                losses = losses.cpu()  # gloo gathers host tensors; this is the read anyway
            everyone = [torch.empty_like(losses) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, losses, group=group)
            rows = torch.stack(everyone).tolist()
        else:
            rows = [losses.tolist()]
        steps = list(self._losses)
        self.last_step = steps[-1]
        self._losses = {}
        bad = [
            (steps[slot], value, rank)
            for rank, row in enumerate(rows)
            for slot, value in enumerate(row)
            if not math.isfinite(value)
        ]
        if bad:
            step, value, rank = min(bad)
            raise NonFiniteLossError(step, value, rank if distributed else None)
        # Every rank's share is the same size, so the mean of their means is the loss of the
        # global batch (what `single` shows); ranks holding copies (tp, pp) count alike.
        self.last = sum(row[-1] for row in rows) / len(rows)
        count = len(rows[0])
        self.interval = (sum(map(sum, rows)) / (len(rows) * count), count)
        return self.last
