"""The loss, watched on the device and read back only every few steps.

Reading a CUDA tensor on the host (`.item()`) makes the CPU wait for every kernel queued
before it, so a read per step serialises the host with the device. The watch keeps the
last loss and the first non-finite one (its step and value) in device tensors, updated
with device operations only, and reads them in one transfer when asked: at the logging
interval, before a checkpoint, at the end of an epoch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.errors import NonFiniteLossError


class LossWatch:
    """Last loss and first non-finite loss of this process, kept on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._state: torch.Tensor | None = None
        """[last loss, first non-finite step (0: none), its loss], float64 on the device."""
        self.last: float | None = None
        """The last loss read back (what the progress bar shows)."""
        self.unread = False
        """True when a loss was recorded since the last read."""

    def record(self, loss: torch.Tensor, step: int) -> None:
        """Note `loss` (a scalar tensor) as the loss of optimizer step `step` (1-based);
        no host synchronisation."""
        loss = loss.detach().to(torch.float64).reshape(())
        if self._state is None:
            self._state = torch.zeros(3, dtype=torch.float64, device=loss.device)
        state = self._state
        first_bad = (~torch.isfinite(loss)) & (state[1] == 0)
        self._state = torch.stack(
            (
                loss,
                torch.where(first_bad, float(step), state[1]),
                torch.where(first_bad, loss, state[2]),
            )
        )
        self.unread = True

    def read(self, group: dist.ProcessGroup | None, distributed: bool) -> float | None:
        """The last loss of the global batch (the mean over `group`'s ranks when
        `distributed`, a collective), read back in one transfer; a NonFiniteLossError on
        every rank if any rank's loss was ever non-finite."""
        if self._state is None:
            return self.last
        state = self._state
        if distributed:
            if dist.get_backend(group) == "gloo":
                state = state.cpu()  # gloo gathers host tensors; this is the read anyway
            everyone = [torch.empty_like(state) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, state, group=group)
            state = torch.stack(everyone)
        values = state.reshape(-1, 3).tolist()
        self.unread = False
        bad = [(step, value, rank) for rank, (_, step, value) in enumerate(values) if step]
        if bad:
            step, value, rank = min(bad)
            raise NonFiniteLossError(int(step), value, rank if distributed else None)
        # Every rank's share is the same size, so the mean of their means is the loss of the
        # global batch (what `single` shows); ranks holding copies (tp, pp) count alike.
        self.last = sum(row[0] for row in values) / len(values)
        return self.last
