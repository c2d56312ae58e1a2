"""`ddp`: one process per device on PyTorch DistributedDataParallel.

DDP broadcasts rank 0's parameters at construction (replicas start equal) and averages
gradients with bucketed ring all-reduce overlapped with backward (Li et al., VLDB 2020).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from dtrain.errors import ConfigError
from dtrain.strategies.base import Strategy, register


@register
class DDP(Strategy):
    """Data parallel over processes: each holds the whole model and 1/N of the batch."""

    name = "ddp"
    multiprocess = True
    supports_sync_batchnorm = True
    order = 20

    def setup(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        device = self.topology.device
        model = model.to(device)
        if self.config.sync_batchnorm:
            if device.type != "cuda":
                raise ConfigError(
                    "--sync-batchnorm needs GPUs: PyTorch's SyncBatchNorm runs on CUDA only. "
                    "Drop the flag on the CPU (each worker then keeps its own statistics)."
                )
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self._module = model
        self.model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        return self.model, optimizer

    def unwrap(self) -> nn.Module:
        return self._module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        assert isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync():
            yield

    def close(self) -> None:
        # A DDP object alive when the process group is destroyed can abort the process.
        self.model = None
        gc.collect()
