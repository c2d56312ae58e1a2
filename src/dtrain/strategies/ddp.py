"""`ddp`: one process per device on PyTorch DistributedDataParallel.

Every rank starts from rank 0's parameters and buffers (sent at setup, as under every
strategy); DDP averages gradients with bucketed ring all-reduce overlapped with backward
(Li et al., VLDB 2020).
A preset of the mesh strategies: ``dp_replicate = world size``.
"""

from __future__ import annotations

from dtrain.config import Config
from dtrain.parallel.degrees import Degrees
from dtrain.strategies.base import register
from dtrain.strategies.mesh import MeshStrategy


@register
class DDP(MeshStrategy):
    """Data parallel over processes: each holds the whole model and 1/N of the batch."""

    name = "ddp"
    order = 20

    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        return Degrees(dp_replicate=world_size)
