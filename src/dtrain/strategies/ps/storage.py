"""A worker's served parameters as views of one flat buffer, and the buffer pulls land in.

Pulled values are received straight into a second flat buffer of the same layout (one
message per bucket, each a contiguous range of it), never into the parameters the model
is using: an in-flight pull cannot tear a forward, a backward's saved tensors or a read of
`engine.module` between steps. `publish` then makes the landed values the parameters'
own: on the CPU by pointing every parameter at the other buffer (no copy, and the old
buffer takes the next pull); on a GPU with one host-to-device copy of the whole buffer
(gloo moves CPU tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from dtrain.errors import ConfigError


class FlatParameters:
    """Own the storage of `params` (same dtype and device), in their order.

    Args:
        params: the served parameters, in optimizer order; their values are kept, their
            storage becomes a view of the flat buffer.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:
            raise ConfigError(
                "--strategy ps keeps the parameters in one flat buffer of one dtype, but the "
                f"optimizer holds parameters of {', '.join(dtypes)}; convert the model to one "
                "dtype (model.float()) before engine.setup."
            )
        self.params = params
        self.device = params[0].device
        numel = sum(p.numel() for p in params)
        dtype = params[0].dtype
        self.current = torch.empty(numel, dtype=dtype, device=self.device)
        on_cpu = self.device.type == "cpu"
        self.incoming = torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda")
        self._views = self._views_of(self.current)
        self._incoming_views = self._views_of(self.incoming) if on_cpu else []
        with torch.no_grad():
            for param, view in zip(params, self._views, strict=True):
                view.copy_(param)
                param.data = view

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for param in self.params:
            views.append(flat[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        return views

    def landing(self, start: int, numel: int) -> torch.Tensor:
        """Where a pull's elements [start, start + numel) are received."""
        return self.incoming[start : start + numel]

    @torch.no_grad()
    def publish(self) -> None:
        """Make the values landed in the incoming buffer the parameters' (every element
        must have landed)."""
        if self.device.type != "cpu":
            # Blocking: the next pull may land in `incoming` as soon as this returns.
            self.current.copy_(self.incoming)
            return
        for param, view in zip(self.params, self._incoming_views, strict=True):
            param.data = view
        self.current, self.incoming = self.incoming, self.current
        self._views, self._incoming_views = self._incoming_views, self._views

    def host(self) -> torch.Tensor:
        """The parameters' values as one flat CPU tensor (their own storage on the CPU)."""
        return self.current if self.device.type == "cpu" else self.current.cpu()

    @torch.no_grad()
    def assign(self, values: torch.Tensor) -> None:
        """Set the parameters from a flat CPU tensor laid out as `host()`."""
        if values.data_ptr() != self.current.data_ptr():
            self.current.copy_(values)
