"""`ddp`: one process per device on PyTorch DistributedDataParallel.

DDP broadcasts rank 0's parameters at construction (replicas start equal) and averages
gradients with bucketed ring all-reduce overlapped with backward (Li et al., VLDB 2020).
A preset of the mesh strategies: ``dp_replicate = world size``.
"""

from __future__ import annotations

from torch import nn

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.degrees import Degrees
from dtrain.strategies.base import register
from dtrain.strategies.mesh import MeshStrategy

SYNC_BATCHNORM_NEEDS_GPUS = (
    "--sync-batchnorm needs GPUs: PyTorch's SyncBatchNorm runs on CUDA only. Drop the flag "
    "on the CPU (each worker then keeps its own statistics)."
)


@register
class DDP(MeshStrategy):
    """Data parallel over processes: each holds the whole model and 1/N of the batch."""

    name = "ddp"
    supports_sync_batchnorm = True
    order = 20

    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        return Degrees(dp_replicate=world_size)

    def prepare(self, model: nn.Module) -> nn.Module:
        """SyncBatchNorm layers when asked for (their statistics span every replica)."""
        if not self.config.sync_batchnorm:
            return model
        if self.topology.device.type != "cuda":
            raise ConfigError(SYNC_BATCHNORM_NEEDS_GPUS)
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, self.mesh.dp_group)
